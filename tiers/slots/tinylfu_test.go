package slots

import (
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/dgraph-io/ristretto/v2"
	"github.com/kvoffloadd/kvoffloadd/index"
)

// lfuOwner records what a bare tinyLFU reports.
type lfuOwner struct {
	mu                sync.Mutex
	evicted, rejected []uint64
}

func newLFU(counters, capacity int64) (*tinyLFU, *lfuOwner) {
	o := &lfuOwner{}
	p := newTinyLFU(counters, callbacks{
		evict: func(hs []uint64) { o.mu.Lock(); o.evicted = append(o.evicted, hs...); o.mu.Unlock() },
		reject: func(ks []index.Key) {
			o.mu.Lock()
			defer o.mu.Unlock()
			for _, k := range ks {
				o.rejected = append(o.rejected, index.HashKey(&k))
			}
		},
	})
	p.setCapacity(capacity)
	return p, o
}

func admitKeys(p *tinyLFU, ks ...index.Key) {
	hs := make([]uint64, len(ks))
	for i := range ks {
		hs[i] = index.HashKey(&ks[i])
	}
	p.admit(ks, hs)
}

// Blocks looked up often keep their place: a new block looked up less than
// every block held is declined (Reject, with its own key), one looked up
// more evicts the least wanted of the sample, which the owner hears of by
// its policy key; forget makes room without an eviction.
func TestTinyLFUAdmitsByFrequency(t *testing.T) {
	p, o := newLFU(1<<14, 8)
	var held []index.Key
	for i := range 8 {
		k := plainKey(i)
		held = append(held, k)
		h := index.HashKey(&k)
		for range 3 + i { // key(0) the least wanted
			p.access([]uint64{h}, 0)
		}
	}
	admitKeys(p, held...)
	if p.size() != 8 || len(o.evicted)+len(o.rejected) != 0 {
		t.Fatalf("%d held, %d evicted, %d declined with room for 8", p.size(), len(o.evicted), len(o.rejected))
	}
	cold := plainKey(100)
	admitKeys(p, cold)
	if h := index.HashKey(&cold); !slices.Equal(o.rejected, []uint64{h}) || len(o.evicted) != 0 || p.holds(h) {
		t.Fatalf("a block never looked up: declined %x, evicted %x; want it declined", o.rejected, o.evicted)
	}
	hot := plainKey(101)
	hh := index.HashKey(&hot)
	for range 20 {
		p.access([]uint64{hh}, 0)
	}
	admitKeys(p, hot)
	if !p.holds(hh) || len(o.evicted) != 1 || p.size() != 8 {
		t.Fatalf("a block looked up 20 times: held %v, evicted %x, size %d", p.holds(hh), o.evicted, p.size())
	}
	// The sample of 5 of 8 may miss key(0): the victim is the least
	// wanted of the sample, a block held before, never the new one.
	if v := o.evicted[0]; v == hh || p.holds(v) {
		t.Fatalf("evicted %x, still held %v", v, p.holds(v))
	}
	p.forget(hh)
	admitKeys(p, plainKey(102))
	if len(o.evicted) != 1 || p.size() != 8 {
		t.Fatalf("after a forget: %d evicted, size %d", len(o.evicted), p.size())
	}
}

// A capacity lowered below what is held takes effect at the next admit:
// that admit evicts down to it (or is declined), never leaving more held.
func TestTinyLFUCapacityLowered(t *testing.T) {
	p, o := newLFU(1<<14, 64)
	for i := range 64 {
		admitKeys(p, plainKey(i))
	}
	p.setCapacity(16)
	k := plainKey(1000)
	for range 20 {
		p.access([]uint64{index.HashKey(&k)}, 0)
	}
	admitKeys(p, k)
	if p.size() != 16 || len(o.evicted) != 64+1-16 {
		t.Fatalf("size %d, %d evicted; want 16 held", p.size(), len(o.evicted))
	}
	p.setCapacity(0)
	admitKeys(p, plainKey(1001))
	if len(o.rejected) != 1 {
		t.Fatalf("a class with no room admitted a block: %d declined", len(o.rejected))
	}
}

