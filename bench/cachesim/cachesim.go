// Package cachesim owns the hit-rate references kvbench puts beside the
// daemon's: the same request trace replayed against an LRU cache of the
// same capacity and against Belady's offline optimum, so the value of the
// daemon's admission and eviction policy is visible (a policy below LRU
// costs hits; the optimum bounds what any policy could get).
//
// The replay follows kvbench's engine step by step: every request of a
// step is looked up against the cache as it was when the step began (its
// hits are the leading keys present, as a prefix cache counts them), then
// every key the engine computed (the ones after the hit prefix) is stored.
package cachesim

import (
	"container/heap"
	"container/list"
	"fmt"
	"math"
)

// Request is one prompt's keys in order.
type Request []string

// Result is one replay.
type Result struct {
	LookedUp int // keys looked up
	Hits     int // keys in hit prefixes
}

// Rate is Hits / LookedUp.
func (r Result) Rate() float64 {
	if r.LookedUp == 0 {
		return 0
	}
	return float64(r.Hits) / float64(r.LookedUp)
}

// cache is what a replay needs of a policy.
type cache interface {
	has(k string) bool
	// hit records the lookup of a present key at trace position t.
	hit(k string, t int)
	// put stores k at trace position t (present: a refresh).
	put(k string, t int)
}

func replay(steps [][]Request, c cache) Result {
	var r Result
	t := 0
	for _, step := range steps {
		ready := make([]int, len(step))
		for i, req := range step {
			n := 0
			for n < len(req) && c.has(req[n]) {
				n++
			}
			for j := range req {
				if j < n {
					c.hit(req[j], t)
				}
				t++
			}
			ready[i] = n
			r.LookedUp += len(req)
			r.Hits += n
		}
		// Stores come after the step's lookups: the engine computes the
		// misses, then saves them.
		st := t - sum(step)
		for i, req := range step {
			for j := range req {
				if j >= ready[i] {
					c.put(req[j], st)
				}
				st++
			}
		}
	}
	return r
}

func sum(step []Request) int {
	n := 0
	for _, r := range step {
		n += len(r)
	}
	return n
}

// LRU replays steps against a least-recently-used cache of capacity keys.
func LRU(steps [][]Request, capacity int) Result {
	return replay(steps, &lru{cap: capacity, at: map[string]*list.Element{}, order: list.New()})
}

type lru struct {
	cap   int
	at    map[string]*list.Element
	order *list.List // front: most recent
}

func (c *lru) has(k string) bool { _, ok := c.at[k]; return ok }

func (c *lru) hit(k string, _ int) { c.order.MoveToFront(c.at[k]) }

func (c *lru) put(k string, _ int) {
	if e, ok := c.at[k]; ok {
		c.order.MoveToFront(e)
		return
	}
	if c.cap <= 0 {
		return
	}
	if c.order.Len() >= c.cap {
		old := c.order.Back()
		c.order.Remove(old)
		delete(c.at, old.Value.(string))
	}
	c.at[k] = c.order.PushFront(k)
}

// Belady replays steps against the offline optimum of capacity keys: on a
// store into a full cache it drops the key whose next use is furthest in
// the future, or does not store the new key when that is the one (Belady's
// MIN with bypass, optimal for per-key hits). Prefix hits are what it is
// scored on; keys of a chain are always used together with the keys before
// them, so the furthest next use falls on the end of a chain first (ties go
// to the later trace position), and the optimum keeps prefixes whole.
func Belady(steps [][]Request, capacity int) Result {
	// next[t] is the trace position of the next lookup of the key looked
	// up at t (math.MaxInt: never again).
	var keys []string
	for _, st := range steps {
		for _, r := range st {
			keys = append(keys, r...)
		}
	}
	next := make([]int, len(keys))
	last := map[string]int{}
	for t := len(keys) - 1; t >= 0; t-- {
		if n, ok := last[keys[t]]; ok {
			next[t] = n
		} else {
			next[t] = math.MaxInt
		}
		last[keys[t]] = t
	}
	return replay(steps, &belady{cap: capacity, next: next, in: map[string]*entry{}})
}

type entry struct {
	key  string
	next int // trace position of its next use
	pos  int // for tie breaks: the later position goes first
	i    int // heap index
}

type belady struct {
	cap  int
	next []int
	in   map[string]*entry
	h    furthest
}

func (c *belady) has(k string) bool { _, ok := c.in[k]; return ok }

func (c *belady) hit(k string, t int) {
	e := c.in[k]
	e.next, e.pos = c.next[t], t
	heap.Fix(&c.h, e.i)
}

func (c *belady) put(k string, t int) {
	if e, ok := c.in[k]; ok {
		e.next, e.pos = c.next[t], t
		heap.Fix(&c.h, e.i)
		return
	}
	if c.cap <= 0 {
		return
	}
	n := &entry{key: k, next: c.next[t], pos: t}
	if len(c.h) >= c.cap {
		top := c.h[0]
		if !later(top, n) {
			return // the new key is the one used furthest away: bypass
		}
		heap.Pop(&c.h)
		delete(c.in, top.key)
	}
	heap.Push(&c.h, n)
	c.in[k] = n
}

// later: a's next use comes after b's (ties: a stands later in the trace).
func later(a, b *entry) bool {
	if a.next != b.next {
		return a.next > b.next
	}
	return a.pos > b.pos
}

// furthest is a heap whose top is the entry used furthest in the future.
type furthest []*entry

func (h furthest) Len() int           { return len(h) }
func (h furthest) Less(i, j int) bool { return later(h[i], h[j]) }
func (h furthest) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].i, h[j].i = i, j
}
func (h *furthest) Push(x any) {
	e := x.(*entry)
	e.i = len(*h)
	*h = append(*h, e)
}
func (h *furthest) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// Capacity is how many blocks of slotBytes a tier of tierBytes holds when
// it is cut into chunks of chunkBytes (a slot never straddles a chunk).
func Capacity(tierBytes, chunkBytes, slotBytes uint64) (int, error) {
	if chunkBytes == 0 || slotBytes == 0 || slotBytes > chunkBytes {
		return 0, fmt.Errorf("cachesim: %d-byte slots in %d-byte chunks", slotBytes, chunkBytes)
	}
	return int(tierBytes / chunkBytes * (chunkBytes / slotBytes)), nil
}
