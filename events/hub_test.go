package events

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
)

func key(ns uint32, i uint64) index.Key {
	k := index.Key{NS: ns}
	binary.BigEndian.PutUint64(k.Hash[:], i)
	return k
}

// set makes k ready in tiers t (0: removes it), as the service would.
func set(ix *index.Index, k index.Key, t index.Tiers) {
	ix.Mutate(&k, func(e *index.Entry, _ bool) bool {
		e.State, e.CPU, e.Disk = index.Ready, index.NoSlot, index.NoSlot
		if t&index.InCPU != 0 {
			e.CPU = 1
		}
		if t&index.InDisk != 0 {
			e.Disk = 1
		}
		return t != 0
	})
}

// view is what a router builds from a subscription: each block's tiers.
type view struct {
	held     map[index.Key]index.Tiers
	cleared  int
	lost     int
	caughtUp uint64 // the Seq of the last CaughtUp
	synced   bool   // a CaughtUp came
	lastSeq  uint64
}

func newView() *view { return &view{held: map[index.Key]index.Tiers{}} }

func (v *view) apply(evs []Event) error {
	for _, e := range evs {
		if e.Seq < v.lastSeq {
			return fmt.Errorf("seq went back from %d to %d (%+v)", v.lastSeq, e.Seq, e)
		}
		v.lastSeq = e.Seq
		switch e.Kind {
		case Stored:
			v.held[e.Key] |= e.Tier
		case Removed:
			if v.held[e.Key] &^= e.Tier; v.held[e.Key] == 0 {
				delete(v.held, e.Key)
			}
		case Cleared:
			v.held = map[index.Key]index.Tiers{}
			v.cleared++
		case Lost:
			v.lost++
		case CaughtUp:
			v.caughtUp, v.synced = e.Seq, true
		default:
			return fmt.Errorf("unknown event %+v", e)
		}
	}
	return nil
}

func (v *view) must(t *testing.T, evs []Event) {
	t.Helper()
	if err := v.apply(evs); err != nil {
		t.Fatal(err)
	}
}

// until reads sub into v until it is told CaughtUp at seq or later.
func (v *view) until(t *testing.T, sub *Sub, seq uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	buf := make([]Event, 0, 256)
	for v.caughtUp < seq || !v.synced {
		evs, err := sub.Next(ctx, nil, buf)
		if err != nil {
			t.Fatalf("waiting to catch up to %d (at %d): %v", seq, v.caughtUp, err)
		}
		v.must(t, evs)
	}
}

// check compares v with what the index holds of namespace ns.
func (v *view) check(t *testing.T, ix *index.Index, ns uint32) {
	t.Helper()
	want := map[index.Key]index.Tiers{}
	for i := 0; i < index.Shards; i++ {
		ix.ScanShard(i, func(k *index.Key, tt index.Tiers) {
			if k.NS == ns {
				want[*k] = tt
			}
		}, func() {})
	}
	for k, tt := range want {
		if v.held[k] != tt {
			t.Fatalf("key %x: the events say %b, the index holds %b", k.Hash[:8], v.held[k], tt)
		}
	}
	for k := range v.held {
		if k.NS != ns {
			t.Fatalf("an event of namespace %d reached a subscriber of %d", k.NS, ns)
		}
		if _, ok := want[k]; !ok {
			t.Fatalf("key %x: the events say %b, the index holds nothing", k.Hash[:8], v.held[k])
		}
	}
}

