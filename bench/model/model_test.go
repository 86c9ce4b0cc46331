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

// The hybrid presets are grouped and sized as vLLM would: a 3:1
// local:global pattern of 32 layers gives four groups of 8 layers, and a
// Mamba2 layer of 64 heads x 64 with d_state 128 needs a 272-token
// attention block (16 x ceil(1074688 / (16 x 4096))).
func TestHybridPresets(t *testing.T) {
	swa := HybridPresets["hybrid-swa"]()
	if err := swa.Validate(); err != nil {
		t.Fatal(err)
	}
	if len(swa.Groups) != 4 || swa.Groups[0].Kind != FullAttention || swa.Groups[0].Layers != 8 ||
		swa.Groups[1].Kind != SlidingWindow || swa.Groups[1].WindowBlocks() != 8 || swa.UnitBytes() != 2<<20 || swa.FullBytes() != 512<<10 {
		t.Errorf("hybrid-swa: %s", swa)
	}
	m := HybridPresets["hybrid-mamba"]()
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	if len(m.Groups) != 7 || m.BlockTokens() != 272 || m.Groups[1].Kind != MambaState || m.Groups[1].WindowBlocks() != 1 ||
		m.Groups[1].BlockBytes() != 3*(64*64+2*128)*2+64*64*128*2 || m.FullBytes() != 2*272*8*128*2 {
		t.Errorf("hybrid-mamba: %s", m)
	}
	if all := m.AllFull(); all.UnitBytes() != m.UnitBytes() || all.Groups[1].WindowBlocks() != 0 {
		t.Errorf("all-full treatment of %s: %s", m.Name, all)
	}
	// 5 full + 12 local: under 1.5x apart? no (12 >= 7.5): groups of 5.
	g := vllmGroups([]Group{{Segments: []int{8}}, {Kind: SlidingWindow, Segments: []int{8}}}, []int{5, 12})
	if len(g) != 4 || g[0].Layers != 5 || g[1].Layers+g[2].Layers+g[3].Layers != 12 {
		t.Errorf("5 full + 12 sliding: %+v", g)
	}
	// 12 sliding + 13 full (gpt-oss-20b + EAGLE): one group each, of 13.
	if g := vllmGroups([]Group{{Segments: []int{8}}, {Kind: SlidingWindow, Segments: []int{8}}}, []int{13, 12}); len(g) != 2 {
		t.Errorf("13 full + 12 sliding: %d groups", len(g))
	}
}

// Each group's block is checked under its own seed: a block of another
// group stored under the same hash does not pass.
func TestHybridRegionGroupsDiffer(t *testing.T) {
	h := HybridSWA(1)
	r, err := NewHybridRegion("/dev/shm", h, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	r.Fill(1, 2, key(9))
	if err := r.Check(1, 2, key(9)); err != nil {
		t.Fatal(err)
	}
	for s := range h.Groups[1].Segments {
		copy(r.segment(2, s, 2), r.segment(1, s, 2))
	}
	if r.Check(2, 2, key(9)) == nil {
		t.Error("group 1's bytes pass as group 2's")
	}
	r.Poison(1, 2)
	if r.Check(1, 2, key(9)) == nil {
		t.Error("a poisoned block passes")
	}
}
