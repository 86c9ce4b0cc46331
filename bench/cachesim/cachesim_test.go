package cachesim

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// one makes a step of single-key requests.
func one(keys ...string) []Request {
	out := make([]Request, len(keys))
	for i, k := range keys {
		out[i] = Request{k}
	}
	return out
}

func TestReplay(t *testing.T) {
	for _, tc := range []struct {
		name            string
		steps           [][]Request
		capacity        int
		lru, opt, total int
	}{
		{
			// a b c a b c ... with room for 2: LRU always evicts the
			// key needed next; the optimum keeps a and b and never stores c.
			name:     "cycle",
			steps:    [][]Request{one("a"), one("b"), one("c"), one("a"), one("b"), one("c"), one("a"), one("b"), one("c")},
			capacity: 2, lru: 0, opt: 4, total: 9,
		},
		{
			// A key stored in a step is not there for the same step's
			// later lookups: stores come after every lookup of the step.
			name:     "same step",
			steps:    [][]Request{one("a", "a"), one("a")},
			capacity: 4, lru: 1, opt: 1, total: 3,
		},
		{
			// Hits are prefixes: with a missing, b and c count nothing.
			name:     "prefix",
			steps:    [][]Request{{{"a", "b", "c"}}, {{"x", "b", "c"}}, {{"a", "b", "c"}}},
			capacity: 16, lru: 3, opt: 3, total: 9,
		},
		{
			name:     "no room",
			steps:    [][]Request{one("a"), one("a")},
			capacity: 0, lru: 0, opt: 0, total: 2,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, o := LRU(tc.steps, tc.capacity), Belady(tc.steps, tc.capacity)
			if l.Hits != tc.lru || o.Hits != tc.opt || l.LookedUp != tc.total || o.LookedUp != tc.total {
				t.Errorf("LRU %+v, Belady %+v; want hits %d and %d of %d", l, o, tc.lru, tc.opt, tc.total)
			}
		})
	}
}

// TestOptimumBounds replays random chained traces: the optimum is never
// below LRU nor above an unbounded cache, and both grow with capacity.
func TestOptimumBounds(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	for trial := range 50 {
		var steps [][]Request
		for range 20 {
			var step []Request
			for range 1 + rng.IntN(4) {
				// A chain: a root and a few blocks after it, shared
				// while the root is.
				root, n := rng.IntN(8), 1+rng.IntN(5)
				var r Request
				for j := range n {
					r = append(r, fmt.Sprintf("%d/%d", root, j))
				}
				step = append(step, r)
			}
			steps = append(steps, step)
		}
		inf := LRU(steps, 1<<20).Hits
		prevL, prevO := -1, -1
		for _, c := range []int{1, 3, 6, 12, 24, 48} {
			l, o := LRU(steps, c).Hits, Belady(steps, c).Hits
			if o < l || o > inf {
				t.Fatalf("trial %d capacity %d: Belady %d, LRU %d, unbounded %d", trial, c, o, l, inf)
			}
			if l < prevL || o < prevO {
				t.Fatalf("trial %d capacity %d: hits fell with more room (LRU %d after %d, Belady %d after %d)", trial, c, l, prevL, o, prevO)
			}
			prevL, prevO = l, o
		}
		if got := Belady(steps, 1<<20).Hits; got != inf {
			t.Fatalf("trial %d: Belady with room for all %d, unbounded LRU %d", trial, got, inf)
		}
	}
}

func TestCapacity(t *testing.T) {
	n, err := Capacity(1<<30, 64<<20, 2<<20+4096)
	if err != nil || n != 16*31 {
		t.Errorf("Capacity: %d, %v; want %d", n, err, 16*31)
	}
	if _, err := Capacity(1<<30, 1<<20, 2<<20); err == nil {
		t.Error("slot larger than a chunk: no error")
	}
}
