package cuda

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/layout"
)

type fakeRegion struct {
	name string
	size uint64
}

func (r *fakeRegion) Size() uint64   { return r.size }
func (r *fakeRegion) Close() error   { return nil }
func (r *fakeRegion) String() string { return r.name }

const maxPitch = 1 << 31 // CU_DEVICE_ATTRIBUTE_MAX_PITCH on current GPUs is 2^31-1

func TestPlanRuns(t *testing.T) {
	k, v := &fakeRegion{name: "K", size: 1 << 40}, &fakeRegion{name: "V", size: 1 << 40}
	cp := func(r dma.Region, roff, aoff, n uint64) dma.Copy {
		return dma.Copy{Region: r, RegionOff: roff, ArenaOff: aoff, Len: n}
	}
	tests := []struct {
		name   string
		copies []dma.Copy
		want   []Run
	}{
		{name: "empty"},
		{
			name:   "one copy",
			copies: []dma.Copy{cp(k, 100, 200, 50)},
			want:   []Run{{Region: k, RegionOff: 100, ArenaOff: 200, Width: 50, Rows: 1, RegionPitch: 50, ArenaPitch: 50}},
		},
		{
			name:   "back to back on both sides: one flat copy",
			copies: []dma.Copy{cp(k, 0, 4096, 512), cp(k, 512, 4608, 512), cp(k, 1024, 5120, 512)},
			want:   []Run{{Region: k, RegionOff: 0, ArenaOff: 4096, Width: 1536, Rows: 1, RegionPitch: 1536, ArenaPitch: 1536}},
		},
		{
			name: "strided, pitches differ",
			copies: []dma.Copy{
				cp(k, 1000, 0, 256), cp(k, 2000, 4096, 256), cp(k, 3000, 8192, 256), cp(k, 4000, 12288, 256),
			},
			want: []Run{{Region: k, RegionOff: 1000, ArenaOff: 0, Width: 256, Rows: 4, RegionPitch: 1000, ArenaPitch: 4096}},
		},
		{
			name: "block-major K/V into adjacent slots: one run per region",
			// Engine blocks 5,6,7; K then V packed in 8 KiB slots 0,1,2.
			copies: []dma.Copy{
				cp(k, 5*4096, 0, 4096), cp(v, 5*4096, 4096, 4096),
				cp(k, 6*4096, 8192, 4096), cp(v, 6*4096, 12288, 4096),
				cp(k, 7*4096, 16384, 4096), cp(v, 7*4096, 20480, 4096),
			},
			want: []Run{
				{Region: k, RegionOff: 5 * 4096, ArenaOff: 0, Width: 4096, Rows: 3, RegionPitch: 4096, ArenaPitch: 8192},
				{Region: v, RegionOff: 5 * 4096, ArenaOff: 4096, Width: 4096, Rows: 3, RegionPitch: 4096, ArenaPitch: 8192},
			},
		},
		{
			name: "a slot out of line breaks the run",
			copies: []dma.Copy{
				cp(k, 0, 0, 100), cp(k, 100, 1000, 100), cp(k, 200, 2000, 100),
				cp(k, 300, 9000, 100), // arena pitch 7000, not 1000
				cp(k, 400, 10000, 100),
			},
			want: []Run{
				{Region: k, RegionOff: 0, ArenaOff: 0, Width: 100, Rows: 3, RegionPitch: 100, ArenaPitch: 1000},
				{Region: k, RegionOff: 300, ArenaOff: 9000, Width: 100, Rows: 2, RegionPitch: 100, ArenaPitch: 1000},
			},
		},
		{
			name:   "different lengths do not join",
			copies: []dma.Copy{cp(k, 0, 0, 100), cp(k, 100, 100, 200)},
			want: []Run{
				{Region: k, RegionOff: 0, ArenaOff: 0, Width: 100, Rows: 1, RegionPitch: 100, ArenaPitch: 100},
				{Region: k, RegionOff: 100, ArenaOff: 100, Width: 200, Rows: 1, RegionPitch: 200, ArenaPitch: 200},
			},
		},
		{
			name:   "pitch below the width (overlapping rows) does not join",
			copies: []dma.Copy{cp(k, 0, 0, 512), cp(k, 256, 1024, 512)},
			want: []Run{
				{Region: k, RegionOff: 0, ArenaOff: 0, Width: 512, Rows: 1, RegionPitch: 512, ArenaPitch: 512},
				{Region: k, RegionOff: 256, ArenaOff: 1024, Width: 512, Rows: 1, RegionPitch: 512, ArenaPitch: 512},
			},
		},
		{
			name:   "pitch above the device's maximum does not join",
			copies: []dma.Copy{cp(k, 0, 0, 64), cp(k, maxPitch+1, 64, 64)},
			want: []Run{
				{Region: k, RegionOff: 0, ArenaOff: 0, Width: 64, Rows: 1, RegionPitch: 64, ArenaPitch: 64},
				{Region: k, RegionOff: maxPitch + 1, ArenaOff: 64, Width: 64, Rows: 1, RegionPitch: 64, ArenaPitch: 64},
			},
		},
		{
			name:   "arena going backwards does not join",
			copies: []dma.Copy{cp(k, 0, 4096, 64), cp(k, 64, 0, 64)},
			want: []Run{
				{Region: k, RegionOff: 0, ArenaOff: 4096, Width: 64, Rows: 1, RegionPitch: 64, ArenaPitch: 64},
				{Region: k, RegionOff: 64, ArenaOff: 0, Width: 64, Rows: 1, RegionPitch: 64, ArenaPitch: 64},
			},
		},
		{
			name:   "blocks listed out of order are sorted into one run",
			copies: []dma.Copy{cp(k, 2048, 2048, 1024), cp(k, 0, 0, 1024), cp(k, 1024, 1024, 1024)},
			want:   []Run{{Region: k, RegionOff: 0, ArenaOff: 0, Width: 3072, Rows: 1, RegionPitch: 3072, ArenaPitch: 3072}},
		},
		{
			name:   "the same block twice is two copies",
			copies: []dma.Copy{cp(k, 0, 0, 64), cp(k, 0, 64, 64)},
			want: []Run{
				{Region: k, RegionOff: 0, ArenaOff: 0, Width: 64, Rows: 1, RegionPitch: 64, ArenaPitch: 64},
				{Region: k, RegionOff: 0, ArenaOff: 64, Width: 64, Rows: 1, RegionPitch: 64, ArenaPitch: 64},
			},
		},
		{
			name:   "zero-length copies vanish",
			copies: []dma.Copy{cp(k, 0, 0, 0), cp(k, 0, 0, 64), cp(v, 5, 5, 0), cp(k, 64, 64, 64)},
			want:   []Run{{Region: k, RegionOff: 0, ArenaOff: 0, Width: 128, Rows: 1, RegionPitch: 128, ArenaPitch: 128}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := planRuns(nil, tt.copies, maxPitch)
			if !slices.Equal(got, tt.want) {
				t.Fatalf("runs:\n got %v\nwant %v", got, tt.want)
			}
			checkSameBytes(t, tt.copies, got)
		})
	}
}

