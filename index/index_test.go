package index

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"
)

func key(ns, g uint32, i uint64) Key {
	k := Key{NS: ns, Group: g}
	binary.LittleEndian.PutUint64(k.Hash[:], i)
	binary.LittleEndian.PutUint64(k.Hash[24:], i*0x9e3779b97f4a7c15)
	return k
}

func put(ix *Index, k Key, cpu uint32) {
	ix.Mutate(&k, func(e *Entry, found bool) bool {
		e.CPU = cpu
		e.State = Ready
		return true
	})
}

func del(ix *Index, k Key) {
	ix.Mutate(&k, func(*Entry, bool) bool { return false })
}

// TestAgainstMap drives random inserts, updates and deletes against a Go map
// and checks the index agrees after every step.
func TestAgainstMap(t *testing.T) {
	ix := New()
	model := map[Key]uint32{}
	r := rand.New(rand.NewPCG(1, 2))
	for step := 0; step < 200000; step++ {
		k := key(uint32(r.IntN(3)), uint32(r.IntN(2)), uint64(r.IntN(20000)))
		switch r.IntN(3) {
		case 0, 1:
			v := r.Uint32() >> 1
			put(ix, k, v)
			model[k] = v
		case 2:
			del(ix, k)
			delete(model, k)
		}
		if step%997 == 0 {
			for mk, mv := range model {
				e, ok := ix.Get(&mk)
				if !ok || e.CPU != mv || e.State != Ready {
					t.Fatalf("step %d: key %v: got %+v %v, want cpu %d", step, mk.NS, e, ok, mv)
				}
			}
			if ix.Len() != len(model) {
				t.Fatalf("step %d: Len %d, model %d", step, ix.Len(), len(model))
			}
			perNS := map[uint32]int{}
			for mk := range model {
				perNS[mk.NS]++
			}
			for ns := uint32(0); ns < 4; ns++ {
				if got := ix.CountNS(ns); got != perNS[ns] {
					t.Fatalf("step %d: CountNS(%d) = %d, model %d", step, ns, got, perNS[ns])
				}
			}
		}
	}
	// Keys never inserted are never found: the index is exact.
	for i := uint64(20000); i < 30000; i++ {
		k := key(0, 0, i)
		if _, ok := ix.Get(&k); ok {
			t.Fatalf("found key %d that was never inserted", i)
		}
	}
}

func TestMutateAbsentCanDecline(t *testing.T) {
	ix := New()
	k := key(1, 0, 1)
	ix.Mutate(&k, func(e *Entry, found bool) bool {
		if found || e.CPU != NoSlot || e.Disk != NoSlot {
			t.Fatalf("absent entry: found=%v e=%+v", found, e)
		}
		return false
	})
	if ix.Len() != 0 {
		t.Fatal("declined insert was kept")
	}
}

func TestRangeDeletes(t *testing.T) {
	ix := New()
	for i := uint64(0); i < 10000; i++ {
		put(ix, key(uint32(i%2), 0, i), uint32(i))
	}
	ix.Range(func(k *Key, e *Entry) bool { return k.NS != 1 })
	if ix.Len() != 5000 || ix.CountNS(1) != 0 || ix.CountNS(0) != 5000 {
		t.Fatalf("Len after dropping ns 1: %d (ns 0: %d, ns 1: %d)", ix.Len(), ix.CountNS(0), ix.CountNS(1))
	}
	for i := uint64(0); i < 10000; i++ {
		k := key(uint32(i%2), 0, i)
		_, ok := ix.Get(&k)
		if ok != (i%2 == 0) {
			t.Fatalf("key %d: found=%v", i, ok)
		}
	}
}

func BenchmarkInsertMillion(b *testing.B) {
	const n = 1 << 20
	keys := make([]Key, n)
	for i := range keys {
		keys[i] = key(1, 0, uint64(i))
	}
	b.ReportAllocs()
	var ix *Index
	for b.Loop() {
		ix = New()
		for i := range keys {
			put(ix, keys[i], uint32(i))
		}
	}
	b.ReportMetric(float64(ix.MemBytes())/n, "bytes/entry")
}

// BenchmarkLookup512 is one Lookup's worth of index work: 512 ready keys.
func BenchmarkLookup512(b *testing.B) {
	const n = 1 << 20
	ix := New()
	for i := 0; i < n; i++ {
		put(ix, key(1, 0, uint64(i)), uint32(i))
	}
	keys := make([]Key, 512)
	for i := range keys {
		keys[i] = key(1, 0, uint64(i*2039%n))
	}
	b.ReportAllocs()
	for b.Loop() {
		for i := range keys {
			if e, ok := ix.Get(&keys[i]); !ok || e.State != Ready {
				b.Fatal("miss")
			}
		}
	}
	b.ReportMetric(float64(ix.MemBytes())/n, "bytes/entry")
}

