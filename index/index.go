// Package index owns the exact map from block key to where the block is and
// what state it is in. It answers "what is there" and never guesses: no
// false positives, ever. Deciding what to keep is the tiers' policy's job.
//
// Records are fixed-size and pointer-free, kept in chunked slabs and found
// through an open-addressing table of uint32 record numbers, so millions of
// entries cost the garbage collector nothing to scan.
package index

import (
	"hash/maphash"
	"sync"
	"unsafe"
)

// NoSlot marks an Entry without a copy in a tier.
const NoSlot = ^uint32(0)

// Key names a block: namespace, KV cache group, and the block hash (16 or 32
// bytes, zero padded; a namespace uses one length for all its keys).
type Key struct {
	NS    uint32
	Group uint32
	Hash  [32]byte
}

// State is where a block is in its life.
type State uint8

const (
	stateFree State = iota // record not in use
	// Writing: a store is copying into the slot; never offered.
	Writing
	// Ready: every copy has drained and the block may be offered.
	Ready
)

// Entry flags.
const (
	// DiskWriting: a copy to the disk tier is in flight (write-through,
	// or a demotion of a block the CPU tier's policy evicted).
	DiskWriting uint8 = 1 << iota
	// DiskEvicted: the disk tier's policy evicted the block while its
	// disk write was in flight; the write's slot is released when it ends.
	DiskEvicted
	// Promoting: a load is copying the block from disk into the CPU tier
	// and has offered it to the CPU tier's policy.
	Promoting
	// Spill: a store the CPU tier's policy declined; its CPU slot only
	// stages the block on its way to the disk tier.
	Spill
)

// Entry is what the index keeps per key.
// Pins live with the slots (tiers/slots), not here: a slot a load reads
// outlives its entry.
type Entry struct {
	CPU   uint32 // CPU tier slot, or NoSlot
	Disk  uint32 // disk tier slot, or NoSlot
	State State
	Flags uint8
}

// Offerable reports whether a Lookup may offer the block and a Load read
// it: every copy into it has drained and a tier holds it.
func (e *Entry) Offerable() bool {
	return e.State == Ready && (e.CPU != NoSlot || e.Disk != NoSlot)
}

// copies classifies an entry for the counts Copies reports.
func (e *Entry) copies() copyKind {
	switch {
	case e.State != Ready || e.CPU == NoSlot:
		return noCPU
	case e.Disk != NoSlot:
		return clean
	case e.Flags&(DiskWriting|Spill) == 0:
		return dirty
	}
	return noCPU
}

type copyKind uint8

const (
	noCPU copyKind = iota
	clean          // ready in the CPU tier and on disk: the CPU copy can go at once
	dirty          // ready in the CPU tier only, and no disk write of it in flight
)

// Tiers is the set of tiers that hold a block as a Lookup offers it.
type Tiers uint8

// The tiers of Tiers.
const (
	InCPU Tiers = 1 << iota
	InDisk
)

// Tiers reports where the block is ready: where a Lookup offers it from.
// A block still being written is in no tier.
func (e *Entry) Tiers() Tiers {
	if e.State != Ready {
		return 0
	}
	var t Tiers
	if e.CPU != NoSlot {
		t |= InCPU
	}
	if e.Disk != NoSlot {
		t |= InDisk
	}
	return t
}

// Observer learns every change of a key's Tiers, under the key's shard lock,
// so the changes of one key reach it in the order they happened. It must be
// quick and must not call back into the index.
type Observer interface {
	TiersChanged(k *Key, before, after Tiers)
}

// Holds reports whether a tier holds the block or a disk write of it is in
// flight: an entry that holds nothing is removed.
func (e *Entry) Holds() bool {
	return e.CPU != NoSlot || e.Disk != NoSlot || e.Flags&DiskWriting != 0
}

type record struct {
	key Key
	e   Entry
}

const (
	numShards  = 64
	chunkShift = 8 // 256 records per slab chunk: at most 1 MiB of room unused over 64 shards (1,024 left 30% of 10^5 blocks' records unused)
	chunkLen   = 1 << chunkShift
	minTable   = 64
)

var seed = maphash.MakeSeed()

// HashKey is the 64-bit hash the index files k under; callers that need a
// hash of the key for something else (the policy) reuse it.
func HashKey(k *Key) uint64 { return hashKey(k) }

