package remote_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// lookGate holds, once armed, the publisher's look at the cluster (a Get
// of headers only: no payload) until release is closed, telling entered
// when it begins: the publish of a block stored moments before is late.
// The reads of a Store's stamps (no header) and of loads go through.
type lookGate struct {
	remote.Store
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (g *lookGate) Get(ctx context.Context, fs []remote.Fetch) error {
	if len(fs) > 0 && len(fs[0].Head) > 0 && fs[0].Body == nil && g.armed.CompareAndSwap(true, false) {
		g.entered <- struct{}{}
		<-g.release
	}
	return g.Store.Get(ctx, fs)
}

// TestStoredBeforeInvalidateIsStale: node A stores a block and its
// publish is held back; node B invalidates the block (A does not know);
// then A's publish goes ahead. The block was stored before the invalidation,
// so no node is offered or loads it from the cluster: not B, not a node
// started afterwards. A block stored after the invalidation (B computes it
// again) is shared at once. A's publish used to be stamped with the
// generations its look read, after B's invalidation: current, and every
// node loaded the old bytes.
func TestStoredBeforeInvalidateIsStale(t *testing.T) {
	c := rediscluster.ForTest(t)
	g := &lookGate{entered: make(chan struct{}, 1), release: make(chan struct{})}
	a := startNode(t, c, nodeOpts{publishers: 1, wrapStore: func(s remote.Store) remote.Store { g.Store = s; return g }})
	b := startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	k := ea.hashes(211, 1)
	g.armed.Store(true)
	t.Cleanup(func() {
		select {
		case <-g.release:
		default:
			close(g.release)
		}
	})
	ea.store(t, k, seq(0, 1)) // returned OK: stored before what follows
	<-g.entered               // A's publish is held before its look
	if _, err := eb.c.Invalidate(ctx(t), []uint32{eb.reg.NamespaceId}, testenv.Keys(k...)); err != nil {
		t.Fatal(err)
	}
	close(g.release)
	flush(t, a)
	if n := metric(t, a, "kvoffload_remote_blocks_total", "op", "publish", "result", "stale"); n != 1 {
		t.Errorf("A's publish of the block stored before B's invalidation: %v counted stale, want 1", n)
	}
	ec := register(t, startNode(t, c, nodeOpts{}), model, fp)
	for name, e := range map[string]*engine{"B": eb, "a node started after": ec} {
		if lr := e.lookup(t, k); lr.Ready != 0 {
			t.Fatalf("%s is offered a block stored before an invalidation and published after it: %v", name, lr.Tiers)
		}
		if st := e.load(t, k, seq(3, 1)); st[0] == okSt {
			t.Fatalf("%s loaded a block stored before an invalidation and published after it", name)
		}
	}
	// Computed again after the invalidation: shared at once.
	eb.store(t, k, seq(0, 1))
	flush(t, b)
	if st := ec.load(t, k, seq(5, 1)); st[0] != okSt {
		t.Fatalf("a node loading the block B stored after the invalidation: %v", st[0])
	}
}
