package remote_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// TestInvalidateDuringResharding: A invalidates 160 blocks while every
// slot holding them migrates to another master (a live resharding, each
// block's keys split another way: none moved yet, all moved, the records
// moved and not the value, the value and not the records), and the
// migration ends right after the answer. The Invalidate answers OK (its
// record writes followed the cluster's ASK), and B, loading the blocks
// over and over from the answer on (its slot map meeting MOVED and
// reloading), never loads one. It logs the window: from the answer, how
// long B loaded invalidated bytes and how many blocks. The record writes
// used to fail on ASK, the Invalidate answered UNAVAILABLE and B loaded
// the blocks whose records had moved until A's retry.
func TestInvalidateDuringResharding(t *testing.T) {
	c := rediscluster.ForTest(t)
	a := startNode(t, c, nodeOpts{})
	b := startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	m := testenv.Model{Layers: 4, SegBytes: 16 << 10, Blocks: 160, HashBytes: 16}
	ea, eb := register(t, a, m, fp), register(t, b, m, fp)
	const n = 160
	hs := ea.hashes(uint64(time.Now().UnixNano()), n)
	ea.store(t, hs, seq(0, n))
	flush(t, a)
	waitFor(t, func() error {
		if lr := eb.lookup(t, hs); lr.Ready != n {
			return fmt.Errorf("B is offered %d of A's %d blocks", lr.Ready, n)
		}
		return nil
	})
	keys := make([]string, n)
	slots := make([]int, n)
	for i, h := range hs {
		k, ok := a.Svc.RemoteKey(ea.reg.NamespaceId, 0, h)
		if !ok {
			t.Fatal("no remote key")
		}
		keys[i] = k
		s, err := c.KeySlot(ctx(t), k)
		if err != nil {
			t.Fatal(err)
		}
		slots[i] = s
	}
	mig, err := c.StartMigration(ctx(t), slots, func(from *rediscluster.Node) *rediscluster.Node {
		return c.Node((from.Index() + 1) % len(c.Nodes()))
	})
	if err != nil {
		t.Fatal(err)
	}
	finished := make(chan error, 1)
	finishing := false
	defer func() {
		if !finishing {
			mig.Finish(context.Background())
		}
	}()
	moved := map[string]bool{} // a key shared by blocks of one bucket moves once
	for i, k := range keys {
		var move []string
		switch i % 4 {
		case 1:
			move = []string{k, remote.GenKey(k), remote.NamespaceGenKeyOf(k)}
		case 2:
			move = []string{remote.GenKey(k), remote.NamespaceGenKeyOf(k)}
		case 3:
			move = []string{k}
		}
		for _, mk := range move {
			if !moved[mk] {
				moved[mk] = true
				if err := mig.Migrate(ctx(t), mk); err != nil {
					t.Fatal(err)
				}
			}
		}
	}

	_, ierr := ea.c.Invalidate(ctx(t), []uint32{ea.reg.NamespaceId}, testenv.Keys(hs...))
	answered := time.Now()
	finishing = true
	go func() { finished <- mig.Finish(context.Background()) }()
	first := map[int]time.Duration{} // block: when B first loaded it, from the answer
	done := false
	pending := func() int { k, ns := a.Svc.RemotePendingDeletes(); return k + ns }
	var pendingSeen int
	passes := 0
	for last := false; !last; passes++ {
		if passes > 20000 {
			t.Fatal("the resharding never ended, or A's records were never written")
		}
		// Once the slots moved and A owes nothing, one more pass: any
		// later load reads the records A wrote.
		if !done {
			select {
			case err := <-finished:
				if err != nil {
					t.Fatal(err)
				}
				done = true
			default:
			}
		}
		p := pending()
		pendingSeen = max(pendingSeen, p)
		last = done && p == 0
		for i, st := range eb.load(t, hs, seq(0, n)) {
			if _, ok := first[i]; st == okSt && !ok {
				first[i] = time.Since(answered)
			}
		}
	}
	var window time.Duration
	for _, d := range first {
		window = max(window, d)
	}
	t.Logf("Invalidate during the resharding answered %v; B loaded %d of the %d invalidated blocks, the last %v after the answer (records pending on A: up to %d; %d load passes)",
		ierr, len(first), n, window.Round(time.Millisecond), pendingSeen, passes)
	if ierr != nil {
		t.Errorf("Invalidate during a resharding: %v; want OK", ierr)
	}
	if len(first) > 0 {
		t.Errorf("B loaded %d invalidated blocks after the Invalidate answered", len(first))
	}

	// The namespace invalidated whole while slots migrate: of its 1024
	// record copies (one per bucket), those in the migrating slots were
	// moved and meet ASK. B stores the blocks again first (after the
	// records: current), so there is something to refuse.
	eb.store(t, hs[:8], seq(0, 8))
	flush(t, b)
	waitFor(t, func() error {
		if lr := ea.lookup(t, hs[:8]); lr.Ready != 8 {
			return fmt.Errorf("A is offered %d of B's 8 blocks stored again", lr.Ready)
		}
		return nil
	})
	mig, err = c.StartMigration(ctx(t), slots[:8], func(from *rediscluster.Node) *rediscluster.Node {
		return c.Node((from.Index() + 1) % len(c.Nodes()))
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys[:8] {
		if err := mig.Migrate(ctx(t), remote.NamespaceGenKeyOf(k)); err != nil {
			t.Fatal(err)
		}
	}
	_, werr := eb.c.Invalidate(ctx(t), []uint32{eb.reg.NamespaceId}, nil)
	if err := mig.Finish(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if werr != nil {
		t.Fatalf("Invalidate of the namespace whole during a resharding: %v; want OK", werr)
	}
	for i, st := range ea.load(t, hs[:8], seq(0, 8)) {
		if st == okSt {
			t.Fatalf("A loaded block %d of a namespace B invalidated whole during a resharding", i)
		}
	}
}
