package slots

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// slruClass is a 16-slot class of an SLRU space (no reserve).
func slruClass(t *testing.T) (*Space, *Class, *owner) {
	t.Helper()
	testPolicy = SLRU
	defer func() { testPolicy = "" }()
	sp, o := newSpace(t, 1<<20, 1<<20)
	c, err := sp.Class(64 << 10)
	if err != nil {
		t.Fatal(err)
	}
	return sp, c, o
}

// waitProtected waits until the SLRU of c holds every key of hs in its
// protected segment.
func waitProtected(t *testing.T, c *Class, hs []uint64) {
	t.Helper()
	p := c.policy.(*slru)
	deadline := time.Now().Add(10 * time.Second)
	for {
		p.mu.Lock()
		n := 0
		for _, h := range hs {
			if p.protectedLocked(h) {
				n++
			}
		}
		p.mu.Unlock()
		if n == len(hs) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d touched blocks protected after 10s", n, len(hs))
		}
		time.Sleep(time.Millisecond)
	}
}

func (o *owner) evictedKeys() []index.Key {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.evicted)
}

// A full SLRU class evicts the least recently stored block nobody used
// again, one per new block, and tells the owner before Admit returns.
func TestSLRUEvictsTheOldestOnProbation(t *testing.T) {
	_, c, o := slruClass(t)
	for i := range 16 {
		if _, ok := o.store(t, c, key(i)); !ok {
			t.Fatalf("store %d found no slot", i)
		}
	}
	if ev := o.evictedKeys(); len(ev) != 0 {
		t.Fatalf("evicted %d blocks from a class with room", len(ev))
	}
	for i := 16; i < 20; i++ {
		o.store(t, c, key(i))
	}
	want := []index.Key{key(0), key(1), key(2), key(3)}
	if ev := o.evictedKeys(); !slices.Equal(ev, want) {
		t.Fatalf("evicted %v, want the four oldest", ev)
	}
}

// Blocks looked up again while held are protected: a scan of one-off
// blocks many times the class's size only churns the probation segment,
// and every protected block is still held after it.
func TestSLRUScanKeepsWhatIsUsedAgain(t *testing.T) {
	sp, c, o := slruClass(t)
	hot := make([]index.Key, 8)
	for i := range hot {
		hot[i] = key(i)
		o.store(t, c, hot[i])
	}
	hs := make([]uint64, len(hot))
	for i := range hot {
		hs[i] = sp.PolicyKey(&hot[i])
	}
	c.Touch(slices.Clone(hs)) // a Lookup that hits them
	// Touches reach the policy from the space's worker, a moment later
	// (a batch the worker has taken is not yet recorded when an Admit
	// drains the queue): wait for them, so the scan starts after.
	waitProtected(t, c, hs)
	for i := 100; i < 500; i++ {
		// A one-off prompt: looked up (a miss), then stored.
		k := key(i)
		c.Touch([]uint64{sp.PolicyKey(&k)})
		o.store(t, c, k)
	}
	for _, k := range hot {
		if !c.Holds(&k) {
			t.Fatalf("hot block %v was evicted by the scan", k)
		}
	}
	for _, k := range o.evictedKeys() {
		if slices.Contains(hot, k) {
			t.Fatalf("hot block %v evicted", k)
		}
	}
	if n := len(o.evictedKeys()); n < 400-8 {
		t.Fatalf("%d evictions for 400 one-off blocks into 8 free slots", n)
	}
}

// The protected segment is at most 80% of the class: when more blocks than
// that are used again, the least recently used of them go back on
// probation and are the next to go.
func TestSLRUProtectedSegmentIsBounded(t *testing.T) {
	sp, c, o := slruClass(t)
	var all []uint64
	for i := range 16 {
		k := key(i)
		o.store(t, c, k)
		all = append(all, sp.PolicyKey(&k))
	}
	c.Touch(all) // every block used again, key(0) first: 12 fit in the protected segment
	waitProtected(t, c, all[4:])
	o.store(t, c, key(100))
	// The new block went on probation after the 4 demoted ones (key(0)
	// to key(3), the least recently used); the oldest of those goes.
	if ev := o.evictedKeys(); !slices.Equal(ev, []index.Key{key(0)}) {
		t.Fatalf("evicted %v, want key(0): the least recently used block pushed out of the protected segment", ev)
	}
	for i := 4; i < 16; i++ {
		if k := key(i); !c.Holds(&k) {
			t.Fatalf("protected block %d is gone", i)
		}
	}
}

// One Admit of more new blocks than the class holds declines the oldest
// of them (Reject, not Evict: the owner never stored them).
func TestSLRUDeclinesWhatOneAdmitCannotHold(t *testing.T) {
	_, c, o := slruClass(t)
	keys := make([]index.Key, 20)
	for i := range keys {
		keys[i] = key(i)
	}
	c.Admit(keys)
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.evicted) != 0 || !slices.Equal(o.rejected, keys[:4]) {
		t.Fatalf("evicted %v, rejected %v; want the first 4 of the batch declined", o.evicted, o.rejected)
	}
}

// Forget takes a block out of the policy: it is not held, never evicted
// later, and its room goes to the next block.
func TestSLRUForget(t *testing.T) {
	_, c, o := slruClass(t)
	for i := range 16 {
		o.store(t, c, key(i))
	}
	k0 := key(0)
	c.Forget(&k0)
	if c.Holds(&k0) {
		t.Fatal("a forgotten block is still held")
	}
	o.mu.Lock()
	o.sp.Release(o.slot[k0])
	delete(o.slot, k0)
	o.mu.Unlock()
	o.store(t, c, key(16))
	if ev := o.evictedKeys(); len(ev) != 0 {
		t.Fatalf("evicted %v after a forget made room", ev)
	}
	o.store(t, c, key(17))
	if ev := o.evictedKeys(); !slices.Equal(ev, []index.Key{key(1)}) {
		t.Fatalf("evicted %v, want key(1) (key(0) was forgotten)", ev)
	}
}

