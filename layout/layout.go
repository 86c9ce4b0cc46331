// Package layout owns the arithmetic that maps an engine block to bytes: which
// segments (regions) belong to a KV cache group, how long a packed slot is,
// and which copies move block b of a registration to or from an arena slot.
// Every other package asks here instead of redoing the sums.
package layout

import (
	"fmt"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// Limits on what a client may describe. They bound allocation from the wire.
const (
	MaxSegments     = 4096
	MaxSegmentBytes = 1 << 30
	MaxGroups       = 64
	MaxHashBytes    = 32
	// SlotAlign is the alignment of every slot in the arena and on disk (O_DIRECT).
	SlotAlign = 4096
)

// Segment is the bytes of one region for one group.
type Segment struct {
	Group uint32
	Bytes uint64
}

// Layout is how one engine block of a namespace maps to bytes.
type Layout struct {
	HashBytes int
	Segments  []Segment
}

// Validate checks a layout from the wire.
func (l Layout) Validate() error {
	if l.HashBytes != 16 && l.HashBytes != 32 {
		return fmt.Errorf("layout.hash_bytes is %d, want 16 or 32", l.HashBytes)
	}
	if len(l.Segments) == 0 {
		return fmt.Errorf("layout.segments is empty")
	}
	if len(l.Segments) > MaxSegments {
		return fmt.Errorf("layout.segments has %d entries, at most %d allowed", len(l.Segments), MaxSegments)
	}
	for i, s := range l.Segments {
		if s.Bytes == 0 || s.Bytes > MaxSegmentBytes {
			return fmt.Errorf("layout.segments[%d].bytes is %d, want 1..%d", i, s.Bytes, MaxSegmentBytes)
		}
		if s.Group >= MaxGroups {
			return fmt.Errorf("layout.segments[%d].group is %d, at most %d groups allowed", i, s.Group, MaxGroups)
		}
	}
	for g := uint32(0); g < l.NumGroups(); g++ {
		if l.PayloadBytes(g) == 0 {
			return fmt.Errorf("layout has no segment for group %d (groups must be numbered 0..n-1)", g)
		}
	}
	return nil
}

// Equal reports whether two layouts describe the same bytes.
func (l Layout) Equal(o Layout) bool {
	if l.HashBytes != o.HashBytes || len(l.Segments) != len(o.Segments) {
		return false
	}
	for i := range l.Segments {
		if l.Segments[i] != o.Segments[i] {
			return false
		}
	}
	return true
}

// NumGroups is one more than the highest group index.
func (l Layout) NumGroups() uint32 {
	var n uint32
	for _, s := range l.Segments {
		n = max(n, s.Group+1)
	}
	return n
}

// PayloadBytes is the length of a stored block of group g: its segments
// packed back to back.
func (l Layout) PayloadBytes(g uint32) uint64 {
	var n uint64
	for _, s := range l.Segments {
		if s.Group == g {
			n += s.Bytes
		}
	}
	return n
}

// SlotBytes is PayloadBytes rounded up to SlotAlign.
func (l Layout) SlotBytes(g uint32) uint64 { return AlignUp(l.PayloadBytes(g)) }

// AlignUp rounds n up to SlotAlign.
func AlignUp(n uint64) uint64 { return (n + SlotAlign - 1) &^ (SlotAlign - 1) }

// Regions pairs a layout with one registration's opened regions.
type Regions struct {
	Layout  Layout
	Specs   []dma.RegionSpec // one per segment
	Opened  []dma.Region     // one per segment
	nBlocks []uint32         // per group: engine blocks addressable in every region of the group
}

// NewRegions checks that specs fit the layout and that each opened region is
// large enough, and returns the mapping.
func NewRegions(l Layout, specs []dma.RegionSpec, opened []dma.Region) (*Regions, error) {
	if len(specs) != len(l.Segments) || len(opened) != len(specs) {
		return nil, fmt.Errorf("regions has %d entries, layout has %d segments", len(specs), len(l.Segments))
	}
	r := &Regions{Layout: l, Specs: specs, Opened: opened, nBlocks: make([]uint32, l.NumGroups())}
	for g := range r.nBlocks {
		r.nBlocks[g] = ^uint32(0)
	}
	for i, s := range specs {
		if s.SegmentBytes != l.Segments[i].Bytes {
			return nil, fmt.Errorf("regions[%d]: segment is %d bytes, layout.segments[%d] says %d", i, s.SegmentBytes, i, l.Segments[i].Bytes)
		}
		span, err := s.Span()
		if err != nil {
			return nil, fmt.Errorf("regions[%d]: %w", i, err)
		}
		if size := opened[i].Size(); span > size {
			return nil, fmt.Errorf("regions[%d]: blocks reach byte %d but the region is %d bytes", i, span, size)
		}
		g := l.Segments[i].Group
		r.nBlocks[g] = min(r.nBlocks[g], s.NumBlocks)
	}
	return r, nil
}

// NumBlocks is the number of engine blocks of group g.
func (r *Regions) NumBlocks(g uint32) uint32 { return r.nBlocks[g] }

// AppendCopies appends the copies that move engine block b of group g to or
// from the slot at arenaOff, segments packed in layout order.
func (r *Regions) AppendCopies(dst []dma.Copy, g uint32, b uint32, arenaOff uint64) []dma.Copy {
	off := arenaOff
	for i, s := range r.Layout.Segments {
		if s.Group != g {
			continue
		}
		sp := r.Specs[i]
		dst = append(dst, dma.Copy{
			Region:    r.Opened[i],
			RegionOff: sp.Offset + uint64(b)*sp.BlockStride,
			ArenaOff:  off,
			Len:       s.Bytes,
		})
		off += s.Bytes
	}
	return dst
}
