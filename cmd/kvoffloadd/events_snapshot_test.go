package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// TestWatchSnapshotRacingStores reads a WatchEvents snapshot of a nearly
// full CPU tier one small reply at a time, storing blocks (which fill the
// tier, then evict older ones) and invalidating some between replies, so the index changes all
// along the snapshot, which the daemon walks a chunk of records at a time
// with the shard's lock released between chunks. The view (snapshot, then
// live changes) must equal a Lookup of every key ever stored. Lookups
// between replies make the snapshot pause (pace) along the way.
func TestWatchSnapshotRacingStores(t *testing.T) {
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	_, c, _ := startDaemon(t, bin, "--socket", sock, "--metrics-addr", metrics, "--cpu-bytes", "64MiB", "--cpu-chunk-bytes", "4MiB")
	m := testenv.Model{Layers: 1, SegBytes: 4096, Blocks: 256, HashBytes: 16}
	region := testenv.NewRegion(t, m.RegionBytes())
	ctx := context.Background()
	reg, err := c.Register(ctx, []byte("snapshot-race"), m.Layout(), m.Regions(region), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	var all [][]byte
	nextKey, nextID := 0, uint64(1)
	store := func(n int) [][]byte {
		t.Helper()
		hs := make([][]byte, n)
		for i := range hs {
			h := make([]byte, 16)
			binary.LittleEndian.PutUint64(h, uint64(nextKey)+1)
			binary.LittleEndian.PutUint64(h[8:], uint64(nextKey)*0x9e3779b97f4a7c15)
			hs[i] = h
			nextKey++
		}
		if _, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(nextID, hs, seqIDs(n))}, true); err != nil {
			t.Fatal(err)
		}
		nextID++
		all = append(all, hs...)
		return hs
	}
	// Nearly fill the tier (16384 slots of 4 KiB, some 250 blocks a
	// shard of the index: several chunks each): the stores during the
	// snapshot evict some of these blocks, most stay to the end (so a
	// block the snapshot missed would still be missed at the end).
	for range 59 {
		store(256)
	}

	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := c.API.WatchEvents(wctx, &pb.WatchEventsRequest{NamespaceIds: []uint32{reg.NamespaceId}, MaxEvents: 32})
	if err != nil {
		t.Fatal(err)
	}
	held := map[string]pb.Tier{}
	caughtUp := false
	// recv applies one reply and reports whether it ended with CAUGHT_UP.
	recv := func() bool {
		t.Helper()
		resp, err := w.Recv()
		if err != nil {
			t.Fatal(err)
		}
		up := false
		for _, e := range resp.Events {
			up = false
			switch e.Kind {
			case pb.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED:
				held = map[string]pb.Tier{}
			case pb.EventKind_EVENT_KIND_BLOCK_STORED:
				held[string(e.Hash)] |= e.Tier
			case pb.EventKind_EVENT_KIND_BLOCK_REMOVED:
				if held[string(e.Hash)] &^= e.Tier; held[string(e.Hash)] == 0 {
					delete(held, string(e.Hash))
				}
			case pb.EventKind_EVENT_KIND_EVENTS_LOST:
				t.Fatal("EVENTS_LOST: the test reads between every change")
			case pb.EventKind_EVENT_KIND_CAUGHT_UP:
				up = true
			}
		}
		return up
	}
	rounds := 0
	for !caughtUp {
		if rounds == 100000 {
			t.Fatal("no CAUGHT_UP after 100000 replies")
		}
		caughtUp = recv()
		hs := store(4)
		// An engine's Lookup: the snapshot paces itself meanwhile.
		if _, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, testenv.Keys(hs...), 0); err != nil {
			t.Fatal(err)
		}
		if rounds%2 == 0 {
			// Invalidate a block stored just now and an older one.
			old := all[(rounds*37)%len(all)]
			if _, err := c.API.Invalidate(ctx, &pb.InvalidateRequest{NamespaceIds: []uint32{reg.NamespaceId}, Keys: testenv.Keys(hs[0], old)}); err != nil {
				t.Fatal(err)
			}
		}
		rounds++
	}
	if rounds < 100 {
		t.Fatalf("the snapshot took %d replies: too few for stores to race it", rounds)
	}
	if p := metric(t, scrape(t, metrics), "kvoffload_event_snapshot_paused_seconds_total"); p <= 0 {
		t.Fatalf("kvoffload_event_snapshot_paused_seconds_total %v: the snapshot never paused for the Lookups", p)
	}
	// Live: a store's events come once it is done, after every earlier
	// change's; read up to a sentinel block's, then to the CAUGHT_UP after
	// it, and compare (a store may still evict after its own event: then
	// once more, bounded).
	for try := 0; ; try++ {
		if try == 10 {
			t.Fatal("the view never equalled a Lookup of every block")
		}
		sentinel := store(1)[0]
		for held[string(sentinel)] == 0 {
			recv()
		}
		for !recv() {
		}
		if diff := compareWithLookup(t, c, reg.NamespaceId, all, held); diff == "" {
			break
		} else {
			t.Logf("try %d: %s", try, diff)
		}
	}
	t.Logf("%d replies of the snapshot raced %d stores; %d blocks held of %d stored", rounds, rounds, len(held), len(all))
}

// compareWithLookup says how the view differs from a Lookup of every key
// ("" if it does not).
func compareWithLookup(t *testing.T, c *client.Client, ns uint32, all [][]byte, held map[string]pb.Tier) string {
	t.Helper()
	n := 0
	for _, h := range all {
		lr, err := c.Lookup(context.Background(), []uint32{ns}, testenv.Keys(h), 0)
		if err != nil {
			t.Fatal(err)
		}
		var want pb.Tier
		if lr.Ready == 1 {
			want = lr.Tiers[0]
			n++
		}
		if held[string(h)] != want {
			return fmt.Sprintf("block %x: the events say %v, Lookup %v", h[:8], held[string(h)], want)
		}
	}
	if n != len(held) || n < 12000 {
		return fmt.Sprintf("the view holds %d blocks, Lookup finds %d of %d stored", len(held), n, len(all))
	}
	return ""
}