// The same trace through ristretto's cache (what the policy was before
// issue 34) and through tinyLFU, as a class uses them: every request's
// blocks looked up (Touch), the missing ones stored (Admit). tinyLFU must
// not do worse (ristretto drops buffered lookups when its goroutine lags,
// which only lowers its own rate).
func TestTinyLFUHitRateAgainstRistretto(t *testing.T) {
	const keys, capacity, requests = 20_000, 1_000, 200_000
	trace := make([]uint64, requests)
	r := rand.New(rand.NewPCG(3, 4))
	zipf := rand.NewZipf(r, 1.1, 2, keys-1)
	for i := range trace {
		k := plainKey(int(zipf.Uint64()))
		if i%4 == 0 { // one-off blocks among the reused ones
			k = plainKey(keys + i)
		}
		trace[i] = index.HashKey(&k)
	}
	counters := int64(countersPerSlot * capacity)

	rc, err := ristretto.NewCache(&ristretto.Config[uint64, struct{}]{
		NumCounters: counters, MaxCost: capacity, BufferItems: touchBuffer, IgnoreInternalCost: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	oldHits := 0
	for _, h := range trace {
		if _, ok := rc.Get(h); ok {
			oldHits++
			continue
		}
		rc.Set(h, struct{}{}, 1)
		rc.Wait()
	}

	p, _ := newLFU(counters, capacity)
	oldRate, newRate := float64(oldHits)/requests, replayLFU(p, trace)
	t.Logf("hit rate: ristretto %.2f%%, tinyLFU %.2f%%", 100*oldRate, 100*newRate)
	if newRate < oldRate-0.005 {
		t.Fatalf("hit rate %.2f%%, ristretto's %.2f%% on the same trace", 100*newRate, 100*oldRate)
	}
}

const touchBuffer = 16 // ristretto's BufferItems as the policy used it

// replayLFU looks each key of trace up in p (an access), admits it on a
// miss, and returns the share of lookups that hit.
func replayLFU(p *tinyLFU, trace []uint64) float64 {
	hits := 0
	var k [1]index.Key
	for _, h := range trace {
		hit := p.holds(h)
		p.access([]uint64{h}, 0)
		if hit {
			hits++
			continue
		}
		p.admit(k[:], []uint64{h})
	}
	return float64(hits) / float64(len(trace))
}

// TestTinyLFUSmallSketch: the sketch a fifth as wide as its counters and
// the doorkeeper at 10% false positives (8 and at most 12 B per slot, where
// ristretto's sizes took 37) hit as often as ristretto's sizes on Zipf
// traces with one-off keys, at two skews and capacities.
func TestTinyLFUSmallSketch(t *testing.T) {
	for _, tc := range []struct {
		keys, capacity int
		skew           float64
		oneOff         int // every oneOff-th access is a key never seen again
	}{{20_000, 1_000, 1.1, 4}, {50_000, 5_000, 1.01, 8}} {
		trace := make([]uint64, 10*tc.keys)
		r := rand.New(rand.NewPCG(3, 4))
		zipf := rand.NewZipf(r, tc.skew, 2, uint64(tc.keys-1))
		for i := range trace {
			k := plainKey(int(zipf.Uint64()))
			if i%tc.oneOff == 0 {
				k = plainKey(tc.keys + i)
			}
			trace[i] = index.HashKey(&k)
		}
		counters := int64(countersPerSlot * tc.capacity)
		replay := func(p *tinyLFU) float64 {
			p.setCapacity(int64(tc.capacity))
			return replayLFU(p, trace)
		}
		quiet := callbacks{evict: func([]uint64) {}, reject: func([]index.Key) {}}
		small := newTinyLFU(counters, quiet)
		if per := float64(cmDepth*len(small.freq.rows[0])) / float64(tc.capacity); per > 4.1 {
			t.Fatalf("%+v: the sketch takes %.1f B a slot, want 4", tc, per)
		}
		if per := float64(small.door.TotalSize()) / float64(tc.capacity); per > 12.1 {
			t.Fatalf("%+v: the doorkeeper takes %.1f B a slot, want at most 12", tc, per)
		}
		full := newTinyLFUSized(counters, counters, 0.01, quiet)
		got, want := replay(small), replay(full)
		t.Logf("%+v: hit rate %.2f%%, %.2f%% with ristretto's sizes", tc, 100*got, 100*want)
		if got < want-0.002 {
			t.Fatalf("%+v: hit rate %.2f%%, %.2f%% with ristretto's sizes", tc, 100*got, 100*want)
		}
	}
}