// TestCopies drives random entries through every combination of tiers,
// states and flags, with Mutate and Range, and checks the clean and dirty
// counts against a recount after every step.
func TestCopies(t *testing.T) {
	ix := New()
	model := map[Key]Entry{}
	r := rand.New(rand.NewPCG(5, 6))
	random := func() Entry {
		e := Entry{CPU: NoSlot, Disk: NoSlot, State: Writing + State(r.IntN(2)), Flags: uint8(r.IntN(16))}
		if r.IntN(3) > 0 {
			e.CPU = r.Uint32N(1000)
		}
		if r.IntN(2) == 0 {
			e.Disk = r.Uint32N(1000)
		}
		return e
	}
	for step := 0; step < 20000; step++ {
		k := key(0, 0, uint64(r.IntN(500)))
		switch r.IntN(5) {
		case 0, 1, 2:
			e := random()
			ix.Mutate(&k, func(x *Entry, _ bool) bool { *x = e; return true })
			model[k] = e
		case 3:
			del(ix, k)
			delete(model, k)
		case 4:
			// Range changes some entries and drops others.
			ix.Range(func(rk *Key, x *Entry) bool {
				switch r.IntN(4) {
				case 0:
					delete(model, *rk)
					return false
				case 1:
					*x = random()
					model[*rk] = *x
				}
				return true
			})
		}
		wantClean, wantDirty := 0, 0
		for _, e := range model {
			if e.State == Ready && e.CPU != NoSlot {
				if e.Disk != NoSlot {
					wantClean++
				} else if e.Flags&(DiskWriting|Spill) == 0 {
					wantDirty++
				}
			}
		}
		if c, d := ix.Copies(); c != wantClean || d != wantDirty {
			t.Fatalf("step %d: Copies() = %d clean, %d dirty; recount %d, %d", step, c, d, wantClean, wantDirty)
		}
	}
}

// replay is an Observer that keeps what its changes say each key holds.
type replay struct {
	t    *testing.T
	held map[Key]Tiers
}

func (r *replay) TiersChanged(k *Key, before, after Tiers) {
	if r.held[*k] != before {
		r.t.Fatalf("key %v: change from %b, but the changes so far say %b", k.Hash[:8], before, r.held[*k])
	}
	if after == 0 {
		delete(r.held, *k)
		return
	}
	r.held[*k] = after
}

// TestObserverReplay drives random changes of state and slots through Mutate
// and Range and checks that the observer's changes, replayed, say exactly
// what the index holds: every key's tiers, and no key more.
func TestObserverReplay(t *testing.T) {
	ix := New()
	rp := &replay{t: t, held: map[Key]Tiers{}}
	ix.Observe(rp)
	r := rand.New(rand.NewPCG(3, 4))
	slot := func() uint32 {
		if r.IntN(3) == 0 {
			return NoSlot
		}
		return r.Uint32() >> 1
	}
	check := func(step int) {
		n := 0
		ix.Range(func(k *Key, e *Entry) bool {
			if tt := e.Tiers(); tt != 0 {
				n++
				if rp.held[*k] != tt {
					t.Fatalf("step %d: key %v holds %b, the changes say %b", step, k.Hash[:8], tt, rp.held[*k])
				}
			}
			return true
		})
		if n != len(rp.held) {
			t.Fatalf("step %d: %d keys in a tier, the changes say %d", step, n, len(rp.held))
		}
	}
	for step := 0; step < 50000; step++ {
		k := key(uint32(r.IntN(2)), 0, uint64(r.IntN(5000)))
		switch op := r.IntN(100); {
		case op < 70:
			ix.Mutate(&k, func(e *Entry, found bool) bool {
				e.State = State(1 + r.IntN(2)) // Writing or Ready
				e.CPU, e.Disk = slot(), slot()
				return r.IntN(8) != 0
			})
		case op < 99:
			del(ix, k)
		default:
			// A chunk move or a whole-namespace drop: Range changes
			// and deletes many at once.
			lo := r.Uint32() >> 1
			ix.Range(func(k *Key, e *Entry) bool {
				if e.CPU != NoSlot && e.CPU < lo {
					e.CPU = NoSlot
				}
				return e.CPU != NoSlot || e.Disk != NoSlot
			})
		}
		if step%4999 == 0 {
			check(step)
		}
	}
	check(-1)
}