func TestSnapshotThenChanges(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{})
	h.SetHashLen(1, 16)
	h.SetHashLen(2, 32)
	for i := uint64(0); i < 100; i++ {
		set(ix, key(1, i), index.InCPU)
		set(ix, key(2, i), index.InDisk)
	}
	sub, err := h.Subscribe([]uint32{1}, true)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	v := newView()
	v.until(t, sub, 0)
	if v.cleared != 1 || len(v.held) != 100 {
		t.Fatalf("snapshot: %d resets, %d blocks; want 1, 100", v.cleared, len(v.held))
	}
	v.check(t, ix, 1)

	// Demotion: CPU to disk in one change is DISK stored, then CPU removed.
	set(ix, key(1, 7), index.InDisk)
	set(ix, key(2, 7), index.InCPU) // not followed
	set(ix, key(1, 8), 0)
	evs, err := sub.Next(context.Background(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		kind Kind
		tier index.Tiers
		i    uint64
	}{{Stored, index.InDisk, 7}, {Removed, index.InCPU, 7}, {Removed, index.InCPU, 8}}
	if len(evs) != len(want) {
		t.Fatalf("got %d events %+v, want %d", len(evs), evs, len(want))
	}
	for i, w := range want {
		e := evs[i]
		if e.Kind != w.kind || e.Tier != w.tier || e.Key != key(1, w.i) || len(e.Hash()) != 16 {
			t.Fatalf("event %d: %+v, want %v %b key %d", i, e, w.kind, w.tier, w.i)
		}
		if i > 0 && e.Seq <= evs[i-1].Seq {
			t.Fatalf("changes in a row have seqs %d, %d", evs[i-1].Seq, e.Seq)
		}
	}
	v.must(t, evs)
	v.until(t, sub, h.LastSeq(1))
	v.check(t, ix, 1)
}

// TestResetIsOneClear: an Invalidate of a whole namespace reaches its
// subscribers as one reset and a snapshot of what is left, not a removal
// per block.
func TestResetIsOneClear(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{})
	for i := uint64(0); i < 1000; i++ {
		set(ix, key(1, i), index.InCPU)
	}
	sub, _ := h.Subscribe([]uint32{1}, true)
	defer sub.Close()
	v := newView()
	v.until(t, sub, 0)
	h.BeginReset([]uint32{1})
	ix.Range(func(k *index.Key, e *index.Entry) bool { return k.NS != 1 || k.Hash[7] == 0 })
	h.EndReset([]uint32{1})
	removed := 0
	for v.caughtUp < h.LastSeq(1) || v.cleared < 2 {
		evs, err := sub.Next(context.Background(), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range evs {
			if e.Kind == Removed {
				removed++
			}
		}
		v.must(t, evs)
	}
	if removed != 0 || len(v.held) != 4 {
		t.Fatalf("%d removals sent, %d blocks left in the view; want 0, 4", removed, len(v.held))
	}
	v.check(t, ix, 1)
}

// TestSlowSubscriberIsTold: a subscriber that falls behind the ring is
// told Lost, then gets a reset and a snapshot, and its view is exact again.
func TestSlowSubscriberIsTold(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{Buffer: 64})
	slow, _ := h.Subscribe([]uint32{1}, true)
	defer slow.Close()
	v := newView()
	v.until(t, slow, 0)
	for i := uint64(0); i < 1000; i++ {
		set(ix, key(1, i%300), index.Tiers(i%4))
	}
	v.until(t, slow, h.LastSeq(1))
	if v.lost != 1 || v.cleared != 2 {
		t.Fatalf("%d losses and %d resets reported; want 1 and 2", v.lost, v.cleared)
	}
	v.check(t, ix, 1)
}

