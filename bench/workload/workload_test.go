package workload

import (
	"bytes"
	"reflect"
	"testing"
)

func TestDeterministic(t *testing.T) {
	a, err := Steps(Default(7), 20, 96)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Steps(Default(7), 20, 96)
	c, _ := Steps(Default(8), 20, 96)
	if !reflect.DeepEqual(a, b) {
		t.Error("same seed, different stream")
	}
	if reflect.DeepEqual(a, c) {
		t.Error("different seeds, same stream")
	}
}

// Chats of a system prompt share its blocks, a later turn extends the
// earlier one's prefix, and scans share nothing.
func TestPrefixes(t *testing.T) {
	steps, err := Steps(Default(1), 60, 96)
	if err != nil {
		t.Fatal(err)
	}
	cfg := Default(1)
	keys := map[string]bool{}
	var kinds [NumKinds]int
	sharedSystem, extended := false, false
	var chats []Request
	for _, s := range steps {
		used := 0
		for _, r := range s {
			used += len(r.Keys)
			kinds[r.Kind]++
			switch r.Kind {
			case Scan:
				for _, k := range r.Keys {
					if keys[string(k)] {
						t.Fatalf("scan %s reuses a key", r.ID)
					}
				}
			case Chat:
				for _, o := range chats {
					if bytes.Equal(o.Keys[cfg.SystemBlocks-1], r.Keys[cfg.SystemBlocks-1]) {
						sharedSystem = true
					}
					if len(o.Keys) < len(r.Keys) && bytes.Equal(o.Keys[len(o.Keys)-1], r.Keys[len(o.Keys)-1]) {
						extended = true
					}
				}
				chats = append(chats, r)
			}
			for _, k := range r.Keys {
				keys[string(k)] = true
			}
		}
		if used > 96 || len(s) == 0 {
			t.Fatalf("step of %d requests uses %d blocks", len(s), used)
		}
	}
	if !sharedSystem || !extended || kinds[Chat] == 0 || kinds[RAG] == 0 || kinds[Scan] == 0 {
		t.Errorf("shared system prompt %v, extended chat %v, kinds %v", sharedSystem, extended, kinds)
	}
	if d := Distinct(steps); d != len(keys) {
		t.Errorf("Distinct = %d, want %d", d, len(keys))
	}
}

// Expand keeps prefixes: two requests share exactly n times the blocks
// they shared before, and no key of one block's expansion is another's.
func TestExpandKeepsPrefixes(t *testing.T) {
	steps, err := Steps(Default(7), 6, 64)
	if err != nil {
		t.Fatal(err)
	}
	const n = 4
	x := Expand(steps, n)
	if Distinct(x) != n*Distinct(steps) {
		t.Fatalf("%d distinct keys expanded, want %d", Distinct(x), n*Distinct(steps))
	}
	shared := func(a, b [][]byte) int {
		i := 0
		for i < len(a) && i < len(b) && string(a[i]) == string(b[i]) {
			i++
		}
		return i
	}
	var flat, flatX []Request
	for i := range steps {
		flat, flatX = append(flat, steps[i]...), append(flatX, x[i]...)
	}
	for i := range flat {
		for j := range flat {
			if got, want := shared(flatX[i].Keys, flatX[j].Keys), n*shared(flat[i].Keys, flat[j].Keys); got != want {
				t.Fatalf("requests %s and %s share %d expanded blocks, want %d", flat[i].ID, flat[j].ID, got, want)
			}
		}
	}
}
