package slots

// A policy's per-block state lives in records: pointer-free arrays indexed
// by a dense record number, found by policy key through an open-addressing
// table of uint32 record numbers (the index's own design, index/index.go).
// The garbage collector never scans them, and a block costs its policy key,
// its share of the table and what the policy keeps beside it: 24 bytes a
// block for SLRU, 8 for TinyLFU, where a map of heap entries cost 150-280
// (issue 34, docs/benchmarks.md).
const (
	recShift      = 12 // 4096 records to a chunk: growing never copies them
	recLen        = 1 << recShift
	minRecTable   = 64
	noRec         = ^uint32(0)
	recTableLoadN = 3 // the table grows past recTableLoadN/recTableLoadD full
	recTableLoadD = 4
)

// records maps policy keys to dense record numbers 0..n-1. Removing a record
// moves the last one into its number (remove says which), so the numbers
// stay dense and a policy can sample them. Not safe for concurrent use.
type records struct {
	table []uint32   // record number + 1; 0 is empty
	keys  [][]uint64 // chunks of recLen policy keys, by record number
	n     uint32
}

func (t *records) len() int { return int(t.n) }

// key is the policy key of record r.
func (t *records) key(r uint32) uint64 { return t.keys[r>>recShift][r&(recLen-1)] }

// find returns the table position of h, or the empty position where it
// would go.
func (t *records) find(h uint64) (pos int, found bool) {
	mask := len(t.table) - 1
	for i := int(h) & mask; ; i = (i + 1) & mask {
		v := t.table[i]
		if v == 0 {
			return i, false
		}
		if t.key(v-1) == h {
			return i, true
		}
	}
}

// lookup returns the record of h.
func (t *records) lookup(h uint64) (uint32, bool) {
	if t.n == 0 {
		return noRec, false
	}
	pos, ok := t.find(h)
	if !ok {
		return noRec, false
	}
	return t.table[pos] - 1, true
}

// add files h, which must be absent, as record n (the new last one). The
// caller grows its own per-record chunks when n starts a chunk.
func (t *records) add(h uint64) uint32 {
	if (int(t.n)+1)*recTableLoadD > len(t.table)*recTableLoadN {
		t.grow()
	}
	r := t.n
	if int(r>>recShift) == len(t.keys) {
		t.keys = append(t.keys, make([]uint64, recLen))
	}
	t.keys[r>>recShift][r&(recLen-1)] = h
	pos, _ := t.find(h)
	t.table[pos] = r + 1
	t.n++
	return r
}

func (t *records) grow() {
	old := t.table
	t.table = make([]uint32, max(len(old)*2, minRecTable))
	mask := len(t.table) - 1
	for _, v := range old {
		if v == 0 {
			continue
		}
		i := int(t.key(v-1)) & mask
		for t.table[i] != 0 {
			i = (i + 1) & mask
		}
		t.table[i] = v
	}
}

// remove drops record r and moves the last record into its number; it
// returns the number the moved record had (r itself when r was the last:
// nothing moved). The caller moves its own per-record state the same way.
func (t *records) remove(r uint32) (moved uint32) {
	pos, ok := t.find(t.key(r))
	if !ok || t.table[pos] != r+1 {
		panic("slots: policy record not in its table")
	}
	t.unfile(pos)
	last := t.n - 1
	t.n--
	if r == last {
		return r
	}
	h := t.key(last)
	pos, ok = t.find(h)
	if !ok {
		panic("slots: policy record not in its table")
	}
	t.table[pos] = r + 1
	t.keys[r>>recShift][r&(recLen-1)] = h
	return last
}

// unfile empties table position pos (backward-shift deletion, so no
// tombstones slow later probes).
func (t *records) unfile(pos int) {
	mask := len(t.table) - 1
	hole := pos
	for i := (pos + 1) & mask; t.table[i] != 0; i = (i + 1) & mask {
		home := int(t.key(t.table[i]-1)) & mask
		// Move the entry at i into the hole when its home is not in (hole, i].
		if (i > hole && (home <= hole || home > i)) || (i < hole && home <= hole && home > i) {
			t.table[hole] = t.table[i]
			hole = i
		}
	}
	t.table[hole] = 0
}

// reset drops every record and the memory they took.
func (t *records) reset() { *t = records{} }

// chunkFor grows chunks, a policy's per-record state beside t, to hold
// record r.
func chunkFor[T any](chunks [][]T, r uint32) [][]T {
	if int(r>>recShift) == len(chunks) {
		chunks = append(chunks, make([]T, recLen))
	}
	return chunks
}