// TestReplayUnderConcurrency: writers change random blocks of three
// namespaces (one change at a time, chunk moves with Range, whole-namespace
// resets) while subscribers of namespace 1 join at different times; one of
// them reads nothing until the writers are done, far behind a small ring.
// Once the writers stop, every subscriber's view is exactly what the index
// holds.
func TestReplayUnderConcurrency(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{Buffer: 1024})
	for ns := uint32(1); ns <= 3; ns++ {
		h.SetHashLen(ns, 32)
	}
	const writers, opsEach = 4, 10000
	var ops atomic.Int64
	var wwg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wwg.Add(1)
		go func(w int) {
			defer wwg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 7))
			for n := 0; n < opsEach; n++ {
				ops.Add(1)
				ns := uint32(1 + r.IntN(3))
				switch op := r.IntN(1000); {
				case op < 995:
					set(ix, key(ns, uint64(r.IntN(1000))), index.Tiers(r.IntN(4)))
				case op < 999:
					cut := uint64(r.IntN(1000))
					ix.Range(func(k *index.Key, e *index.Entry) bool {
						if k.NS == ns && binary.BigEndian.Uint64(k.Hash[:]) < cut {
							e.CPU = index.NoSlot
						}
						return e.CPU != index.NoSlot || e.Disk != index.NoSlot
					})
				default:
					h.BeginReset([]uint32{ns})
					ix.Range(func(k *index.Key, e *index.Entry) bool { return k.NS != ns })
					h.EndReset([]uint32{ns})
				}
			}
		}(w)
	}
	type reader struct {
		sub *Sub
		v   *view
		err error
	}
	readers := make([]*reader, 3)
	var rwg sync.WaitGroup
	done := make(chan struct{})
	for i := range readers {
		// Join at different points of the workload.
		for ops.Load() < int64(i*writers*opsEach/4) {
			runtime.Gosched()
		}
		sub, err := h.Subscribe([]uint32{1}, true)
		if err != nil {
			t.Fatal(err)
		}
		rd := &reader{sub: sub, v: newView()}
		readers[i] = rd
		if i == 2 {
			// The slow one: takes its snapshot, then reads nothing
			// until the end.
			rd.v.until(t, sub, 0)
			continue
		}
		rwg.Add(1)
		go func() {
			defer rwg.Done()
			buf := make([]Event, 0, 64)
			for rd.err == nil {
				evs, err := rd.sub.Next(context.Background(), done, buf)
				if err != nil {
					return
				}
				rd.err = rd.v.apply(evs)
			}
		}()
	}
	wwg.Wait()
	last := h.LastSeq(1)
	close(done)
	rwg.Wait()
	for i, rd := range readers {
		if rd.err != nil {
			t.Fatalf("subscriber %d: %v", i, rd.err)
		}
		rd.v.until(t, rd.sub, last)
		rd.v.check(t, ix, 1)
		rd.sub.Close()
		t.Logf("subscriber %d: %d blocks, %d resets, %d losses", i, len(rd.v.held), rd.v.cleared, rd.v.lost)
	}
	if readers[2].v.lost == 0 {
		t.Fatal("the slow subscriber was never told it lost changes")
	}
}

func TestMaxSubscribers(t *testing.T) {
	h := New(index.New(), Config{MaxSubscribers: 2})
	a, _ := h.Subscribe(nil, false)
	b, _ := h.Subscribe(nil, false)
	if _, err := h.Subscribe(nil, false); err != ErrTooMany {
		t.Fatalf("third subscription: %v, want ErrTooMany", err)
	}
	a.Close()
	a.Close()
	c, err := h.Subscribe(nil, false)
	if err != nil {
		t.Fatal(err)
	}
	b.Close()
	c.Close()
	if h.Subscribers() != 0 {
		t.Fatalf("%d subscribers after closing all", h.Subscribers())
	}
}

// TestNoCostWithoutSubscribers: with nobody subscribed a change records
// nothing and allocates nothing.
func TestNoCostWithoutSubscribers(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{})
	sub, _ := h.Subscribe(nil, false)
	sub.Close()
	k := key(1, 1)
	toCPU := func(e *index.Entry, _ bool) bool { e.State, e.CPU, e.Disk = index.Ready, 1, index.NoSlot; return true }
	toDisk := func(e *index.Entry, _ bool) bool { e.CPU, e.Disk = index.NoSlot, 1; return true }
	drop := func(*index.Entry, bool) bool { return false }
	allocs := testing.AllocsPerRun(1000, func() {
		ix.Mutate(&k, toCPU)
		ix.Mutate(&k, toDisk)
		ix.Mutate(&k, drop)
	})
	if allocs != 0 || h.Seq() != 0 {
		t.Fatalf("%v allocations per change, %d changes recorded; want none", allocs, h.Seq())
	}
}

// TestStop: Next returns when the service stops.
func TestStop(t *testing.T) {
	h := New(index.New(), Config{})
	sub, _ := h.Subscribe(nil, false)
	defer sub.Close()
	stop := make(chan struct{})
	close(stop)
	if _, err := sub.Next(context.Background(), stop, nil); err != ErrStopped {
		t.Fatalf("Next after stop: %v", err)
	}
}

