package slots

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// Policy names a class's admission and eviction policy (Config.Policy).
type Policy string

const (
	// TinyLFU is ristretto's policy (tinylfu.go): a new block is
	// admitted only if the frequency sketch says it is wanted more than
	// the block it would evict, and evictions take the least frequent of
	// a sample. Accesses
	// to blocks not held (a Lookup's misses) count, so a prefix many
	// requests want earns its place before its first store. It saves
	// writes where admission costs I/O (the disk tier).
	TinyLFU Policy = "tinylfu"
	// SLRU is a segmented LRU: a new block goes on probation, a block
	// accessed again while held moves to the protected segment (80% of
	// the slots at most, its least recent going back on probation), and
	// evictions take the least recent block on probation. One-off blocks
	// only churn the probation segment, so a scan cannot flush what
	// requests reuse; recency decides the rest. On kvbench's traces it
	// beats LRU where TinyLFU trails it (docs/benchmarks.md).
	SLRU Policy = "slru"
)

// ParsePolicy reads a --*-policy flag.
func ParsePolicy(s string) (Policy, error) {
	switch p := Policy(s); p {
	case TinyLFU, SLRU:
		return p, nil
	}
	return "", fmt.Errorf("policy %q: want %s or %s", s, SLRU, TinyLFU)
}

// policy is what a class asks of its admission and eviction policy. Every
// method is safe for concurrent use. admit and learn call the space's
// Evict and Reject callbacks (through the class's guards) before they
// return, never while holding a lock of the policy's.
type policy interface {
	// admit offers new keys (distinct; hs are their PolicyKeys).
	admit(keys []index.Key, hs []uint64)
	// learn is admit for keys the owner already keeps (recovery).
	learn(keys []index.Key, hs []uint64)
	// access records lookups (hit or miss) of the keys hs, made when the
	// last admit was seq (see admits).
	access(hs []uint64, seq uint64)
	forget(h uint64)
	holds(h uint64) bool
	// size counts the keys held (admitted and not yet evicted or
	// forgotten).
	size() int64
	// setCapacity is how many blocks the class may keep; it takes effect
	// at the next admit.
	setCapacity(n int64)
	close()
}

// callbacks are the class's guarded Evict and Reject. A policy keeps only
// the policy keys of the blocks it holds: evict gets those, and the class
// finds their keys in the owner's index (Config.Keys). reject gets the
// keys of the admit that was declined, which the policy has at hand.
type callbacks struct {
	evict  func(hs []uint64)
	reject func(keys []index.Key)
}

// declined returns the keys of the batch whose policy keys are among hs.
func declined(keys []index.Key, hs, declined []uint64) []index.Key {
	if len(declined) == 0 {
		return nil
	}
	at := make(map[uint64]int, len(hs))
	for i, h := range hs {
		at[h] = i
	}
	out := make([]index.Key, 0, len(declined))
	for _, h := range declined {
		out = append(out, keys[at[h]])
	}
	return out
}

// protectedShare is the most of an SLRU's capacity the protected segment
// takes.
const protectedShare = 0.8

// slru is the SLRU policy: two doubly linked lists (probation and
// protected, front the most recent) threaded through its records.
type slru struct {
	held
	nodes [][]slruNode // beside recs, by record number
	prob  segment
	prot  segment
}

// slruNode is an SLRU's state of one block.
type slruNode struct {
	prev, next uint32 // record numbers, noRec at either end
	// admit is the admit that added the block (admits), with slruProtected
	// set while it is in the protected segment.
	admit uint64
}

const slruProtected = 1 << 63

// segment is one of an SLRU's lists.
type segment struct {
	front, back uint32
	n           int
}

func newSLRU(cb callbacks) *slru {
	p := &slru{held: held{cb: cb}}
	p.resetLocked()
	p.capacity.Store(1)
	return p
}

func (p *slru) resetLocked() {
	p.recs.reset()
	p.nodes = nil
	p.prob = segment{front: noRec, back: noRec}
	p.prot = p.prob
}

func (p *slru) node(r uint32) *slruNode { return &p.nodes[r>>recShift][r&(recLen-1)] }

func (p *slru) segOf(n *slruNode) *segment {
	if n.admit&slruProtected != 0 {
		return &p.prot
	}
	return &p.prob
}

// pushFront puts record r at the front of s.
func (p *slru) pushFront(s *segment, r uint32) {
	n := p.node(r)
	n.prev, n.next = noRec, s.front
	if s.front != noRec {
		p.node(s.front).prev = r
	} else {
		s.back = r
	}
	s.front = r
	s.n++
}