// TestScanShard checks a scan of every shard sees each key in a tier once,
// with its tiers, and no key being written.
func TestScanShard(t *testing.T) {
	ix := New()
	want := map[Key]Tiers{}
	for i := uint64(0); i < 3000; i++ {
		k := key(1, 0, i)
		ix.Mutate(&k, func(e *Entry, _ bool) bool {
			switch i % 3 {
			case 0:
				e.State, e.CPU = Ready, uint32(i)
				want[k] = InCPU
			case 1:
				e.State, e.CPU, e.Disk = Ready, uint32(i), uint32(i)
				want[k] = InCPU | InDisk
			default:
				e.CPU = uint32(i) // Writing: in no tier
			}
			return true
		})
	}
	got := map[Key]Tiers{}
	dones := 0
	for i := 0; i < Shards; i++ {
		ix.ScanShard(i, func(k *Key, tt Tiers) {
			if _, dup := got[*k]; dup {
				t.Fatalf("key %v seen twice", k.Hash[:8])
			}
			got[*k] = tt
		}, func() { dones++ })
	}
	if dones != Shards || len(got) != len(want) {
		t.Fatalf("%d dones, %d keys; want %d, %d", dones, len(got), Shards, len(want))
	}
	for k, tt := range want {
		if got[k] != tt {
			t.Fatalf("key %v: scanned %b, want %b", k.Hash[:8], got[k], tt)
		}
	}
}

// TestScanChunk scans every shard in chunks of a few records while keys
// come and go between the chunks: each key that stays in the index
// throughout is seen exactly once, with its tiers.
func TestScanChunk(t *testing.T) {
	ix := New()
	ready := func(k Key) {
		ix.Mutate(&k, func(e *Entry, _ bool) bool { e.State, e.CPU = Ready, 1; return true })
	}
	stay := map[Key]bool{}
	var churn []Key
	for i := uint64(0); i < 20000; i++ {
		k := key(1, 0, i)
		ready(k)
		if i%2 == 0 {
			stay[k] = true
		} else {
			churn = append(churn, k)
		}
	}
	seen := map[Key]int{}
	next := uint64(1 << 40)
	steps := 0
	for sh := 0; sh < Shards; sh++ {
		for pos, more := 0, true; more; steps++ {
			pos, more = ix.ScanChunk(sh, pos, 7, func(k *Key, tt Tiers) {
				if tt != InCPU {
					t.Fatalf("key %v: tiers %b", k.Hash[:8], tt)
				}
				seen[*k]++
			}, func() {})
			// Between chunks: remove a churning key, add new ones (they
			// take the freed positions, before or after the cursor).
			if len(churn) > 0 {
				k := churn[len(churn)-1]
				churn = churn[:len(churn)-1]
				ix.Mutate(&k, func(*Entry, bool) bool { return false })
			}
			ready(key(1, 0, next))
			next++
		}
	}
	for k := range stay {
		if seen[k] != 1 {
			t.Fatalf("key %v seen %d times, want once", k.Hash[:8], seen[k])
		}
	}
	if steps < Shards*2 {
		t.Fatalf("%d steps: the shards were not scanned in chunks", steps)
	}
}

// TestReadyPerNS drives entries through Writing, Ready and gone, by Mutate
// and Range, and checks the counts ReadyPerNS keeps against a walk.
func TestReadyPerNS(t *testing.T) {
	ix := New()
	r := rand.New(rand.NewPCG(3, 4))
	walk := func() map[uint32]uint64 {
		m := map[uint32]uint64{}
		ix.Range(func(k *Key, e *Entry) bool {
			if e.State == Ready {
				m[k.NS]++
			}
			return true
		})
		return m
	}
	for step := range 100000 {
		k := key(uint32(r.IntN(4)), 0, uint64(r.IntN(5000)))
		switch r.IntN(5) {
		case 0: // a store claims the key
			ix.Mutate(&k, func(e *Entry, found bool) bool { return true })
		case 1: // its copy drains
			ix.Mutate(&k, func(e *Entry, found bool) bool {
				if found {
					e.State, e.CPU = Ready, 1
				}
				return found
			})
		case 2: // evicted, or a failed store: the entry goes
			ix.Mutate(&k, func(e *Entry, found bool) bool { e.State = Ready; return false })
		case 3:
			put(ix, k, 2)
		case 4:
			if step%100 == 0 { // a Range that drops one namespace's ready entries
				ns := uint32(r.IntN(4))
				ix.Range(func(k *Key, e *Entry) bool { return k.NS != ns || e.State != Ready })
			}
		}
		if step%1000 == 0 {
			got, want := ix.ReadyPerNS(), walk()
			if len(got) != len(want) {
				t.Fatalf("step %d: ReadyPerNS %v, walk %v", step, got, want)
			}
			for ns, n := range want {
				if got[ns] != n {
					t.Fatalf("step %d: ReadyPerNS %v, walk %v", step, got, want)
				}
			}
		}
	}
}

