package model

import (
	"testing"
)

func key(b byte) []byte {
	k := make([]byte, HashBytes)
	for i := range k {
		k[i] = b + byte(i)
	}
	return k
}

func TestPresets(t *testing.T) {
	for _, c := range []struct {
		name       string
		seg, block int
	}{
		{"llama-8b", 32 << 10, 2 << 20},
		{"llama-70b", 32 << 10, 5 << 20},
	} {
		s := Presets[c.name]
		if err := s.Validate(); err != nil {
			t.Fatal(err)
		}
		if s.SegmentBytes() != c.seg || s.BlockBytes() != c.block {
			t.Errorf("%s: segment %d block %d, want %d and %d", c.name, s.SegmentBytes(), s.BlockBytes(), c.seg, c.block)
		}
	}
}

// Every bit of a segment, and the segment and key it belongs to, are
// checked: a flip anywhere, another segment's bytes or another key's bytes
// all fail.
func TestCheckCatches(t *testing.T) {
	const n = 4096
	got := make([]byte, n)
	FillSegment(got, key(1), 3)
	if i := CheckSegment(got, key(1), 3); i != -1 {
		t.Fatalf("fresh segment fails at %d", i)
	}
	for bit := 0; bit < n*8; bit++ {
		got[bit/8] ^= 1 << (bit % 8)
		if i := CheckSegment(got, key(1), 3); i != bit/8 {
			t.Fatalf("flip of bit %d: CheckSegment = %d, want %d", bit, i, bit/8)
		}
		got[bit/8] ^= 1 << (bit % 8)
	}
	if CheckSegment(got, key(1), 4) == -1 || CheckSegment(got, key(2), 3) == -1 {
		t.Error("another segment's or key's bytes pass")
	}
	if CheckSegment(make([]byte, n), key(1), 3) == -1 {
		t.Error("a zeroed (poisoned) segment passes")
	}
}

func TestRegion(t *testing.T) {
	s := Shape{Name: "tiny", Layers: 2, BlockTokens: 4, KVHeads: 2, HeadDim: 8, DTypeBytes: 2}
	r, err := NewRegion(t.TempDir(), s, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	r.Fill(1, key(9))
	if err := r.Check(1, key(9)); err != nil {
		t.Fatal(err)
	}
	if r.Check(0, key(9)) == nil || r.Check(2, key(9)) == nil {
		t.Error("neighbouring blocks pass")
	}
	r.Poison(1)
	if r.Check(1, key(9)) == nil {
		t.Error("a poisoned block passes")
	}
	if w := r.Wire(); len(w) != 4 || w[3].Offset != uint64(3*3*s.SegmentBytes()) {
		t.Errorf("wire regions %v", w)
	}
}

func BenchmarkFill(b *testing.B) {
	buf := make([]byte, 32<<10)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		FillSegment(buf, key(1), 5)
	}
}

func BenchmarkCheck(b *testing.B) {
	buf := make([]byte, 32<<10)
	FillSegment(buf, key(1), 5)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		if CheckSegment(buf, key(1), 5) != -1 {
			b.Fatal("mismatch")
		}
	}
}
