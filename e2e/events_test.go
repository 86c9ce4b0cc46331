package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/kvoffloadd/kvoffloadd/events"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// watcher is a router's view of one WatchEvents stream: every block's
// tiers (pb.Tier is a bit set: CPU 1, DISK 2), built from the events alone.
type watcher struct {
	t        *testing.T
	d        *testenv.Daemon
	st       pb.KVOffload_WatchEventsClient
	held     map[string]pb.Tier
	log      []*pb.KVEvent // since the last take
	lost     int
	cleared  int
	caughtUp uint64
	synced   bool
	lastSeq  uint64
}

func blockName(ns, group uint32, hash []byte) string {
	return fmt.Sprintf("%d/%d/%x", ns, group, hash)
}

func watch(t *testing.T, d *testenv.Daemon, c *client.Client, ns ...uint32) *watcher {
	t.Helper()
	st, err := c.API.WatchEvents(ctx(t), &pb.WatchEventsRequest{NamespaceIds: ns})
	if err != nil {
		t.Fatal(err)
	}
	return &watcher{t: t, d: d, st: st, held: map[string]pb.Tier{}}
}

// recv reads one reply and applies it.
func (w *watcher) recv() {
	w.t.Helper()
	r, err := w.st.Recv()
	if err != nil {
		w.t.Fatalf("event stream: %v", err)
	}
	for _, e := range r.Events {
		if e.Seq < w.lastSeq {
			w.t.Fatalf("seq went back from %d to %d: %v", w.lastSeq, e.Seq, e)
		}
		w.lastSeq = e.Seq
		w.log = append(w.log, e)
		name := blockName(e.NamespaceId, e.Group, e.Hash)
		switch e.Kind {
		case pb.EventKind_EVENT_KIND_BLOCK_STORED:
			if e.Tier != pb.Tier_TIER_CPU && e.Tier != pb.Tier_TIER_DISK {
				w.t.Fatalf("stored in tier %v", e.Tier)
			}
			w.held[name] |= e.Tier
		case pb.EventKind_EVENT_KIND_BLOCK_REMOVED:
			if w.held[name]&e.Tier == 0 && w.synced {
				w.t.Fatalf("removed from %v, but the events never said it was there: %v", e.Tier, e)
			}
			if w.held[name] &^= e.Tier; w.held[name] == 0 {
				delete(w.held, name)
			}
		case pb.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED:
			w.held = map[string]pb.Tier{}
			w.cleared++
			w.synced = false
		case pb.EventKind_EVENT_KIND_EVENTS_LOST:
			w.lost++
		case pb.EventKind_EVENT_KIND_CAUGHT_UP:
			w.caughtUp, w.synced = e.Seq, true
		default:
			w.t.Fatalf("unknown event %v", e)
		}
	}
}

// sync reads until every change of namespace ns made so far has arrived.
func (w *watcher) sync(ns uint32) {
	w.t.Helper()
	last := w.d.Svc.Events().LastSeq(ns)
	for !w.synced || w.caughtUp < last {
		w.recv()
	}
}

// take returns the events since the last take.
func (w *watcher) take() []*pb.KVEvent {
	l := w.log
	w.log = nil
	return l
}

// check compares the view with a Lookup of every key in hs: the events
// reproduce exactly what the daemon holds, and nothing else.
func (w *watcher) check(e *engine, hs [][]byte) {
	w.t.Helper()
	ns := e.reg.NamespaceId
	inView := 0
	for name := range w.held {
		var n uint32
		fmt.Sscanf(name, "%d/", &n)
		if n == ns {
			inView++
		}
	}
	held := 0
	for _, h := range hs {
		lr := e.lookup(w.t, [][]byte{h})
		var want pb.Tier
		if lr.Ready == 1 {
			want = lr.Tiers[0]
			held++
		}
		if got := w.held[blockName(ns, 0, h)]; got != want {
			w.t.Fatalf("block %x: the events say %v, Lookup says %v", h[:8], got, want)
		}
	}
	if inView != held {
		t := w.t
		t.Fatalf("the events name %d blocks of namespace %d, Lookup finds %d of the keys stored", inView, ns, held)
	}
}

