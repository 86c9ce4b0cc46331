package slots

import (
	"container/list"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/dgraph-io/ristretto/v2"
	"github.com/kvoffloadd/kvoffloadd/index"
)

// Policy names a class's admission and eviction policy (Config.Policy).
type Policy string

const (
	// TinyLFU is ristretto's: a new block is admitted only if the
	// frequency sketch says it is wanted more than the block it would
	// evict, and evictions take the least frequent of a sample. Accesses
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

// callbacks are the class's guarded Evict and Reject.
type callbacks struct {
	evict, reject func(index.Key)
}

// tinyLFU is ristretto's cache used as a policy only (its values are the
// keys, every cost 1). Its callbacks run on ristretto's goroutine while
// admit waits for them.
type tinyLFU struct {
	c  *ristretto.Cache[uint64, index.Key]
	cb callbacks
}

func newTinyLFU(counters int64, cb callbacks) (*tinyLFU, error) {
	p := &tinyLFU{cb: cb}
	c, err := ristretto.NewCache(&ristretto.Config[uint64, index.Key]{
		// TinyLFU's frequency window: about ten times the blocks the
		// class can hold, and never so small that a burst of one-off
		// keys ages the hot set away.
		NumCounters: counters,
		// ristretto refuses a zero capacity; the first grow sets the
		// real one.
		MaxCost: 1,
		// ristretto gathers accesses in pooled buffers of this many
		// before they reach its sketch; access pads each batch to whole
		// buffers so a block looked up just before its store does not
		// look colder than the blocks looked up before it. The frequency
		// stays an estimate: ristretto drops a buffer when its policy
		// goroutine lags.
		BufferItems:        touchBuffer,
		IgnoreInternalCost: true,
		OnEvict:            func(it *ristretto.Item[index.Key]) { cb.evict(it.Value) },
		OnReject:           func(it *ristretto.Item[index.Key]) { cb.reject(it.Value) },
	})
	if err != nil {
		return nil, err
	}
	p.c = c
	return p, nil
}

func (p *tinyLFU) admit(keys []index.Key, hs []uint64) {
	for i := range keys {
		if !p.c.Set(hs[i], keys[i], 1) {
			p.cb.reject(keys[i])
		}
	}
	p.c.Wait()
}

func (p *tinyLFU) learn(keys []index.Key, hs []uint64) {
	for i := range keys {
		// ristretto drops a Set when its buffer is full: let it drain
		// and try once more (it fails again only once closed).
		if !p.c.Set(hs[i], keys[i], 1) {
			p.c.Wait()
			p.c.Set(hs[i], keys[i], 1)
		}
	}
	p.c.Wait()
}

// touchBuffer is ristretto's BufferItems for every class.
const touchBuffer = 16

// touchPad is the policy key access pads batches with. It is never a
// block's (a block key hashing to it only shares a frequency counter).
const touchPad = 0x9e3779b97f4a7c15

func (p *tinyLFU) access(hs []uint64, _ uint64) {
	for _, h := range hs {
		p.c.Get(h)
	}
	for i := len(hs) % touchBuffer; i != 0 && i < touchBuffer; i++ {
		p.c.Get(touchPad)
	}
}

func (p *tinyLFU) forget(h uint64) { p.c.Del(h) }

func (p *tinyLFU) holds(h uint64) bool {
	_, ok := p.c.GetTTL(h)
	return ok
}

// size is the cost used; every key costs 1. It counts the Sets the
// policy goroutine has processed (admit waits for them).
func (p *tinyLFU) size() int64 { return max(p.c.MaxCost()-p.c.RemainingCost(), 0) }

// setCapacity is an atomic store in ristretto.
func (p *tinyLFU) setCapacity(n int64) { p.c.UpdateMaxCost(n) }

// close clears the cache, which "evicts" every key: the class's guards
// keep those from the owner.
func (p *tinyLFU) close() { p.c.Close() }

// protectedShare is the most of an SLRU's capacity the protected segment
// takes.
const protectedShare = 0.8

// slru is the SLRU policy.
type slru struct {
	cb       callbacks
	capacity atomic.Int64

	mu   sync.Mutex
	at   map[uint64]*list.Element // of *slruEntry
	prob *list.List
	prot *list.List
}

type slruEntry struct {
	h         uint64
	key       index.Key
	protected bool
	admit     uint64 // the admit that added it (admits)
}

func newSLRU(cb callbacks) *slru {
	p := &slru{cb: cb, at: map[uint64]*list.Element{}, prob: list.New(), prot: list.New()}
	p.capacity.Store(1)
	return p
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
	var evicted, rejected []index.Key
	p.mu.Lock()
	for i := range keys {
		if el, ok := p.at[hs[i]]; ok {
			p.touchLocked(el) // held already: a store of it counts as a use
			continue
		}
		p.at[hs[i]] = p.prob.PushFront(&slruEntry{h: hs[i], key: keys[i], admit: batch})
	}
	for limit := max(p.capacity.Load(), 0); int64(len(p.at)) > limit; {
		l := p.prob
		if l.Len() == 0 {
			l = p.prot
		}
		e := l.Remove(l.Back()).(*slruEntry)
		delete(p.at, e.h)
		if e.admit == batch {
			rejected = append(rejected, e.key)
		} else {
			evicted = append(evicted, e.key)
		}
	}
	p.mu.Unlock()
	for _, k := range evicted {
		p.cb.evict(k)
	}
	for _, k := range rejected {
		p.cb.reject(k)
	}
}

// touchLocked records a use of a held key: on probation it moves to the
// protected segment (whose least recent block goes back on probation when
// it is full), protected it moves to the front.
func (p *slru) touchLocked(el *list.Element) {
	e := el.Value.(*slruEntry)
	if e.protected {
		p.prot.MoveToFront(el)
		return
	}
	p.prob.Remove(el)
	e.protected = true
	p.at[e.h] = p.prot.PushFront(e)
	limit := max(int(float64(p.capacity.Load())*protectedShare), 1)
	for p.prot.Len() > limit {
		d := p.prot.Remove(p.prot.Back()).(*slruEntry)
		d.protected = false
		p.at[d.h] = p.prob.PushFront(d)
	}
}

// access promotes the keys among hs that were held when the accesses were
// made (added at admit seq or before); the others are not tracked.
func (p *slru) access(hs []uint64, seq uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, h := range hs {
		if el, ok := p.at[h]; ok && el.Value.(*slruEntry).admit <= seq {
			p.touchLocked(el)
		}
	}
}

func (p *slru) forget(h uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if el, ok := p.at[h]; ok {
		delete(p.at, h)
		if el.Value.(*slruEntry).protected {
			p.prot.Remove(el)
		} else {
			p.prob.Remove(el)
		}
	}
}

func (p *slru) holds(h uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.at[h]
	return ok
}

func (p *slru) size() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return int64(len(p.at))
}

func (p *slru) setCapacity(n int64) { p.capacity.Store(n) }

func (p *slru) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	clear(p.at)
	p.prob.Init()
	p.prot.Init()
}