// hashKey hashes the key's bytes in place (maphash.Comparable would make the
// key escape to the heap on every call).
func hashKey(k *Key) uint64 {
	return maphash.Bytes(seed, unsafe.Slice((*byte)(unsafe.Pointer(k)), unsafe.Sizeof(*k)))
}

type shard struct {
	mu      sync.Mutex
	table   []uint32 // record number + 1; 0 is empty
	slab    [][]record
	free    []uint32
	n       int
	perNS   map[uint32]int // entries per namespace
	readyNS map[uint32]int // Ready entries per namespace
	scratch Entry
	kinds   [3]int   // entries by copyKind
	_       [20]byte // keep shards' locks on separate cache lines
}

// ready counts a change of whether an entry of namespace ns is Ready.
func (s *shard) ready(ns uint32, was, is bool) {
	switch {
	case was == is:
	case is:
		s.readyNS[ns]++
	case s.readyNS[ns] <= 1:
		delete(s.readyNS, ns)
	default:
		s.readyNS[ns]--
	}
}

// count moves an entry from one copyKind to another.
func (s *shard) count(from, to copyKind) {
	s.kinds[from]--
	s.kinds[to]++
}

// Index is safe for concurrent use.
type Index struct {
	shards [numShards]shard
	obs    Observer // set before use (Observe), then only read
}

// Shards is the number of shards: ScanShard's range.
const Shards = numShards

// Observe makes o learn every change of a key's Tiers from now on. Call it
// before the index is shared.
func (ix *Index) Observe(o Observer) { ix.obs = o }

// changed tells the observer of a change of k's tiers; the caller holds
// k's shard lock.
func (ix *Index) changed(k *Key, before, after Tiers) {
	if before != after && ix.obs != nil {
		ix.obs.TiersChanged(k, before, after)
	}
}

// New returns an empty index.
func New() *Index {
	ix := &Index{}
	for i := range ix.shards {
		ix.shards[i].table = make([]uint32, minTable)
		ix.shards[i].perNS = map[uint32]int{}
		ix.shards[i].readyNS = map[uint32]int{}
	}
	return ix
}

func (ix *Index) shardOf(h uint64) *shard { return &ix.shards[h>>58] }

func (s *shard) rec(n uint32) *record { return &s.slab[n>>chunkShift][n&(chunkLen-1)] }

// find returns the table position of k, or the empty position where it would go.
func (s *shard) find(k *Key, h uint64) (pos int, found bool) {
	mask := len(s.table) - 1
	for i := int(h) & mask; ; i = (i + 1) & mask {
		v := s.table[i]
		if v == 0 {
			return i, false
		}
		if s.rec(v-1).key == *k {
			return i, true
		}
	}
}

func (s *shard) newRecord() uint32 {
	if n := len(s.free); n > 0 {
		r := s.free[n-1]
		s.free = s.free[:n-1]
		return r
	}
	n := uint32(len(s.slab)) << chunkShift
	s.slab = append(s.slab, make([]record, chunkLen))
	for i := uint32(chunkLen - 1); i > 0; i-- {
		s.free = append(s.free, n+i)
	}
	return n
}

func (s *shard) grow() {
	old := s.table
	s.table = make([]uint32, len(old)*2)
	mask := len(s.table) - 1
	for _, v := range old {
		if v == 0 {
			continue
		}
		i := int(hashKey(&s.rec(v-1).key)) & mask
		for s.table[i] != 0 {
			i = (i + 1) & mask
		}
		s.table[i] = v
	}
}

// remove deletes the entry at table position pos (backward-shift deletion,
// so no tombstones slow later probes).
func (s *shard) remove(pos int) {
	v := s.table[pos]
	if ns := s.rec(v - 1).key.NS; s.perNS[ns] <= 1 {
		delete(s.perNS, ns)
	} else {
		s.perNS[ns]--
	}
	*s.rec(v - 1) = record{}
	s.free = append(s.free, v-1)
	s.n--
	mask := len(s.table) - 1
	hole := pos
	for i := (pos + 1) & mask; s.table[i] != 0; i = (i + 1) & mask {
		home := int(hashKey(&s.rec(s.table[i]-1).key)) & mask
		// Move the entry at i into the hole when its home is not in (hole, i].
		if (i > hole && (home <= hole || home > i)) || (i < hole && home <= hole && home > i) {
			s.table[hole] = s.table[i]
			hole = i
		}
	}
	s.table[hole] = 0
}

