package events

import (
	"context"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// TestSnapshotMemoryPerBlock: reading a snapshot of many blocks allocates
// next to nothing per block (the subscription reuses one chunk's buffer):
// its memory does not grow with the index; and each reply is full. Sending a chunk's events moved
// the buffer's start, and every next chunk allocated a new one (111 B a
// block).
func TestSnapshotMemoryPerBlock(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{})
	h.SetHashLen(1, 16)
	const n = 200000
	for i := uint64(0); i < n; i++ {
		set(ix, key(1, i), index.InCPU)
	}
	sub, err := h.Subscribe(nil, true)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	buf := make([]Event, 0, 1024)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	stored, replies := 0, 0
	for done := false; !done; replies++ {
		evs, err := sub.Next(context.Background(), nil, buf)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range evs {
			switch e.Kind {
			case Stored:
				stored++
			case CaughtUp:
				done = true
			}
		}
		buf = evs[:0]
	}
	runtime.ReadMemStats(&after)
	if stored != n {
		t.Fatalf("%d blocks in the snapshot, want %d", stored, n)
	}
	if per := float64(after.TotalAlloc-before.TotalAlloc) / n; per > 4 {
		t.Fatalf("%.1f bytes allocated per block of the snapshot, want next to none", per)
	}
	// Full replies, chunk after chunk (and the Cleared before them): a
	// reply per 64-record chunk cost a message and a wakeup each.
	if want := n/cap(buf) + 3; replies > want {
		t.Fatalf("the snapshot took %d replies of up to %d events, want at most %d", replies, cap(buf), want)
	}
}

// TestSnapshotDuringLookupsAndStores reads a snapshot of many blocks, as
// the WatchEvents handler does, while Lookups come (Demand, and reads of
// the index) and writers store, demote and remove blocks: the snapshot
// pauses for the Lookups (Paused grows), every block no writer touched is
// in it when its CaughtUp comes, and once the writers stop the view is
// the index's.
func TestSnapshotDuringLookupsAndStores(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{})
	h.SetHashLen(1, 16)
	const n, touched = 1 << 17, 1 << 14 // writers change keys [0, touched)
	for i := uint64(0); i < n; i++ {
		set(ix, key(1, i), index.InCPU)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 34))
			// Bounded: at most 200,000 changes each, far fewer than the
			// ring holds between two replies.
			for range 200000 {
				select {
				case <-stop:
					return
				default:
				}
				set(ix, key(1, uint64(r.IntN(touched))), index.Tiers(r.IntN(4)))
				if r.IntN(8) == 0 {
					runtime.Gosched()
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		r := rand.New(rand.NewPCG(9, 34))
		for {
			select {
			case <-stop:
				return
			default:
			}
			h.Demand()
			for range 16 {
				k := key(1, uint64(r.IntN(n)))
				ix.Get(&k)
			}
			runtime.Gosched()
		}
	}()
	defer func() {
		close(stop)
		wg.Wait()
	}()
	sub, err := h.Subscribe([]uint32{1}, true)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	v := newView()
	v.until(t, sub, 0)
	for i := uint64(touched); i < n; i++ {
		if v.held[key(1, i)] != index.InCPU {
			t.Fatalf("block %d, untouched, is %b in the snapshot", i, v.held[key(1, i)])
		}
	}
	if h.Paused() == 0 {
		t.Fatal("the snapshot never paused for the Lookups")
	}
	close(stop)
	wg.Wait()
	stop = make(chan struct{}) // for the deferred close
	v.until(t, sub, h.LastSeq(1))
	v.check(t, ix, 1)
	t.Logf("%d blocks held, %d resets, %d losses; the snapshot paused %v", len(v.held), v.cleared, v.lost, h.Paused())
}

// TestSnapshotStaysPacedAfterALookup: one Lookup (Demand) keeps a snapshot
// paced for snapBusyFor, reply after reply (each at most snapBusyReply
// events, each after a pause), not only for the reply after it; once
// snapBusyFor passes with no Lookup, replies are full again and nothing
// pauses. The pace used to look only at the Lookups since the last reply:
// replies come far oftener than an engine's Lookups, and most ran at full
// speed.
func TestSnapshotStaysPacedAfterALookup(t *testing.T) {
	old := snapBusyFor
	snapBusyFor = time.Minute // the window itself, not the machine's speed, is under test
	defer func() { snapBusyFor = old }()
	ix := index.New()
	h := New(ix, Config{})
	h.SetHashLen(1, 16)
	const n = 1 << 14
	for i := uint64(0); i < n; i++ {
		set(ix, key(1, i), index.InCPU)
	}
	h.Demand() // before the subscription: not a Lookup it has to give way to
	sub, err := h.Subscribe(nil, true)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	buf := make([]Event, 0, 1024)
	next := func() []Event {
		t.Helper()
		evs, err := sub.Next(context.Background(), nil, buf)
		if err != nil {
			t.Fatal(err)
		}
		buf = evs[:0]
		return evs
	}
	next() // the Cleared that starts the snapshot
	if evs := next(); len(evs) != cap(buf) {
		t.Fatalf("a reply of %d events with no Lookup since the subscription, want a full %d", len(evs), cap(buf))
	}
	h.Demand() // one Lookup, and no other
	for i := range 6 {
		paused := h.Paused()
		if evs := next(); len(evs) > snapBusyReply {
			t.Fatalf("reply %d after a Lookup holds %d events, want at most %d", i, len(evs), snapBusyReply)
		}
		if i > 0 && h.Paused() == paused {
			t.Fatalf("reply %d after a Lookup came without a pause", i)
		}
	}
	snapBusyFor = 30 * time.Millisecond
	time.Sleep(2 * snapBusyFor)
	paused := h.Paused()
	if evs := next(); len(evs) != cap(buf) {
		t.Fatalf("a reply of %d events %v after the last Lookup, want a full %d", len(evs), 2*snapBusyFor, cap(buf))
	}
	if h.Paused() != paused {
		t.Fatal("the snapshot paused with no Lookup in its window")
	}
}
