package model

import (
	"reflect"
	"strings"
	"testing"
)

// The pieces the runner trusts: block bytes tell whose they are, the
// generator repeats itself, reduced sequences print and parse back.

func TestContentNamesItsOwner(t *testing.T) {
	k := KeyRef{NS: 3, Group: 1, Chain: 7, Pos: 11}
	seg := make([]byte, 2048)
	FillSegment(seg, k, 2, 5)
	if ok, _ := SegmentMatches(seg, k, 2, 5); !ok {
		t.Fatal("a segment does not match its own bytes")
	}
	for _, other := range []struct {
		k   KeyRef
		gen uint32
		seg int
	}{{k, 1, 5}, {k, 2, 4}, {KeyRef{NS: 2, Group: 1, Chain: 7, Pos: 11}, 2, 5}, {KeyRef{NS: 3, Group: 1, Chain: 7, Pos: 10}, 2, 5}} {
		if ok, _ := SegmentMatches(seg, other.k, other.gen, other.seg); ok {
			t.Errorf("%s gen %d seg %d matches the bytes of %s gen 2 seg 5", other.k, other.gen, other.seg, k)
		}
	}
	if d := Describe(seg); d != "ns3/g1/c7.11 gen 2 segment 5" {
		t.Errorf("Describe = %q", d)
	}
	seg[1000] ^= 1
	if ok, at := SegmentMatches(seg, k, 2, 5); ok || at != 1000 {
		t.Errorf("one flipped byte: match %v at %d, want a mismatch at 1000", ok, at)
	}
	if d := Describe(seg); !strings.Contains(d, "torn at byte 1000") {
		t.Errorf("Describe of a torn segment = %q", d)
	}
	Poison(seg, 42)
	if d := Describe(seg); !strings.Contains(d, "poison of load job 42") {
		t.Errorf("Describe of a poisoned segment = %q", d)
	}
	clear(seg)
	if d := Describe(seg); d != "zeros" {
		t.Errorf("Describe of zeros = %q", d)
	}
}

func TestHashesAreDistinct(t *testing.T) {
	seen := map[string]KeyRef{}
	for _, hb := range []int{16, 32} {
		for c := 0; c < 64; c++ {
			for p := 0; p < 64; p++ {
				h := string(Hash(c, p, hb))
				if len(h) != hb {
					t.Fatalf("hash of %d bytes, want %d", len(h), hb)
				}
				if o, dup := seen[h]; dup {
					t.Fatalf("chain %d pos %d has the hash of %v", c, p, o)
				}
				seen[h] = KeyRef{Chain: c, Pos: p}
			}
		}
	}
}

func TestGeneratorRepeats(t *testing.T) {
	sh := NamedShape("faults")
	a := Generate(7, sh, 500, nil)
	b := Generate(7, sh, 500, nil)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed gave two sequences")
	}
	if reflect.DeepEqual(a, Generate(8, sh, 500, nil)) {
		t.Fatal("two seeds gave one sequence")
	}
	kinds := map[Kind]int{}
	for _, op := range a {
		kinds[op.Kind]++
	}
	for k := Kind(0); k < numKinds; k++ {
		if kinds[k] == 0 && k != Check && k != Kill && k != RegisterRace && k != Unregister {
			t.Errorf("500 operations and no %s", k)
		}
	}
	off := map[Kind]bool{Restart: true, Kill: true, Store: true}
	for _, op := range Generate(7, sh, 500, off) {
		if off[op.Kind] {
			t.Fatalf("generated %s with it turned off", op)
		}
	}
}

func TestKeepRoundTrips(t *testing.T) {
	keep := []int{0, 1, 2, 3, 17, 45, 46, 47, 99}
	s := FormatKeep(keep)
	if s != "0-3,17,45-47,99" {
		t.Fatalf("FormatKeep = %q", s)
	}
	back, err := ParseKeep(s)
	if err != nil || !reflect.DeepEqual(back, keep) {
		t.Fatalf("ParseKeep(%q) = %v, %v", s, back, err)
	}
	for _, bad := range []string{"x", "3-1", "1-x"} {
		if _, err := ParseKeep(bad); err == nil {
			t.Errorf("ParseKeep(%q) accepted", bad)
		}
	}
}

func TestCountGoroutines(t *testing.T) {
	dump := `goroutine profile: total 6
3 @ 0x1 0x2
#	0x1	github.com/dgraph-io/ristretto/v2.(*Cache).processItems+0x1

2 @ 0x3
#	0x3	main.run+0x1

1 @ 0x4
#	0x4	net/http.(*Server).Serve+0x1
`
	if n := countGoroutines(dump, ""); n != 6 {
		t.Errorf("all: %d, want 6", n)
	}
	if n := countGoroutines(dump, "ristretto"); n != 3 {
		t.Errorf("without ristretto: %d, want 3", n)
	}
}