// unlink takes record r out of s.
func (p *slru) unlink(s *segment, r uint32) {
	n := p.node(r)
	if n.prev != noRec {
		p.node(n.prev).next = n.next
	} else {
		s.front = n.next
	}
	if n.next != noRec {
		p.node(n.next).prev = n.prev
	} else {
		s.back = n.prev
	}
	s.n--
}

// removeLocked drops record r, and moves the last record into its number
// (records.remove), relinking its neighbours.
func (p *slru) removeLocked(r uint32) {
	p.unlink(p.segOf(p.node(r)), r)
	last := p.recs.remove(r)
	if last == r {
		return
	}
	n := p.node(r)
	*n = *p.node(last)
	s := p.segOf(n)
	if n.prev != noRec {
		p.node(n.prev).next = r
	} else {
		s.front = r
	}
	if n.next != noRec {
		p.node(n.next).prev = r
	} else {
		s.back = r
	}
}

func (p *slru) admit(keys []index.Key, hs []uint64) { p.add(keys, hs) }
func (p *slru) learn(keys []index.Key, hs []uint64) { p.add(keys, hs) }

// admits numbers every admit and learn of every SLRU: a key evicted by the
// admit that added it is reported declined (Reject), not evicted; and an
// access counts as a reuse only of a block added before it was made
// (accesses reach the policy a moment late, from the space's worker: a
// one-off block's Lookup, a miss, must not promote it once it is stored).
var admits atomic.Uint64

func (p *slru) add(keys []index.Key, hs []uint64) {
	batch := admits.Add(1)
	var evicted, rejected []uint64
	p.mu.Lock()
	for _, h := range hs {
		if r, ok := p.recs.lookup(h); ok {
			p.touchLocked(r) // held already: a store of it counts as a use
			continue
		}
		r := p.recs.add(h)
		p.nodes = chunkFor(p.nodes, r)
		*p.node(r) = slruNode{admit: batch}
		p.pushFront(&p.prob, r)
	}
	for limit := max(p.capacity.Load(), 0); int64(p.recs.len()) > limit; {
		s := &p.prob
		if s.n == 0 {
			s = &p.prot
		}
		r := s.back
		h, admit := p.recs.key(r), p.node(r).admit&^slruProtected
		p.removeLocked(r)
		if admit == batch {
			rejected = append(rejected, h)
		} else {
			evicted = append(evicted, h)
		}
	}
	p.mu.Unlock()
	if len(evicted) > 0 {
		p.cb.evict(evicted)
	}
	if len(rejected) > 0 {
		p.cb.reject(declined(keys, hs, rejected))
	}
}

// touchLocked records a use of a held block: on probation it moves to the
// protected segment (whose least recent block goes back on probation when
// it is full), protected it moves to the front.
func (p *slru) touchLocked(r uint32) {
	n := p.node(r)
	if n.admit&slruProtected != 0 {
		p.unlink(&p.prot, r)
		p.pushFront(&p.prot, r)
		return
	}
	p.unlink(&p.prob, r)
	n.admit |= slruProtected
	p.pushFront(&p.prot, r)
	limit := max(int(float64(p.capacity.Load())*protectedShare), 1)
	for p.prot.n > limit {
		d := p.prot.back
		p.unlink(&p.prot, d)
		p.node(d).admit &^= slruProtected
		p.pushFront(&p.prob, d)
	}
}

// access promotes the keys among hs that were held when the accesses were
// made (added at admit seq or before); the others are not tracked.
func (p *slru) access(hs []uint64, seq uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, h := range hs {
		if r, ok := p.recs.lookup(h); ok && p.node(r).admit&^slruProtected <= seq {
			p.touchLocked(r)
		}
	}
}

func (p *slru) forget(h uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r, ok := p.recs.lookup(h); ok {
		p.removeLocked(r)
	}
}

// held is what both policies keep alike: their callbacks, their
// capacity, and the records of the blocks they hold, under their lock.
type held struct {
	cb       callbacks
	capacity atomic.Int64

	mu   sync.Mutex
	recs records // the blocks held
}

func (p *held) holds(h uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.recs.lookup(h)
	return ok
}

func (p *held) size() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return int64(p.recs.len())
}

func (p *held) setCapacity(n int64) { p.capacity.Store(n) }

func (p *slru) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resetLocked()
}