// TestEachSubscriberWoken: MaxSubscribers subscriptions, each following
// its own namespace among 64 (one follows all), wait in Next; a change of
// each namespace wakes its subscriber with that change, also after every
// subscription closed once and the hub's fan-out goroutine started again.
// With subscribers following 64 namespaces each, the data path only
// writes the ring and hands the goroutine a notice (BenchmarkChange/64x64).
func TestEachSubscriberWoken(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{})
	for round := range 2 {
		subs := make([]*Sub, DefaultMaxSubscribers)
		for i := range subs {
			nss := make([]uint32, 64)
			for j := range nss {
				nss[j] = uint32(100*i + j)
			}
			if i == 0 {
				nss = nil
			}
			var err error
			if subs[i], err = h.Subscribe(nss, false); err != nil {
				t.Fatal(err)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		got := make([][]Event, len(subs))
		var wg sync.WaitGroup
		for i, s := range subs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil && (len(got[i]) == 0 || got[i][len(got[i])-1].Kind != Stored) {
					evs, err := s.Next(ctx, nil, nil)
					if err != nil {
						return
					}
					got[i] = append(got[i], evs...)
				}
			}()
		}
		// Each namespace 100*i+63 is followed by subscriber i alone (and
		// by subscriber 0, which follows every one).
		for i := 1; i < len(subs); i++ {
			set(ix, key(uint32(100*i+63), uint64(round)), index.InCPU)
		}
		set(ix, key(7, uint64(round)), index.InCPU)
		wg.Wait()
		cancel()
		for i := 1; i < len(subs); i++ {
			var stored []Event
			for _, e := range got[i] {
				if e.Kind == Stored {
					stored = append(stored, e)
				}
			}
			if len(stored) != 1 || stored[0].Key != key(uint32(100*i+63), uint64(round)) {
				t.Fatalf("round %d: subscriber %d got %+v, want the one change of namespace %d", round, i, got[i], 100*i+63)
			}
		}
		if len(got[0]) == 0 {
			t.Fatalf("round %d: the subscriber of every namespace was never woken", round)
		}
		for _, s := range subs {
			s.Close()
		}
	}
}

// TestRemoteChanges: what the caller says of the remote tier reaches the
// namespace's subscribers as Remote changes in the order recorded, beside
// the index's tiers; it is in no snapshot, says nothing during a reset or
// of a namespace the hub does not know, and costs nothing unsubscribed.
func TestRemoteChanges(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{})
	h.SetHashLen(1, 16)
	k := key(1, 5)
	h.RemoteChanged(&k, true) // nobody subscribed: nothing recorded
	if h.Seq() != 0 {
		t.Fatalf("seq %d with no subscriber", h.Seq())
	}
	set(ix, k, index.InCPU)
	sub, err := h.Subscribe([]uint32{1}, true)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	v := newView()
	v.until(t, sub, 0)
	if v.held[k] != index.InCPU {
		t.Fatalf("snapshot: %v, want the CPU tier only", v.held[k])
	}
	other := key(9, 1) // a namespace never named
	h.RemoteChanged(&other, true)
	h.RemoteChanged(&k, true)
	set(ix, k, 0)
	h.RemoteChanged(&k, false)
	h.RemoteChanged(&k, true)
	v.until(t, sub, h.Seq())
	if v.held[k] != Remote {
		t.Fatalf("after stored, CPU gone, removed and stored again: %v, want the remote tier only", v.held[k])
	}
	h.BeginReset([]uint32{1})
	h.RemoteChanged(&k, true)
	h.EndReset([]uint32{1})
	v.until(t, sub, h.Seq())
	if v.cleared != 2 || len(v.held) != 0 {
		t.Fatalf("after a reset: %d resets, %v; want 2 and nothing (a remote fact is in no snapshot)", v.cleared, v.held)
	}
	for _, tc := range []struct {
		t                index.Tiers
		medium, locality string
	}{{index.InCPU, "CPU", "LOCAL"}, {index.InDisk, "STORAGE", "LOCAL"}, {Remote, "STORAGE", "REMOTE"}} {
		if m, l := Medium(tc.t); m != tc.medium || l != tc.locality {
			t.Errorf("tier %d: %s/%s, want %s/%s", tc.t, m, l, tc.medium, tc.locality)
		}
	}
}
