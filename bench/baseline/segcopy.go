package baseline

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

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
//
// It reaches the region through a mapping of its own, as the daemon (another
// process) must, not through the one kvbench fills blocks through: a page
// the filler just wrote is in that mapping's TLB and, in a VM with shadow
// page tables, in its shadow entries, and copies through it ran at 20-22
// GB/s on this project's VM against 5-17 GB/s through a second mapping of
// the same pages (docs/benchmarks.md). Its buffer asks for huge pages, as
// the daemon's arena does.
type SegmentCopier struct {
	shape   model.Shape
	blocks  int    // engine blocks in the region
	mem     []byte // the copier's own mapping of the region file
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
	return newSegmentCopier(region.Path, region.Shape, region.Blocks, slots, workers)
}

// newSegmentCopier is NewSegmentCopier for the region file at path, of
// blocks engine blocks of shape: what a copier in another process knows.
func newSegmentCopier(path string, shape model.Shape, blocks, slots, workers int) (*SegmentCopier, error) {
	slots = max(slots, 2*blocks)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("segment copy baseline: %w", err)
	}
	defer f.Close()
	size := shape.Segments() * blocks * shape.SegmentBytes()
	if st, err := f.Stat(); err != nil || st.Size() != int64(size) {
		return nil, fmt.Errorf("segment copy baseline: %s is not a region of %d blocks of %s (%v)", path, blocks, shape, err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("segment copy baseline: map %s: %w", path, err)
	}
	buf, err := vfs.AlignedBuffer(slots * shape.BlockBytes())
	if err != nil {
		_ = unix.Munmap(mem)
		return nil, fmt.Errorf("segment copy baseline: %w", err)
	}
	// Backed like the daemon's arena: huge pages, locked where the limit
	// allows (the warm-up copy below backs it either way).
	_ = unix.Madvise(buf, unix.MADV_HUGEPAGE)
	_ = unix.Mlock(buf)
	c := &SegmentCopier{shape: shape, blocks: blocks, mem: mem, workers: max(workers, 1), slots: slots, buf: buf}
	// One copy of every block, unmeasured, before any step: the first copy
	// through a new mapping ran at 0.6 GB/s on this project's VM even with
	// every page touched beforehand, and made one step of 48 take longer
	// than the other 47 together. The daemon maps the region at Register,
	// long before a step.
	all := make([]int, blocks)
	for i := range all {
		all[i] = i
	}
	for done := 0; done < slots; done += len(all) {
		c.Copy(all, true) // into every slot of the buffer
	}
	c.next = 0
	return c, nil
}

// Close frees the buffer and the mapping.
func (c *SegmentCopier) Close() error {
	return errors.Join(vfs.FreeBuffer(c.buf), unix.Munmap(c.mem))
}

// segment is engine block b's segment s, through the copier's mapping
// (model.Region.Segment's layout).
func (c *SegmentCopier) segment(s, b int) []byte {
	n := c.shape.SegmentBytes()
	off := (s*c.blocks + b) * n
	return c.mem[off : off+n]
}

// pieceBytes is the work a worker takes at a time: small enough that no
// worker idles long at the end of a copy.
const pieceBytes = 1 << 20

// Copy copies the segments of the engine blocks into the arena-like
// buffer (toArena, a store) or out of it into the engine region (a load),
// the slots after the last copy's, and returns the time it took and the
// bytes it moved. It cannot fail; the error is ProcessCopier's.
func (c *SegmentCopier) Copy(blocks []int, toArena bool) (time.Duration, uint64, error) {
	first := c.next
	c.next = (c.next + len(blocks)) % c.slots
	el, n := c.copyAt(first, blocks, toArena)
	return el, n, nil
}

// copyAt is Copy with block i in slot first+i (modulo the buffer's slots).
func (c *SegmentCopier) copyAt(first int, blocks []int, toArena bool) (time.Duration, uint64) {
	if len(blocks) == 0 {
		return 0, 0
	}
	seg, nseg, blockBytes := c.shape.SegmentBytes(), c.shape.Segments(), c.shape.BlockBytes()
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
					r := c.segment(s, blocks[i])
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