// TestPlanRunsLayouts coalesces the copies the layout package makes for
// split K/V (one region per layer and K or V) and packed K/V (one region per
// layer holding K and V of a block side by side) registrations, storing engine
// blocks 10..17 into adjacent slots.
func TestPlanRunsLayouts(t *testing.T) {
	const (
		layers   = 4
		kvBytes  = 16 * 8 * 128 * 2 // tokens x kv heads x head dim x bf16
		nBlocks  = 64
		first    = 10
		count    = 8
		slotBase = 1 << 20
	)
	tests := []struct {
		name     string
		regions  int
		segBytes uint64
		stride   uint64
		offset   uint64
	}{
		{name: "split K and V", regions: 2 * layers, segBytes: kvBytes, stride: kvBytes, offset: 0},
		{name: "packed K and V", regions: layers, segBytes: 2 * kvBytes, stride: 2 * kvBytes, offset: 3 << 20},
		{name: "blocks strided wider than a segment", regions: layers, segBytes: kvBytes, stride: 3 * kvBytes, offset: 512},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := layout.Layout{HashBytes: 16}
			var specs []dma.RegionSpec
			var opened []dma.Region
			for i := 0; i < tt.regions; i++ {
				l.Segments = append(l.Segments, layout.Segment{Group: 0, Bytes: tt.segBytes})
				spec := dma.RegionSpec{Offset: tt.offset, BlockStride: tt.stride, NumBlocks: nBlocks, SegmentBytes: tt.segBytes}
				span, err := spec.Span()
				if err != nil {
					t.Fatal(err)
				}
				specs = append(specs, spec)
				opened = append(opened, &fakeRegion{name: fmt.Sprint("r", i), size: span})
			}
			regs, err := layout.NewRegions(l, specs, opened)
			if err != nil {
				t.Fatal(err)
			}
			slot := l.SlotBytes(0)
			var copies []dma.Copy
			for i := uint64(0); i < count; i++ {
				copies = regs.AppendCopies(copies, 0, uint32(first+i), slotBase+i*slot)
			}
			runs := planRuns(nil, copies, maxPitch)
			if len(runs) != tt.regions {
				t.Fatalf("%d copies became %d runs, want one per region (%d): %v", len(copies), len(runs), tt.regions, runs)
			}
			for i, r := range runs {
				if r.Region != opened[i] {
					t.Errorf("run %d is of region %v, want %v (regions keep their order)", i, r.Region, opened[i])
				}
				if r.Rows != count || r.RegionPitch != tt.stride || r.ArenaPitch != slot || r.Width != tt.segBytes {
					t.Errorf("run %d = %+v, want %d rows of %d bytes, pitches %d/%d", i, r, count, tt.segBytes, tt.stride, slot)
				}
			}
			checkSameBytes(t, copies, runs)
		})
	}
}

