package slots

import (
	"math/rand/v2"
	"testing"
)

// records against a map, through growth, removals that move the last
// record, and reuse: every held key found at its record, no other found,
// the numbers dense.
func TestRecordsAgainstMap(t *testing.T) {
	var recs records
	want := map[uint64]bool{}
	r := rand.New(rand.NewPCG(1, 2))
	for step := range 100_000 {
		// Keys from a small range collide in the table's low bits; a
		// few are 0 and high values.
		h := uint64(r.IntN(20_000)) << 7
		if step%3 == 0 {
			h = r.Uint64N(1 << 14)
		}
		if rec, ok := recs.lookup(h); ok != want[h] {
			t.Fatalf("step %d: lookup(%x) found %v, want %v", step, h, ok, want[h])
		} else if ok {
			if recs.key(rec) != h {
				t.Fatalf("step %d: record %d of %x has key %x", step, rec, h, recs.key(rec))
			}
			if r.IntN(2) == 0 {
				recs.remove(rec)
				delete(want, h)
			}
		} else {
			recs.add(h)
			want[h] = true
		}
		if recs.len() != len(want) {
			t.Fatalf("step %d: %d records, want %d", step, recs.len(), len(want))
		}
	}
	for i := range uint32(recs.len()) {
		h := recs.key(i)
		if got, ok := recs.lookup(h); !ok || got != i || !want[h] {
			t.Fatalf("record %d (key %x): lookup %d %v, held %v", i, h, got, ok, want[h])
		}
	}
	for h := range want {
		rec, _ := recs.lookup(h)
		recs.remove(rec)
	}
	if recs.len() != 0 {
		t.Fatalf("%d records left", recs.len())
	}
	if _, ok := recs.lookup(0); ok {
		t.Fatal("an empty table found a key")
	}
}
