package cuda

import (
	"cmp"
	"slices"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// Run is a set of equally long copies between one region and the arena whose
// offsets advance by a constant pitch on each side: row i moves Width bytes
// between RegionOff+i*RegionPitch and ArenaOff+i*ArenaPitch. A run of one row
// is one plain async copy; a run of more rows is one cuMemcpy2DAsync.
//
// The two pitches may differ: consecutive engine blocks sit BlockStride apart
// in a region, while their slots in the arena sit one slot (every segment of
// the block) apart.
type Run struct {
	Region      dma.Region
	RegionOff   uint64
	ArenaOff    uint64
	Width       uint64
	Rows        uint64
	RegionPitch uint64
	ArenaPitch  uint64
}

// Bytes is the number of bytes the run moves.
func (r Run) Bytes() uint64 { return r.Width * r.Rows }

// planner turns copies into runs. Its buffers are reused from batch to batch
// (the engine plans on one goroutine), so planning allocates nothing once
// warm. The zero value is ready to use.
type planner struct {
	runs  []Run
	ranks []int
	order []dma.Copy
	seen  []dma.Region
	index map[dma.Region]int
	start []int
	next  []int
}

// plan returns the runs that move exactly the bytes of copies (see planRuns).
// The slice is valid until the next call.
func (p *planner) plan(copies []dma.Copy, maxPitch uint64) []Run {
	p.runs = p.appendRuns(p.runs[:0], copies, maxPitch)
	clear(p.order) // do not keep regions alive
	clear(p.seen)
	clear(p.index)
	return p.runs
}

// planRuns appends to dst the runs that move exactly the bytes of copies.
//
// A batch lists its copies block by block (every segment of block b, then of
// block b+1: see layout.Regions.AppendCopies), so neighbours in the list are
// in different regions and never form a run. planRuns therefore first groups
// the copies by region, regions in order of first appearance, and orders each
// group by region offset; then it extends a run while the next copy has the
// same length and continues both pitches. A pitch must be at least the width
// (rows may not overlap, and cuMemcpy2D requires it) and at most maxPitch
// (CU_DEVICE_ATTRIBUTE_MAX_PITCH). A run whose rows touch on both sides is
// returned as one row of Width*Rows bytes. Zero-length copies are dropped.
//
// Copies of a batch complete as one, so their order does not matter, as long
// as no two copies write the same bytes (which would be a race on any engine).
func planRuns(dst []Run, copies []dma.Copy, maxPitch uint64) []Run {
	var p planner
	return p.appendRuns(dst, copies, maxPitch)
}

func (p *planner) appendRuns(dst []Run, copies []dma.Copy, maxPitch uint64) []Run {
	var cur Run
	open := false
	for _, c := range p.runOrder(copies) {
		if c.Len == 0 {
			continue
		}
		if open && cur.extend(c, maxPitch) {
			continue
		}
		if open {
			dst = append(dst, cur.flat())
		}
		cur = Run{Region: c.Region, RegionOff: c.RegionOff, ArenaOff: c.ArenaOff, Width: c.Len, Rows: 1, RegionPitch: c.Len, ArenaPitch: c.Len}
		open = true
	}
	if open {
		dst = append(dst, cur.flat())
	}
	return dst
}

// extend adds c to the run as its next row, if it is one.
func (r *Run) extend(c dma.Copy, maxPitch uint64) bool {
	if c.Region != r.Region || c.Len != r.Width {
		return false
	}
	// Offsets of the run's last row: real copy offsets, so no overflow.
	lastR := r.RegionOff + (r.Rows-1)*r.RegionPitch
	lastA := r.ArenaOff + (r.Rows-1)*r.ArenaPitch
	if c.RegionOff < lastR || c.ArenaOff < lastA {
		return false
	}
	pr, pa := c.RegionOff-lastR, c.ArenaOff-lastA
	if r.Rows == 1 {
		if pr < r.Width || pa < r.Width || pr > maxPitch || pa > maxPitch {
			return false
		}
		r.RegionPitch, r.ArenaPitch = pr, pa
	} else if pr != r.RegionPitch || pa != r.ArenaPitch {
		return false
	}
	r.Rows++
	return true
}

// flat turns a run whose rows are back to back on both sides into one row.
func (r Run) flat() Run {
	if r.Rows > 1 && r.RegionPitch == r.Width && r.ArenaPitch == r.Width {
		r.Width *= r.Rows
		r.Rows = 1
		r.RegionPitch, r.ArenaPitch = r.Width, r.Width
	}
	return r
}

// runOrder returns the copies grouped by region (regions in order of first
// appearance) and by region offset within a group: copies itself when it is
// already so, else a reordered copy. It is linear for the usual batch (blocks
// in order, each block's segments in the same region order) and sorts only
// the groups that are out of order.
func (p *planner) runOrder(copies []dma.Copy) []dma.Copy {
	if inRunOrder(copies) {
		return copies
	}
	// Rank regions by first appearance. Block-major batches repeat the same
	// region sequence, so guessing "the region after the last one" avoids
	// most map lookups.
	if p.index == nil {
		p.index = make(map[dma.Region]int)
	}
	seen := p.seen[:0]
	ranks := slices.Grow(p.ranks[:0], len(copies))[:len(copies)]
	prev := -1
	for i, c := range copies {
		var r int
		if g := prev + 1; g < len(seen) && seen[g] == c.Region {
			r = g
		} else if len(seen) > 0 && seen[0] == c.Region {
			r = 0
		} else if x, ok := p.index[c.Region]; ok {
			r = x
		} else {
			r = len(seen)
			seen = append(seen, c.Region)
			p.index[c.Region] = r
		}
		ranks[i], prev = r, r
	}
	// Counting sort by rank keeps each group in batch order.
	start := slices.Grow(p.start[:0], len(seen)+1)[:len(seen)+1]
	clear(start)
	for _, r := range ranks {
		start[r+1]++
	}
	for r := 1; r < len(start); r++ {
		start[r] += start[r-1]
	}
	next := append(p.next[:0], start[:len(seen)]...)
	out := slices.Grow(p.order[:0], len(copies))[:len(copies)]
	for i, c := range copies {
		out[next[ranks[i]]] = c
		next[ranks[i]]++
	}
	for r := range seen {
		g := out[start[r]:start[r+1]]
		if !slices.IsSortedFunc(g, byRegionOff) {
			slices.SortStableFunc(g, byRegionOff)
		}
	}
	p.seen, p.ranks, p.start, p.next, p.order = seen, ranks, start, next, out
	return out
}

func byRegionOff(a, b dma.Copy) int { return cmp.Compare(a.RegionOff, b.RegionOff) }

func inRunOrder(copies []dma.Copy) bool {
	if len(copies) > 1 && copies[1].Region != copies[0].Region {
		// Neighbours in different regions: the batch is block-major (or has
		// a single copy per region, which runOrder leaves as it is anyway).
		return false
	}
	var done map[dma.Region]bool // regions whose group has ended
	for i := 1; i < len(copies); i++ {
		p, c := copies[i-1], copies[i]
		if c.Region == p.Region {
			if c.RegionOff < p.RegionOff {
				return false
			}
			continue
		}
		if done == nil {
			done = make(map[dma.Region]bool)
		}
		if done[c.Region] {
			return false
		}
		done[p.Region] = true
	}
	return true
}
