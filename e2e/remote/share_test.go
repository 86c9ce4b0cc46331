package remote_test

import (
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// TestTwoDaemonsShareBlocks: daemon A stores blocks from its engine; daemon
// B, with its own region and an empty local cache, finds them in the
// cluster (tier REMOTE) and loads them byte-exact, then holds them in its
// CPU tier. Namespaces that differ in fingerprint or layout, and nodes
// with another MAC key, see nothing of them.
func TestTwoDaemonsShareBlocks(t *testing.T) {
	c := rediscluster.ForTest(t)
	a := startNode(t, c, nodeOpts{})
	b := startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	ea := register(t, a, model, fp)
	eb := register(t, b, model, fp)
	hs := ea.hashes(1, 24)
	ea.store(t, hs, seq(0, 24))
	flush(t, a)
	if n := metric(t, a, "kvoffload_remote_blocks_total", "op", "publish", "result", "published"); n != 24 {
		t.Fatalf("A published %v blocks, want 24", n)
	}

	probe := append(append([][]byte{}, hs...), ea.m.Hash(1, 24))
	lr := eb.lookup(t, probe)
	if lr.Ready != 24 {
		t.Fatalf("B looked up %d ready, want 24", lr.Ready)
	}
	for i, tier := range lr.Tiers {
		if tier != pb.Tier_TIER_REMOTE {
			t.Fatalf("B: block %d in tier %v, want REMOTE", i, tier)
		}
	}
	st := eb.load(t, hs, seq(30, 24)) // other engine blocks than A's
	if n := count(st)[okSt]; n != 24 {
		t.Fatalf("B loaded %v", count(st))
	}
	// Promoted: B's CPU tier holds them now.
	lr = eb.lookup(t, hs)
	if lr.Ready != 24 || lr.Tiers[0] != pb.Tier_TIER_CPU {
		t.Fatalf("B after the load: %d ready, first in %v; want 24 in CPU", lr.Ready, lr.Tiers[0])
	}
	if n := metric(t, b, "kvoffload_remote_blocks_total", "op", "load", "result", "ok"); n != 24 {
		t.Fatalf("B's remote loads: %v, want 24", n)
	}
	if got, want := metric(t, b, "kvoffload_remote_bytes_total", "op", "load"), float64(24*model.Layers*model.SegBytes); got != want {
		t.Fatalf("B's remote load bytes: %v, want %v", got, want)
	}
	// B loaded them, it did not store them: nothing published again.
	flush(t, b)
	if n := metric(t, b, "kvoffload_remote_blocks_total", "op", "publish"); n != 0 {
		t.Fatalf("B published %v blocks it only loaded", n)
	}
	// A stores the same blocks again on another engine block (a no-op
	// locally) and two new ones: only the new ones are published.
	ea.store(t, append(hs[:2:2], ea.m.Hash(1, 24), ea.m.Hash(1, 25)), seq(40, 4))
	flush(t, a)
	if n := metric(t, a, "kvoffload_remote_blocks_total", "op", "publish", "result", "published"); n != 26 {
		t.Fatalf("A published %v blocks in all, want 26", n)
	}
	if err := a.Svc.CheckAccounting(); err != nil {
		t.Fatal(err)
	}
	if err := b.Svc.CheckAccounting(); err != nil {
		t.Fatal(err)
	}

	// Another fingerprint, the same fingerprint with another layout, and
	// a node with a MAC key: none of them shares A's blocks.
	other := model
	other.SegBytes = 8 << 10
	mac, err := remote.NewMAC([]byte("0123456789abcdef0123456789abcdef"))
	if err != nil {
		t.Fatal(err)
	}
	keyed := startNode(t, c, nodeOpts{mac: mac})
	for name, e := range map[string]*engine{
		"other fingerprint": register(t, b, model, fp+"-other"),
		"other layout":      register(t, startNode(t, c, nodeOpts{}), other, fp),
		"MAC key":           register(t, keyed, model, fp),
	} {
		if lr := e.lookup(t, hs); lr.Ready != 0 {
			t.Errorf("%s: %d of A's blocks offered", name, lr.Ready)
		}
	}
}

// TestMACKeyedFleet: nodes sharing a key share blocks; a value written
// into their keyspace without the key (no MAC, or another key's) is
// CORRUPT, deleted from the cluster, and never reaches the engine.
func TestMACKeyedFleet(t *testing.T) {
	c := rediscluster.ForTest(t)
	mac, _ := remote.NewMAC([]byte("fleet key material, 32 bytes or more"))
	a := startNode(t, c, nodeOpts{mac: mac})
	b := startNode(t, c, nodeOpts{mac: mac})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(2, 6)
	ea.store(t, hs, seq(0, 6))
	flush(t, a)
	if lr := eb.lookup(t, hs); lr.Ready != 6 {
		t.Fatalf("B: %d ready, want 6", lr.Ready)
	}

	// An attacker who reaches the cluster but has no key overwrites two
	// values: one open (no MAC), one MAC'd with their own key. Both carry
	// the right header and checksum for another payload.
	attacker, _ := remote.NewMAC([]byte("the attacker's own key material!!"))
	cc := c.ClusterClient()
	defer cc.Close()
	payload := uint64(model.Layers * model.SegBytes)
	for i, m := range map[int]*remote.MAC{1: nil, 4: attacker} {
		key, ok := b.Svc.RemoteKey(eb.reg.NamespaceId, 0, hs[i])
		if !ok {
			t.Fatal("no remote key")
		}
		v, err := cc.Get(ctx(t), key).Bytes()
		if err != nil {
			t.Fatal(err)
		}
		forged := make([]byte, remote.HeaderSize+payload)
		for j := range forged[remote.HeaderSize:] {
			forged[remote.HeaderSize+j] = 0x5a
		}
		id := remote.Ident{Group: 0, Hash: hs[i]}
		copy(id.NS[:], v[32:64]) // the namespace digest, read off the real header
		// The real value's stamp, so the forgery is of the current
		// generations and only the MAC can tell.
		if err := remote.EncodeHeader(forged, id, remote.StampOf(v), m); err != nil {
			t.Fatal(err)
		}
		if err := cc.Set(ctx(t), key, forged, 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	st := eb.load(t, hs, seq(10, 6))
	for i, s := range st {
		want := okSt
		if i == 1 || i == 4 {
			want = corruptSt
		}
		if s != want {
			t.Errorf("block %d: %v, want %v", i, s, want)
		}
	}
	if n := metric(t, b, "kvoffload_remote_errors_total", "op", "verify", "kind", "mac"); n != 2 {
		t.Errorf("MAC failures counted: %v, want 2", n)
	}
	for _, i := range []int{1, 4} {
		key, _ := b.Svc.RemoteKey(eb.reg.NamespaceId, 0, hs[i])
		if n, err := cc.Exists(ctx(t), key).Result(); err != nil || n != 0 {
			t.Errorf("forged value %d still in the cluster (exists %d, %v)", i, n, err)
		}
	}
	// A fresh node of the fleet is no longer offered them.
	ec := register(t, startNode(t, c, nodeOpts{mac: mac}), model, fp)
	if lr := ec.lookup(t, hs); lr.Ready != 1 {
		t.Errorf("after the forged values were deleted: %d ready, want 1", lr.Ready)
	}
}

// TestRemoteBlockGoneAtLoad: a Lookup with a lease does not pin remote
// blocks (there is nothing local to pin); a block deleted from the cluster
// between the Lookup and the Load is MISSING, its engine block untouched,
// and the others load.
func TestRemoteBlockGoneAtLoad(t *testing.T) {
	c := rediscluster.ForTest(t)
	a, b := startNode(t, c, nodeOpts{}), startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(11, 6)
	ea.store(t, hs, seq(0, 6))
	flush(t, a)
	lr, err := eb.c.Lookup(ctx(t), []uint32{eb.reg.NamespaceId}, testenv.Keys(hs...), 5000)
	if err != nil {
		t.Fatal(err)
	}
	if lr.Ready != 6 || lr.LeaseId != 0 {
		t.Fatalf("lookup with a lease: %d ready, lease %d; want 6 remote blocks and no lease", lr.Ready, lr.LeaseId)
	}
	cc := c.ClusterClient()
	defer cc.Close()
	gone, _ := b.Svc.RemoteKey(eb.reg.NamespaceId, 0, hs[3])
	if err := cc.Unlink(ctx(t), gone).Err(); err != nil {
		t.Fatal(err)
	}
	st := eb.load(t, hs, seq(20, 6))
	for i, s := range st {
		if want := map[bool]pb.BlockStatus{true: missingSt, false: okSt}[i == 3]; s != want {
			t.Errorf("block %d: %v, want %v", i, s, want)
		}
	}
}

// TestLookupAsksBounded: one Lookup asks the cluster about at most
// MaxLookupKeys keys past its local prefix (over all its namespaces), so
// the remote part of a prefix stops there.
func TestLookupAsksBounded(t *testing.T) {
	c := rediscluster.ForTest(t)
	a := startNode(t, c, nodeOpts{})
	b := startNode(t, c, nodeOpts{asks: 10})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(12, 16)
	ea.store(t, hs, seq(0, 16))
	flush(t, a)
	if lr := eb.lookup(t, hs); lr.Ready != 10 {
		t.Fatalf("one namespace: %d ready, want the bound, 10", lr.Ready)
	}
	// B holds the first 4 locally now: the bound counts from there.
	eb.store(t, hs[:4], seq(0, 4))
	if lr := eb.lookup(t, hs); lr.Ready != 14 {
		t.Fatalf("after a local prefix of 4: %d ready, want 14", lr.Ready)
	}
	// Two namespaces (two ranks) share the bound: 5 keys each.
	eb2 := register(t, b, model, fp+"-rank1")
	ea2 := register(t, a, model, fp+"-rank1")
	ea2.store(t, hs, seq(20, 16))
	flush(t, a)
	lr, err := eb.c.Lookup(ctx(t), []uint32{eb.reg.NamespaceId, eb2.reg.NamespaceId}, testenv.Keys(hs...), 0)
	if err != nil {
		t.Fatal(err)
	}
	if lr.Ready != 5 {
		t.Fatalf("two namespaces: %d ready, want 5", lr.Ready)
	}
}
