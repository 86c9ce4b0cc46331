package main

import (
	"context"
	"encoding/hex"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// TestEventsZMQRemote runs the daemon with a real Redis Cluster as its
// remote tier and --events-zmq, read by the two Python decoders: once the
// cluster acknowledges this node's publish of a block, the stream says
// BlockStored STORAGE/REMOTE for it, in the engine's namespace_id; an
// Invalidate of the blocks says BlockRemoved STORAGE/REMOTE. WatchEvents,
// from the same hub, says TIER_REMOTE.
func TestEventsZMQRemote(t *testing.T) {
	if err := rediscluster.Available(); err != nil && !rediscluster.Required() {
		t.Skip(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rc, err := rediscluster.Start(ctx, rediscluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	for _, tc := range []struct{ decoder, format, hashes string }{
		{"vllm_schema_sub.py", "map", "int"}, {"kv_events_sub.py", "array", "bytes"},
	} {
		t.Run(tc.decoder+"-"+tc.format+"-"+tc.hashes, func(t *testing.T) {
			testEventsZMQRemote(t, ctx, rc, tc.decoder, tc.format, tc.hashes)
		})
	}
}

func testEventsZMQRemote(t *testing.T, ctx context.Context, rc *rediscluster.Cluster, decoder, format, hashes string) {
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	endpoint := "tcp://" + freePort(t)
	const topic = "kv@pod@model"
	_, c, _ := startDaemon(t, bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "16MiB",
		"--remote-redis", rc.Addrs()[0],
		"--events-zmq", endpoint, "--events-zmq-topic", topic, "--events-zmq-format", format, "--events-zmq-hashes", hashes,
		"--events-zmq-block-size", "16")
	next := startDecoder(t, decoder, endpoint, topic, format, hashes, "16")

	m := testenv.Model{Layers: 2, SegBytes: 16 << 10, Blocks: 32, HashBytes: 16}
	region := testenv.NewRegion(t, m.RegionBytes())
	// A fingerprint per subtest: the two daemons share the cluster.
	reg, err := c.Register(ctx, []byte("zmq-remote-"+decoder), m.Layout(), m.Regions(region), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	watch, err := c.API.WatchEvents(ctx, &pb.WatchEventsRequest{NamespaceIds: []uint32{reg.NamespaceId}})
	if err != nil {
		t.Fatal(err)
	}
	awaitCaughtUp(t, watch)
	nextID := uint64(1)
	store := func(hs [][]byte) {
		t.Helper()
		for i, h := range hs {
			m.Fill(region, i, h)
		}
		res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(nextID, hs, seqIDs(len(hs)))}, true)
		if err != nil {
			t.Fatal(err)
		}
		nextID++
		if !res[0].Ok {
			t.Fatalf("store: %+v", res[0])
		}
	}
	name := func(h []byte) string {
		if hashes == "int" {
			return hex.EncodeToString(h[len(h)-8:])
		}
		return hex.EncodeToString(h)
	}
	// remote is the view of the remote tier the stream gives, by hash.
	remoteHeld := map[string]bool{}
	apply := func(e zmqEvent) {
		t.Helper()
		if e.Type == "AllBlocksCleared" {
			clear(remoteHeld)
			return
		}
		if e.Medium != "STORAGE" || e.Locality != "REMOTE" {
			return
		}
		if e.Namespace != int64(reg.NamespaceId) {
			t.Fatalf("%s %v of the remote tier: namespace %d, want %d", e.Type, e.Hashes, e.Namespace, reg.NamespaceId)
		}
		for _, h := range e.Hashes {
			remoteHeld[h] = e.Type == "BlockStored"
		}
	}
	// until reads events until cond holds of the remote view.
	until := func(what string, cond func() bool) {
		t.Helper()
		for !cond() {
			e, ok := next(30 * time.Second)
			if !ok {
				t.Fatalf("no event: %s", what)
			}
			apply(e)
		}
	}
	// A ZeroMQ subscription takes effect some time after the connect:
	// store probe blocks until the decoder sees an event.
	for i := 0; ; i++ {
		if i == 300 {
			t.Fatal("the decoder never received an event")
		}
		store([][]byte{m.Hash(99, i)})
		if e, ok := next(100 * time.Millisecond); ok {
			apply(e)
			break
		}
	}

	hs := make([][]byte, 6)
	for i := range hs {
		hs[i] = m.Hash(7, i)
	}
	store(hs)
	all := func(stored bool) func() bool {
		return func() bool {
			for _, h := range hs {
				if held, ok := remoteHeld[name(h)]; !ok || held != stored {
					return false
				}
			}
			return true
		}
	}
	until("BlockStored STORAGE/REMOTE for every published block", all(true))
	// Reported once the cluster acknowledged it: another node that runs
	// the same engine identity finds every block there now.
	sockB := filepath.Join(t.TempDir(), "b.sock")
	_, cb, _ := startDaemon(t, bin, "--socket", sockB, "--metrics-addr", "", "--cpu-bytes", "16MiB", "--remote-redis", rc.Addrs()[0])
	regionB := testenv.NewRegion(t, m.RegionBytes())
	regB, err := cb.Register(ctx, []byte("zmq-remote-"+decoder), m.Layout(), m.Regions(regionB), t.Name()+"-b")
	if err != nil {
		t.Fatal(err)
	}
	lookupB := func(hs [][]byte) *pb.LookupResponse {
		t.Helper()
		lr, err := cb.Lookup(ctx, []uint32{regB.NamespaceId}, testenv.Keys(hs...), 0)
		if err != nil {
			t.Fatal(err)
		}
		return lr
	}
	if lr := lookupB(hs); lr.Ready != uint32(len(hs)) || lr.Tiers[0] != pb.Tier_TIER_REMOTE {
		t.Fatalf("the stream says %d blocks are in the remote tier; the other node's Lookup: %+v", len(hs), lr)
	}
	if _, err := c.API.Invalidate(ctx, &pb.InvalidateRequest{NamespaceIds: []uint32{reg.NamespaceId}, Keys: testenv.Keys(hs...)}); err != nil {
		t.Fatal(err)
	}
	until("BlockRemoved STORAGE/REMOTE for every invalidated block", all(false))

	// WatchEvents shares the hub: the same facts, as TIER_REMOTE.
	state := map[string]int{} // 1: stored, 2: then removed
	for removed := 0; removed < len(hs); {
		r, err := watch.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range r.Events {
			if e.Tier != pb.Tier_TIER_REMOTE || !contains(hs, e.Hash) {
				continue // a probe
			}
			if e.NamespaceId != reg.NamespaceId {
				t.Fatalf("WatchEvents: a remote event of namespace %d, want %d", e.NamespaceId, reg.NamespaceId)
			}
			switch h := string(e.Hash); {
			case e.Kind == pb.EventKind_EVENT_KIND_BLOCK_STORED && state[h] == 0:
				state[h] = 1
			case e.Kind == pb.EventKind_EVENT_KIND_BLOCK_REMOVED && state[h] == 1:
				state[h] = 2
				removed++
			default:
				t.Fatalf("WatchEvents: %v TIER_REMOTE for %x after state %d", e.Kind, e.Hash[:8], state[h])
			}
		}
	}

	// A load on the other node that finds a value gone or corrupt says
	// so on that node's stream: BlockRemoved TIER_REMOTE.
	watchB, err := cb.API.WatchEvents(ctx, &pb.WatchEventsRequest{NamespaceIds: []uint32{regB.NamespaceId}})
	if err != nil {
		t.Fatal(err)
	}
	// The call returns before the daemon has subscribed the stream; its
	// snapshot (CAUGHT_UP at its end) says it has. A remote change is in
	// no snapshot: one made before would never reach this stream (under
	// load the load below settled first, and the test waited for events
	// that were never the stream's).
	awaitCaughtUp(t, watchB)
	hs2 := [][]byte{m.Hash(8, 0), m.Hash(8, 1)}
	store(hs2)
	until("BlockStored STORAGE/REMOTE for the blocks to lose", func() bool { return remoteHeld[name(hs2[0])] && remoteHeld[name(hs2[1])] })
	if lr := lookupB(hs2); lr.Ready != 2 || lr.Tiers[0] != pb.Tier_TIER_REMOTE {
		t.Fatalf("the other node's Lookup: %+v", lr)
	}
	// The cluster loses the first (deleted) and garbles the second.
	if n := garbleRemote(t, ctx, rc, hs2[0], hs2[1]); n < 2 {
		t.Fatalf("%d of the 2 values found in the cluster", n)
	}
	res, err := cb.Load(ctx, regB.RegistrationId, []*pb.Job{testenv.Job(1, hs2, []uint32{0, 1})}, true)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Ok || len(res[0].Failures) != 2 {
		t.Fatalf("load of lost and corrupt values: %+v", res[0])
	}
	statuses := map[pb.BlockStatus]bool{}
	for _, f := range res[0].Failures {
		statuses[f.Status] = true
	}
	if !statuses[pb.BlockStatus_BLOCK_STATUS_MISSING] || !statuses[pb.BlockStatus_BLOCK_STATUS_CORRUPT] {
		t.Fatalf("load of a lost and a corrupt value: %+v, want MISSING and CORRUPT", res[0].Failures)
	}
	gone := map[string]bool{}
	for len(gone) < 2 {
		r, err := watchB.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range r.Events {
			if e.Tier == pb.Tier_TIER_REMOTE {
				if e.Kind != pb.EventKind_EVENT_KIND_BLOCK_REMOVED || e.NamespaceId != regB.NamespaceId || !contains(hs2, e.Hash) {
					t.Fatalf("the loading node's stream: %v TIER_REMOTE of namespace %d, %x", e.Kind, e.NamespaceId, e.Hash)
				}
				gone[string(e.Hash)] = true
			}
		}
	}
}

// awaitCaughtUp reads a new WatchEvents stream up to the end of its
// snapshot: from there on every change reaches it.
func awaitCaughtUp(t *testing.T, w pb.KVOffload_WatchEventsClient) {
	t.Helper()
	for {
		r, err := w.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range r.Events {
			if e.Kind == pb.EventKind_EVENT_KIND_CAUGHT_UP {
				return
			}
		}
	}
}

func contains(hs [][]byte, h []byte) bool {
	for _, x := range hs {
		if string(x) == string(h) {
			return true
		}
	}
	return false
}

// garbleRemote deletes the value of block hash del and corrupts that of
// bad (a value's key ends with its block hash in hex), and reports how
// many values it touched.
func garbleRemote(t *testing.T, ctx context.Context, rc *rediscluster.Cluster, del, bad []byte) int {
	t.Helper()
	n := 0
	for _, node := range rc.Nodes() {
		cl := node.Client()
		ks, err := cl.Keys(ctx, remote.KeyPrefix+"*").Result()
		if err != nil {
			cl.Close()
			t.Fatal(err)
		}
		for _, k := range ks {
			switch {
			case remote.IsRecordKey(k):
				continue
			case strings.HasSuffix(k, ":"+hex.EncodeToString(del)):
				err = cl.Del(ctx, k).Err()
			case strings.HasSuffix(k, ":"+hex.EncodeToString(bad)):
				// Payload bytes overwritten: its checksum fails.
				err = cl.SetRange(ctx, k, int64(remote.HeaderSize), "\xff\x00\xff\x00").Err()
			default:
				continue
			}
			if err != nil {
				cl.Close()
				t.Fatal(err)
			}
			n++
		}
		cl.Close()
	}
	return n
}

// TestRemoteEventsRaceInvalidate stores and invalidates the same blocks
// over and over while the publisher races the invalidations, with a second
// node reading the cluster: whenever the first node's WatchEvents, read up
// to a later change, says a block is stored in the remote tier, the second
// node finds it there. A publish acknowledged after an Invalidate (its
// value stale) must never be reported stored after the removal.
func TestRemoteEventsRaceInvalidate(t *testing.T) {
	if err := rediscluster.Available(); err != nil && !rediscluster.Required() {
		t.Skip(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rc, err := rediscluster.Start(ctx, rediscluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	bin := buildDaemon(t)
	m := testenv.Model{Layers: 2, SegBytes: 16 << 10, Blocks: 32, HashBytes: 16}
	type node struct {
		c   *client.Client
		reg *pb.RegisterResponse
		r   *testenv.Region
	}
	start := func(name string) node {
		sock := filepath.Join(t.TempDir(), name+".sock")
		_, c, _ := startDaemon(t, bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "16MiB", "--remote-redis", rc.Addrs()[0])
		r := testenv.NewRegion(t, m.RegionBytes())
		reg, err := c.Register(ctx, []byte("race-remote"), m.Layout(), m.Regions(r), name)
		if err != nil {
			t.Fatal(err)
		}
		return node{c, reg, r}
	}
	a, b := start("a"), start("b")
	watch, err := a.c.API.WatchEvents(ctx, &pb.WatchEventsRequest{NamespaceIds: []uint32{a.reg.NamespaceId}})
	if err != nil {
		t.Fatal(err)
	}
	awaitCaughtUp(t, watch)
	hs := make([][]byte, 8)
	for i := range hs {
		hs[i] = m.Hash(3, i)
	}
	held := map[string]bool{}
	nextID := uint64(1)
	store := func(hs [][]byte) {
		t.Helper()
		for i, h := range hs {
			m.Fill(a.r, i, h)
		}
		if _, err := a.c.Store(ctx, a.reg.RegistrationId, []*pb.Job{testenv.Job(nextID, hs, seqIDs(len(hs)))}, true); err != nil {
			t.Fatal(err)
		}
		nextID++
	}
	remoteSeen := 0
	for round := 0; round < 40; round++ {
		store(hs)
		if round%3 != 2 {
			// Most rounds invalidate while the publishes are queued or
			// on the wire; some let them land first.
			if _, err := a.c.API.Invalidate(ctx, &pb.InvalidateRequest{NamespaceIds: []uint32{a.reg.NamespaceId}, Keys: testenv.Keys(hs...)}); err != nil {
				t.Fatal(err)
			}
		}
		// A later change, then every event up to it.
		probe := m.Hash(4, round)
		store([][]byte{probe})
		for found := false; !found; {
			r, err := watch.Recv()
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range r.Events {
				switch {
				case e.Kind == pb.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED:
					clear(held)
				case e.Tier == pb.Tier_TIER_REMOTE && e.Kind == pb.EventKind_EVENT_KIND_BLOCK_STORED:
					held[string(e.Hash)] = true
					remoteSeen++
				case e.Tier == pb.Tier_TIER_REMOTE && e.Kind == pb.EventKind_EVENT_KIND_BLOCK_REMOVED:
					delete(held, string(e.Hash))
				case e.Tier == pb.Tier_TIER_CPU && e.Kind == pb.EventKind_EVENT_KIND_BLOCK_STORED && string(e.Hash) == string(probe):
					found = true
				}
			}
		}
		for _, h := range hs {
			if !held[string(h)] {
				continue
			}
			lr, err := b.c.Lookup(ctx, []uint32{b.reg.NamespaceId}, testenv.Keys(h), 0)
			if err != nil {
				t.Fatal(err)
			}
			if lr.Ready != 1 {
				t.Fatalf("round %d: the events say %x is in the remote tier; the other node does not find it", round, h[:8])
			}
		}
	}
	if remoteSeen == 0 {
		t.Fatal("no block was ever reported in the remote tier")
	}
	t.Logf("%d BLOCK_STORED TIER_REMOTE events in 40 rounds", remoteSeen)
}