// TestPlanRunsRandom checks, over random batches, that runs move exactly the
// bytes the copies name, and that no run breaks the 2D copy's rules.
func TestPlanRunsRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	regions := []dma.Region{&fakeRegion{name: "a"}, &fakeRegion{name: "b"}, &fakeRegion{name: "c"}}
	const pitchLimit = 1 << 12
	for iter := 0; iter < 2000; iter++ {
		n := rng.IntN(40)
		var copies []dma.Copy
		blocks := rng.Perm(64)
		width := uint64(1 + rng.IntN(3)*64)
		stride := width * uint64(1+rng.IntN(3))
		slot := width * uint64(1+rng.IntN(4))
		for i := 0; i < n; i++ {
			b := uint64(blocks[i])
			s := uint64(i)
			if rng.IntN(4) == 0 {
				s += 100 // a slot out of line
			}
			w := width
			if rng.IntN(10) == 0 {
				w = uint64(rng.IntN(200)) // an odd length, sometimes zero
			}
			copies = append(copies, dma.Copy{
				Region:    regions[rng.IntN(len(regions))],
				RegionOff: b * stride,
				ArenaOff:  s * slot * 8,
				Len:       w,
			})
		}
		if rng.IntN(2) == 0 {
			slices.SortStableFunc(copies, func(a, b dma.Copy) int { return cmp.Compare(a.RegionOff, b.RegionOff) })
		}
		runs := planRuns(nil, copies, pitchLimit)
		for _, r := range runs {
			if r.Rows == 0 || r.Width == 0 {
				t.Fatalf("empty run %+v", r)
			}
			if r.Rows > 1 && (r.RegionPitch < r.Width || r.ArenaPitch < r.Width || r.RegionPitch > pitchLimit || r.ArenaPitch > pitchLimit) {
				t.Fatalf("run %+v breaks cuMemcpy2D's pitch rules (limit %d)", r, pitchLimit)
			}
		}
		checkSameBytes(t, copies, runs)
	}
}

// checkSameBytes expands runs back into pieces and compares them with the
// non-empty copies as multisets: the same bytes, each moved as often. Pieces
// are as large as every offset and length allows, so that big layouts stay
// cheap to check.
func checkSameBytes(t *testing.T, copies []dma.Copy, runs []Run) {
	t.Helper()
	unit := uint64(0)
	for _, c := range copies {
		unit = gcd(gcd(gcd(unit, c.RegionOff), c.ArenaOff), c.Len)
	}
	if unit == 0 {
		unit = 1
	}
	type piece struct {
		region     dma.Region
		roff, aoff uint64
	}
	expand := func(region dma.Region, roff, aoff, n uint64, into map[piece]int) {
		if roff%unit != 0 || aoff%unit != 0 || n%unit != 0 {
			t.Fatalf("run piece at %d/%d, %d bytes, is not made of whole %d-byte units of the copies", roff, aoff, n, unit)
		}
		for i := uint64(0); i < n; i += unit {
			into[piece{region: region, roff: roff + i, aoff: aoff + i}]++
		}
	}
	want, got := map[piece]int{}, map[piece]int{}
	for _, c := range copies {
		expand(c.Region, c.RegionOff, c.ArenaOff, c.Len, want)
	}
	for _, r := range runs {
		for row := uint64(0); row < r.Rows; row++ {
			expand(r.Region, r.RegionOff+row*r.RegionPitch, r.ArenaOff+row*r.ArenaPitch, r.Width, got)
		}
	}
	if len(want) != len(got) {
		t.Fatalf("runs move %d distinct %d-byte pieces, copies %d", len(got), unit, len(want))
	}
	for p, n := range want {
		if got[p] != n {
			t.Fatalf("piece %+v: moved %d times by the runs, %d by the copies", p, got[p], n)
		}
	}
}

func gcd(a, b uint64) uint64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

func BenchmarkPlanRuns(b *testing.B) {
	for _, regions := range []int{2, 64} {
		for _, blocks := range []int{16, 1024} {
			b.Run(fmt.Sprintf("regions=%d/blocks=%d", regions, blocks), func(b *testing.B) {
				regs := make([]dma.Region, regions)
				for i := range regs {
					regs[i] = &fakeRegion{name: fmt.Sprint(i)}
				}
				const seg = 32 << 10
				var copies []dma.Copy
				for blk := 0; blk < blocks; blk++ {
					for i, r := range regs {
						copies = append(copies, dma.Copy{Region: r, RegionOff: uint64(blk) * seg, ArenaOff: uint64(blk*regions+i) * seg, Len: seg})
					}
				}
				var p planner
				var runs []Run
				b.SetBytes(int64(len(copies)) * seg) // bytes the planned copies move: planning must stay far faster than PCIe
				b.ReportAllocs()
				for b.Loop() {
					runs = p.plan(copies, maxPitch)
				}
				if len(runs) != regions {
					b.Fatalf("%d runs, want %d", len(runs), regions)
				}
			})
		}
	}
}