func kinds(evs []*pb.KVEvent) map[pb.EventKind]int {
	n := map[pb.EventKind]int{}
	for _, e := range evs {
		n[e.Kind]++
	}
	return n
}

// TestEventsFollowTheTiers: a store makes BLOCK_STORED (CPU) appear;
// demotion makes DISK appear and CPU go; evictions from both tiers and an
// invalidation make BLOCK_REMOVED; a whole-namespace invalidation is one
// reset. Two subscribers (one of the namespace, one of everything) each see
// it all, and their views equal a Lookup of every key after every step.
func TestEventsFollowTheTiers(t *testing.T) {
	o := diskOpts(t.TempDir())
	o.DiskBytes = 16 << 20 // about 60 slots behind 32 CPU slots
	d := testenv.Start(t, o)
	e := register(t, d, small, "events")
	ns := e.reg.NamespaceId
	w := watch(t, d, d.Client(t), ns)
	all := watch(t, d, d.Client(t))
	for _, x := range []*watcher{w, all} {
		x.sync(ns)
		if ev := x.take(); len(ev) != 2 || ev[0].Kind != pb.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED || ev[1].Kind != pb.EventKind_EVENT_KIND_CAUGHT_UP {
			t.Fatalf("a new stream begins with %v; want a reset and caught up", ev)
		}
	}

	// A store: one BLOCK_STORED in the CPU tier per block.
	first := e.hashes(1, 4)
	if res := e.store(t, 1, first, seq(0, 4)); !res.Ok {
		t.Fatalf("store: %+v", res)
	}
	w.sync(ns)
	got := map[string]bool{}
	for _, ev := range w.take() {
		if ev.Kind == pb.EventKind_EVENT_KIND_CAUGHT_UP {
			continue
		}
		if ev.Kind != pb.EventKind_EVENT_KIND_BLOCK_STORED || ev.Tier != pb.Tier_TIER_CPU || ev.NamespaceId != ns || ev.Group != 0 {
			t.Fatalf("after a store into an empty CPU tier: %v", ev)
		}
		got[string(ev.Hash)] = true
	}
	for _, h := range first {
		if !got[string(h)] {
			t.Fatalf("no BLOCK_STORED for %x", h[:8])
		}
	}
	if len(got) != len(first) {
		t.Fatalf("%d blocks stored, %d named", len(first), len(got))
	}
	w.check(e, first)

	// Four times the CPU tier, more than both tiers hold: demotions, and
	// evictions from the disk tier.
	stored := append(first, storeMany(t, e, 2, 128)...)
	flush(t, d)
	w.sync(ns)
	demoted, diskEvicted := 0, 0
	seen := map[string][]*pb.KVEvent{}
	for _, ev := range w.take() {
		seen[string(ev.Hash)] = append(seen[string(ev.Hash)], ev)
	}
	for _, evs := range seen {
		for i := 1; i < len(evs); i++ {
			a, b := evs[i-1], evs[i]
			if a.Kind == pb.EventKind_EVENT_KIND_BLOCK_STORED && a.Tier == pb.Tier_TIER_DISK && b.Kind == pb.EventKind_EVENT_KIND_BLOCK_REMOVED && b.Tier == pb.Tier_TIER_CPU {
				demoted++
			}
			if b.Kind == pb.EventKind_EVENT_KIND_BLOCK_REMOVED && b.Tier == pb.Tier_TIER_DISK {
				diskEvicted++
			}
		}
	}
	if demoted == 0 || diskEvicted == 0 {
		t.Fatalf("%d demotions (DISK stored, then CPU removed) and %d disk evictions seen; want some of each", demoted, diskEvicted)
	}
	w.check(e, stored)

	// Invalidating keys removes them from every tier that held them.
	var some [][]byte
	for _, h := range stored {
		if w.held[blockName(ns, 0, h)] != 0 && len(some) < 4 {
			some = append(some, h)
		}
	}
	if _, err := e.c.API.Invalidate(ctx(t), &pb.InvalidateRequest{NamespaceIds: []uint32{ns}, Keys: testenv.Keys(some...)}); err != nil {
		t.Fatal(err)
	}
	w.sync(ns)
	for _, ev := range w.take() {
		if ev.Kind == pb.EventKind_EVENT_KIND_BLOCK_REMOVED {
			continue
		}
		if ev.Kind != pb.EventKind_EVENT_KIND_CAUGHT_UP {
			t.Fatalf("after an invalidation: %v", ev)
		}
	}
	for _, h := range some {
		if w.held[blockName(ns, 0, h)] != 0 {
			t.Fatalf("block %x invalidated, still held in the view", h[:8])
		}
	}
	w.check(e, stored)
	all.sync(ns)
	if len(all.held) != len(w.held) {
		t.Fatalf("the subscriber of every namespace holds %d blocks, the namespace's %d", len(all.held), len(w.held))
	}
	all.check(e, stored)

	// A whole namespace: one reset, no removal per block.
	if _, err := e.c.API.Invalidate(ctx(t), &pb.InvalidateRequest{NamespaceIds: []uint32{ns}}); err != nil {
		t.Fatal(err)
	}
	w.sync(ns)
	if k := kinds(w.take()); k[pb.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED] != 1 || k[pb.EventKind_EVENT_KIND_BLOCK_REMOVED] != 0 {
		t.Fatalf("a whole-namespace invalidation sent %v; want one reset and no removals", k)
	}
	w.check(e, stored)
	all.sync(ns)
	all.check(e, stored)
}