// BenchmarkReadyPerNS is what Stats costs the index: with a million ready
// entries it must take what it takes with a thousand.
func BenchmarkReadyPerNS(b *testing.B) {
	for _, n := range []int{1 << 10, 1 << 20} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			ix := New()
			for i := range n {
				put(ix, key(uint32(i%4), 0, uint64(i)), uint32(i))
			}
			for b.Loop() {
				if m := ix.ReadyPerNS(); m[0] != uint64(n/4) {
					b.Fatalf("%v", m)
				}
			}
		})
	}
}

// TestMutateBatch checks MutateBatch against Mutate one key at a time in
// the keys' order: random batches (keys repeated within a batch, inserts,
// changes, deletes, declined inserts) applied both ways leave the same
// entries, counts and observed tiers, and fn runs once per position with
// the entry as the earlier positions left it.
func TestMutateBatch(t *testing.T) {
	one, batch := New(), New()
	rpOne, rpBatch := &replay{t: t, held: map[Key]Tiers{}}, &replay{t: t, held: map[Key]Tiers{}}
	one.Observe(rpOne)
	batch.Observe(rpBatch)
	r := rand.New(rand.NewPCG(5, 6))
	type plan struct {
		e    Entry
		keep bool
	}
	for round := 0; round < 300; round++ {
		n := r.IntN(600)
		keys := make([]Key, n)
		plans := make([]plan, n)
		for i := range keys {
			keys[i] = key(uint32(r.IntN(3)), uint32(r.IntN(2)), uint64(r.IntN(3000)))
			p := plan{e: Entry{CPU: NoSlot, Disk: NoSlot, State: State(1 + r.IntN(2))}, keep: r.IntN(6) != 0}
			if r.IntN(2) == 0 {
				p.e.CPU = r.Uint32() >> 1
			}
			if r.IntN(2) == 0 {
				p.e.Disk = r.Uint32() >> 1
			}
			plans[i] = p
		}
		// What each position saw, both ways.
		sawOne := make([]Entry, n)
		foundOne := make([]bool, n)
		for i := range keys {
			one.Mutate(&keys[i], func(e *Entry, found bool) bool {
				sawOne[i], foundOne[i] = *e, found
				*e = plans[i].e
				return plans[i].keep
			})
		}
		calls := make([]int, n)
		batch.MutateBatch(keys, func(i int, e *Entry, found bool) bool {
			calls[i]++
			if *e != sawOne[i] || found != foundOne[i] {
				t.Fatalf("round %d, position %d: batch saw %+v found=%v, one by one %+v found=%v", round, i, *e, found, sawOne[i], foundOne[i])
			}
			*e = plans[i].e
			return plans[i].keep
		})
		for i, c := range calls {
			if c != 1 {
				t.Fatalf("round %d: fn ran %d times for position %d", round, c, i)
			}
		}
		if round%50 != 0 {
			continue
		}
		if one.Len() != batch.Len() {
			t.Fatalf("round %d: Len %d one by one, %d batched", round, one.Len(), batch.Len())
		}
		one.Range(func(k *Key, e *Entry) bool {
			if got, ok := batch.Get(k); !ok || got != *e {
				t.Fatalf("round %d: key %x: batched %+v %v, one by one %+v", round, k.Hash[:8], got, ok, *e)
			}
			return true
		})
		for ns := uint32(0); ns < 3; ns++ {
			if a, b := one.CountNS(ns), batch.CountNS(ns); a != b {
				t.Fatalf("round %d: CountNS(%d) %d one by one, %d batched", round, ns, a, b)
			}
		}
		c1, d1 := one.Copies()
		c2, d2 := batch.Copies()
		if c1 != c2 || d1 != d2 {
			t.Fatalf("round %d: Copies %d/%d one by one, %d/%d batched", round, c1, d1, c2, d2)
		}
		if a, b := fmt.Sprint(one.ReadyPerNS()), fmt.Sprint(batch.ReadyPerNS()); a != b {
			t.Fatalf("round %d: ReadyPerNS %s one by one, %s batched", round, a, b)
		}
		if a, b := fmt.Sprint(rpOne.held), fmt.Sprint(rpBatch.held); a != b {
			t.Fatal("the observer learnt other tiers from the batches")
		}
	}
}