// Get returns the entry of k.
func (ix *Index) Get(k *Key) (Entry, bool) { return ix.GetHashed(k, hashKey(k)) }

// GetHashed is Get with h = HashKey(k) already computed.
func (ix *Index) GetHashed(k *Key, h uint64) (Entry, bool) {
	s := ix.shardOf(h)
	s.mu.Lock()
	pos, ok := s.find(k, h)
	var e Entry
	if ok {
		e = s.rec(s.table[pos] - 1).e
	}
	s.mu.Unlock()
	return e, ok
}

// Mutate runs fn on the entry of k under its shard's lock. When k is absent
// fn gets a zero Entry (CPU and Disk set to NoSlot) and found=false. fn
// returns whether the entry exists afterwards: true inserts or keeps it,
// false deletes it. fn must not call back into the index.
func (ix *Index) Mutate(k *Key, fn func(e *Entry, found bool) (keep bool)) {
	h := hashKey(k)
	s := ix.shardOf(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	ix.mutateLocked(s, k, h, fn)
}

// MutateBatch is Mutate for each of keys, taking each shard's lock once
// for all the keys that fall in it (recovery files thousands of keys a
// chunk). fn gets the key's position in keys; the keys of one shard are
// visited in the order they come in keys, the shards in no particular
// order. A key given twice is visited twice. fn must not call back into the
// index.
func (ix *Index) MutateBatch(keys []Key, fn func(i int, e *Entry, found bool) (keep bool)) {
	if len(keys) == 0 {
		return
	}
	// Counting sort of the key positions by shard.
	type hashed struct {
		h uint64
		i int
	}
	var start [numShards + 1]int
	hs := make([]uint64, len(keys))
	for i := range keys {
		hs[i] = hashKey(&keys[i])
		start[hs[i]>>58+1]++
	}
	for j := 1; j <= numShards; j++ {
		start[j] += start[j-1]
	}
	order := make([]hashed, len(keys))
	next := start
	for i, h := range hs {
		order[next[h>>58]] = hashed{h, i}
		next[h>>58]++
	}
	for j := range numShards {
		if start[j] == start[j+1] {
			continue
		}
		s := &ix.shards[j]
		s.mu.Lock()
		for _, o := range order[start[j]:start[j+1]] {
			ix.mutateLocked(s, &keys[o.i], o.h, func(e *Entry, found bool) bool { return fn(o.i, e, found) })
		}
		s.mu.Unlock()
	}
}

// mutateLocked is Mutate with k's shard s locked and h = hashKey(k).
func (ix *Index) mutateLocked(s *shard, k *Key, h uint64, fn func(e *Entry, found bool) (keep bool)) {
	pos, ok := s.find(k, h)
	if ok {
		r := s.rec(s.table[pos] - 1)
		before, tiers, wasReady := r.e.copies(), r.e.Tiers(), r.e.State == Ready
		if !fn(&r.e, true) {
			s.count(before, noCPU)
			s.ready(k.NS, wasReady, false)
			s.remove(pos)
			ix.changed(k, tiers, 0)
			return
		}
		s.count(before, r.e.copies())
		s.ready(k.NS, wasReady, r.e.State == Ready)
		ix.changed(k, tiers, r.e.Tiers())
		return
	}
	// A shard-owned scratch entry: a local would escape through fn.
	e := &s.scratch
	*e = Entry{CPU: NoSlot, Disk: NoSlot, State: Writing}
	if !fn(e, false) {
		return
	}
	if e.State == stateFree {
		e.State = Writing
	}
	n := s.newRecord()
	*s.rec(n) = record{key: *k, e: *e}
	s.count(noCPU, e.copies())
	s.ready(k.NS, false, e.State == Ready)
	s.table[pos] = n + 1
	s.n++
	s.perNS[k.NS]++
	if s.n*4 > len(s.table)*3 {
		s.grow()
	}
	ix.changed(k, 0, e.Tiers())
}

// Range calls fn for every entry, one shard at a time under its lock, in no
// particular order. fn returns false to delete the entry. fn must not call
// back into the index.
func (ix *Index) Range(fn func(k *Key, e *Entry) (keep bool)) {
	var drop []Key
	for i := range ix.shards {
		s := &ix.shards[i]
		s.mu.Lock()
		drop = drop[:0]
		for _, chunk := range s.slab {
			for j := range chunk {
				r := &chunk[j]
				if r.e.State == stateFree {
					continue
				}
				before, tiers, wasReady := r.e.copies(), r.e.Tiers(), r.e.State == Ready
				if !fn(&r.key, &r.e) {
					drop = append(drop, r.key)
					s.count(before, noCPU)
					s.ready(r.key.NS, wasReady, false)
					ix.changed(&r.key, tiers, 0)
				} else {
					s.count(before, r.e.copies())
					s.ready(r.key.NS, wasReady, r.e.State == Ready)
					ix.changed(&r.key, tiers, r.e.Tiers())
				}
			}
		}
		for j := range drop {
			if pos, ok := s.find(&drop[j], hashKey(&drop[j])); ok {
				s.remove(pos)
			}
		}
		s.mu.Unlock()
	}
}

// ScanShard calls fn for the key and tiers of every entry of shard i that
// is in a tier, then done, all under the shard's lock: what fn sees and what
// done records are one moment of that shard, between two changes the
// observer learns of. fn and done must not call back into the index.
func (ix *Index) ScanShard(i int, fn func(k *Key, t Tiers), done func()) {
	s := &ix.shards[i]
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, chunk := range s.slab {
		for j := range chunk {
			r := &chunk[j]
			if t := r.e.Tiers(); t != 0 {
				fn(&r.key, t)
			}
		}
	}
	done()
}

// ScanChunk is ScanShard over part of shard i: the records at positions
// [from, from+n) of the shard's slab, all under the shard's lock, so a
// snapshot can walk the index in bounded steps and let other callers in
// between. It returns the position to scan next and whether the shard has
// more. A record keeps its position while its key stays in the index
// (positions are reused only once a key is removed), so scanning a shard
// chunk by chunk visits, once each, every key that stays in the index
// throughout; a key added or removed meanwhile may be visited or not, and
// the observer learns of that change.
func (ix *Index) ScanChunk(i, from, n int, fn func(k *Key, t Tiers), done func()) (next int, more bool) {
	s := &ix.shards[i]
	s.mu.Lock()
	defer s.mu.Unlock()
	end := min(from+n, len(s.slab)*chunkLen)
	for p := max(from, 0); p < end; p++ {
		r := s.rec(uint32(p))
		if t := r.e.Tiers(); t != 0 {
			fn(&r.key, t)
		}
	}
	done()
	return end, end < len(s.slab)*chunkLen
}

// Len is the number of entries.
func (ix *Index) Len() int {
	n := 0
	for i := range ix.shards {
		s := &ix.shards[i]
		s.mu.Lock()
		n += s.n
		s.mu.Unlock()
	}
	return n
}

// Copies counts the entries whose block is ready in the CPU tier: clean
// ones (also on disk: the CPU copy can be dropped at once) and dirty ones
// (in the CPU tier only, with no disk write of them in flight).
func (ix *Index) Copies() (cleanN, dirtyN int) {
	for i := range ix.shards {
		s := &ix.shards[i]
		s.mu.Lock()
		cleanN += s.kinds[clean]
		dirtyN += s.kinds[dirty]
		s.mu.Unlock()
	}
	return cleanN, dirtyN
}

// CountNS is the number of entries of namespace ns.
func (ix *Index) CountNS(ns uint32) int {
	n := 0
	for i := range ix.shards {
		s := &ix.shards[i]
		s.mu.Lock()
		n += s.perNS[ns]
		s.mu.Unlock()
	}
	return n
}

// ReadyPerNS counts the Ready entries of each namespace that has any, from
// counts each shard keeps: its cost grows with the namespaces, not the
// entries.
func (ix *Index) ReadyPerNS() map[uint32]uint64 {
	out := map[uint32]uint64{}
	for i := range ix.shards {
		s := &ix.shards[i]
		s.mu.Lock()
		for ns, n := range s.readyNS {
			out[ns] += uint64(n)
		}
		s.mu.Unlock()
	}
	return out
}

// MemBytes is the memory the index holds for its tables and records.
func (ix *Index) MemBytes() int {
	recSize := int(unsafe.Sizeof(record{}))
	n := 0
	for i := range ix.shards {
		s := &ix.shards[i]
		s.mu.Lock()
		n += len(s.table)*4 + len(s.slab)*chunkLen*recSize + cap(s.free)*4
		s.mu.Unlock()
	}
	return n
}