func TestParsePolicy(t *testing.T) {
	if _, err := New(Config{Name: "test", Bytes: 1 << 20, ChunkBytes: 1 << 20, Policy: "lru"}); err == nil {
		t.Error("a space with an unknown policy was made")
	}
	for _, s := range []string{"slru", "tinylfu"} {
		if p, err := ParsePolicy(s); err != nil || string(p) != s {
			t.Errorf("ParsePolicy(%q) = %q, %v", s, p, err)
		}
	}
	for _, s := range []string{"", "lru", "SLRU"} {
		if _, err := ParsePolicy(s); err == nil {
			t.Errorf("ParsePolicy(%q) accepted", s)
		}
	}
}

// Accesses reach the policy from the space's worker, so a Lookup that
// missed a block can be recorded after the block's store: that must not
// count as its reuse (a one-off prompt would be protected), while a
// Lookup made after the store does.
func TestSLRULateMissDoesNotProtect(t *testing.T) {
	sp, c, o := slruClass(t)
	k := key(1)
	h := sp.PolicyKey(&k)
	missed := admits.Load() // the Lookup that missed k, made now
	o.store(t, c, k)
	c.policy.access([]uint64{h}, missed)
	p := c.policy.(*slru)
	protected := func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.protectedLocked(h)
	}
	if protected() {
		t.Fatal("a Lookup made before the store protected the block")
	}
	c.policy.access([]uint64{h}, admits.Load())
	if !protected() {
		t.Fatal("a Lookup made after the store did not protect the block")
	}
}

// Admits, accesses, forgets and capacity changes from many goroutines at
// once leave the SLRU consistent, checked every 50 operations of one of
// them and at the end: every key in exactly one segment, the protected one
// within its bound, nothing over capacity after an admit, and what it
// dropped reported to the owner.
func TestSLRUConcurrentUse(t *testing.T) {
	var mu sync.Mutex
	dropped := 0
	p := newSLRU(callbacks{
		evict:  func(hs []uint64) { mu.Lock(); dropped += len(hs); mu.Unlock() },
		reject: func(ks []index.Key) { mu.Lock(); dropped += len(ks); mu.Unlock() },
	})
	p.setCapacity(64)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for i := range 5000 {
				if g == 0 && i%50 == 0 {
					p.mu.Lock()
					err := slruConsistent(p, -1)
					p.mu.Unlock()
					if err != nil {
						errs <- err
						return
					}
				}
				k := key(r.IntN(512))
				h := binary.LittleEndian.Uint64(k.Hash[:])
				switch r.IntN(10) {
				case 0, 1, 2, 3:
					p.admit([]index.Key{k}, []uint64{h})
				case 4, 5, 6, 7:
					p.access([]uint64{h}, admits.Load())
				case 8:
					p.holds(h)
					p.forget(h)
				default:
					p.setCapacity(int64(32 + r.IntN(64)))
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	p.setCapacity(64)
	p.admit(nil, nil) // settles a capacity lowered last
	p.mu.Lock()
	err := slruConsistent(p, 64)
	p.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if dropped == 0 {
		t.Fatal("no key ever dropped with 512 keys through at most 95 slots")
	}
}

// protectedLocked reports whether p holds h in its protected segment.
func (p *slru) protectedLocked(h uint64) bool {
	r, ok := p.recs.lookup(h)
	return ok && p.node(r).admit&slruProtected != 0
}

// slruConsistent checks p's lists against its records, and (capacity >= 0)
// its size and protected segment against capacity. p.mu is held.
func slruConsistent(p *slru, capacity int) error {
	if got := p.prob.n + p.prot.n; got != p.recs.len() {
		return fmt.Errorf("%d keys in the segments, %d records", got, p.recs.len())
	}
	if capacity >= 0 {
		if p.recs.len() > capacity {
			return fmt.Errorf("%d keys held, capacity %d", p.recs.len(), capacity)
		}
		if bound := int(float64(capacity) * protectedShare); p.prot.n > bound {
			return fmt.Errorf("%d protected, bound %d", p.prot.n, bound)
		}
	}
	seen := 0
	for _, s := range []*segment{&p.prob, &p.prot} {
		prev, n := noRec, 0
		for r := s.front; r != noRec; r = p.node(r).next {
			if n++; n > p.recs.len() {
				return fmt.Errorf("a segment's list loops")
			}
			nd := p.node(r)
			if nd.prev != prev || p.segOf(nd) != s {
				return fmt.Errorf("record %d: prev %d, want %d; in the protected list %v, marked protected %v", r, nd.prev, prev, s == &p.prot, nd.admit&slruProtected != 0)
			}
			if got, ok := p.recs.lookup(p.recs.key(r)); !ok || got != r {
				return fmt.Errorf("record %d (key %x) not found under its key", r, p.recs.key(r))
			}
			prev = r
		}
		if s.back != prev || n != s.n {
			return fmt.Errorf("segment of %d records counts %d, back %d, want %d", n, s.n, s.back, prev)
		}
		seen += n
	}
	if seen != p.recs.len() {
		return fmt.Errorf("%d records in the lists, %d held", seen, p.recs.len())
	}
	return nil
}