// TestEventsAcrossRestart: after a restart a stream begins with a reset,
// then the blocks the disk tier's recovery brings back (DISK); a read that
// finds a block corrupt on disk removes it; a shutdown ends the stream
// with UNAVAILABLE.
func TestEventsAcrossRestart(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	o.WriteThrough = true
	d := testenv.Start(t, o)
	e := register(t, d, small, "events-restart")
	stored := storeMany(t, e, 3, 8)
	flush(t, d)
	w := watch(t, d, d.Client(t), e.reg.NamespaceId)
	w.sync(e.reg.NamespaceId)
	w.check(e, stored)
	d.Stop(t)
	if _, err := w.st.Recv(); codeOf(err) != codes.Unavailable {
		t.Fatalf("the stream at shutdown: %v, want UNAVAILABLE", err)
	}

	o.Recovering = true
	d2 := testenv.Start(t, o)
	e2 := register(t, d2, small, "events-restart")
	ns := e2.reg.NamespaceId
	w2 := watch(t, d2, d2.Client(t), ns)
	<-d2.Svc.DiskRecovered()
	w2.sync(ns)
	if ev := w2.take(); ev[0].Kind != pb.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED {
		t.Fatalf("the stream after a restart begins with %v, want a reset", ev[0])
	}
	for _, h := range stored {
		if tier := w2.held[blockName(ns, 0, h)]; tier != pb.Tier_TIER_DISK {
			t.Fatalf("block %x after the restart: the events say %v, want DISK", h[:8], tier)
		}
	}
	w2.check(e2, stored)

	// Corrupt the second slot's payload under the running daemon: the read
	// that finds it removes the block from the disk tier.
	f, err := os.OpenFile(filepath.Join(dir, "kvoffload-0.slots"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	at := int64(256<<10+4096) + 4096 + 777
	f.ReadAt(b, at)
	b[0] ^= 0x01
	f.WriteAt(b, at)
	f.Close()
	var corrupt []byte
	for i := 0; i < len(stored); i += 4 {
		part := stored[i:min(i+4, len(stored))]
		res := e2.load(t, uint64(10+i), part, seq(40, len(part)))
		for _, fl := range res.Failures {
			if fl.Status != pb.BlockStatus_BLOCK_STATUS_CORRUPT || corrupt != nil {
				t.Fatalf("load: %+v", res)
			}
			corrupt = fl.Hash
		}
		flush(t, d2)
	}
	if corrupt == nil {
		t.Fatal("no load found the corrupted block")
	}
	w2.sync(ns)
	removed := false
	for _, ev := range w2.take() {
		if string(ev.Hash) == string(corrupt) && ev.Kind == pb.EventKind_EVENT_KIND_BLOCK_REMOVED && ev.Tier == pb.Tier_TIER_DISK {
			removed = true
		}
	}
	if !removed || w2.held[blockName(ns, 0, corrupt)] != 0 {
		t.Fatalf("the block that failed its read: removed %v, held %v", removed, w2.held[blockName(ns, 0, corrupt)])
	}
	w2.check(e2, stored)
}

// TestSlowEventSubscriberIsTold: a subscriber that stops reading falls
// behind the daemon's bounded buffer; when it reads again it is told its
// events were lost, gets a reset and a snapshot, and its view is exact.
// Subscriptions are bounded, and name known namespaces.
func TestSlowEventSubscriberIsTold(t *testing.T) {
	d := testenv.Start(t, testenv.Options{CPUBytes: 8 << 20, ChunkBytes: 4 << 20, Quiet: true,
		Events: events.Config{Buffer: 256, MaxSubscribers: 2}})
	tiny := testenv.Model{Layers: 1, SegBytes: 4 << 10, Blocks: 64}
	e := register(t, d, tiny, "slow")
	ns := e.reg.NamespaceId
	// A fixed flow-control window: what the daemon can send before the
	// subscriber reads is bounded (64 KiB, about 1400 events).
	c, err := client.Dial(d.Socket, grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	w := watch(t, d, c, ns)
	w.sync(ns)

	other := watch(t, d, d.Client(t), ns+100)
	if _, err := other.st.Recv(); codeOf(err) != codes.InvalidArgument {
		t.Fatalf("a stream of an unknown namespace: %v, want INVALID_ARGUMENT", err)
	}
	second := watch(t, d, d.Client(t), ns)
	second.sync(ns)
	third := watch(t, d, d.Client(t))
	if _, err := third.st.Recv(); codeOf(err) != codes.ResourceExhausted {
		t.Fatalf("a stream past the bound: %v, want RESOURCE_EXHAUSTED", err)
	}

	// 64 rounds of storing 64 blocks and invalidating them: 8192 changes.
	var last [][]byte
	for r := 0; r < 64; r++ {
		hs := e.hashes(uint64(100+r), 64)
		if res := e.store(t, uint64(r+1), hs, seq(0, 64)); !res.Ok {
			t.Fatalf("store: %+v", res)
		}
		if r < 63 {
			if _, err := e.c.API.Invalidate(ctx(t), &pb.InvalidateRequest{NamespaceIds: []uint32{ns}, Keys: testenv.Keys(hs...)}); err != nil {
				t.Fatal(err)
			}
		}
		last = hs
	}
	w.sync(ns)
	if w.lost == 0 || w.cleared < 2 {
		t.Fatalf("a subscriber far behind: told of %d losses, %d resets; want a loss and a reset", w.lost, w.cleared)
	}
	if n := metric(t, d, "kvoffload_events_lost_total"); n < float64(w.lost) {
		t.Fatalf("kvoffload_events_lost_total %v, the subscriber was told of %d losses", n, w.lost)
	}
	if n := metric(t, d, "kvoffload_event_subscribers"); n != 2 {
		t.Fatalf("kvoffload_event_subscribers %v with two streams open", n)
	}
	w.check(e, last)
	if len(w.held) != len(last) {
		t.Fatalf("the view holds %d blocks, want %d", len(w.held), len(last))
	}
	second.sync(ns)
	second.check(e, last)
}
