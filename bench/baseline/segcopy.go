package baseline

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// SegmentCopier is the daemon's CPU-tier copy work done without the daemon:
// the segments of the same engine blocks, between the same engine region
// and a buffer laid out like the daemon's arena (a block's segments packed
// back to back in a slot), by the same number of workers. kvbench times it
// in the same step as the Load or Store it stands beside, right before or
// right after it, with the destination in the same cache state, so the
// ratio of the two is the daemon's overhead on top of the copy and not the
// difference between two moments of a shared machine.
type SegmentCopier struct {
	region  *model.Region
	workers int
	slots   int
	buf     []byte
	next    int // the slot the next copy starts at
}

// NewSegmentCopier makes a copier with an arena-like buffer of slots
// blocks (at least twice the region's, so that each copy's arena side is
// the part touched longest ago, as the daemon's slots of blocks stored
// earlier are).
func NewSegmentCopier(region *model.Region, slots, workers int) (*SegmentCopier, error) {
	slots = max(slots, 2*region.Blocks)
	buf, err := vfs.AlignedBuffer(slots * region.Shape.BlockBytes())
	if err != nil {
		return nil, fmt.Errorf("segment copy baseline: %w", err)
	}
	// Fault every page in now: the daemon's arena is mapped and touched
	// before it serves.
	for i := 0; i < len(buf); i += 4096 {
		buf[i] = 1
	}
	return &SegmentCopier{region: region, workers: max(workers, 1), slots: slots, buf: buf}, nil
}

// Close frees the buffer.
func (c *SegmentCopier) Close() error { return vfs.FreeBuffer(c.buf) }

// pieceBytes is the work a worker takes at a time: small enough that no
// worker idles long at the end of a copy.
const pieceBytes = 1 << 20

// Copy copies the segments of the engine blocks into the arena-like
// buffer (toArena, a store) or out of it into the engine region (a load),
// and returns the time it took and the bytes it moved.
func (c *SegmentCopier) Copy(blocks []int, toArena bool) (time.Duration, uint64) {
	if len(blocks) == 0 {
		return 0, 0
	}
	shape := c.region.Shape
	seg, nseg, blockBytes := shape.SegmentBytes(), shape.Segments(), shape.BlockBytes()
	first := c.next
	c.next = (c.next + len(blocks)) % c.slots
	// One unit of work per (block, segment), taken in pieces.
	units := len(blocks) * nseg
	perPiece := max(pieceBytes/seg, 1)
	var taken atomic.Int64
	start := time.Now()
	var wg sync.WaitGroup
	for range c.workers {
		wg.Go(func() {
			for {
				lo := int(taken.Add(int64(perPiece))) - perPiece
				if lo >= units {
					return
				}
				for u := lo; u < min(lo+perPiece, units); u++ {
					i, s := u/nseg, u%nseg
					slot := (first + i) % c.slots
					a := c.buf[slot*blockBytes+s*seg : slot*blockBytes+(s+1)*seg]
					r := c.region.Segment(s, blocks[i])
					if toArena {
						copy(a, r)
					} else {
						copy(r, a)
					}
				}
			}
		})
	}
	wg.Wait()
	return time.Since(start), uint64(len(blocks)) * uint64(blockBytes)
}
