package remote

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
)

// TestRecordWritesFollowResharding: an invalidation's record writes meet
// a live slot migration (MIGRATING on the old master, IMPORTING on the
// new one) with each block's keys in another place: all still on the old
// master, all moved, the records moved and the value not, the value moved
// and the records not. Every write is written, not failed (the cluster's
// ASK followed within the call), and so is every write after the slots
// moved whole, by a client whose slot map still has the old owners
// (MOVED). A reader, which does not follow, never takes a value whose
// records it could not read: mid-migration it is served a block only where
// value and records are on the master it asked, and no block once the
// records are written. With WAIT (WaitReplicas) the same on a cluster
// with a replica per master.
func TestRecordWritesFollowResharding(t *testing.T) {
	t.Run("master", func(t *testing.T) { testRecordWritesFollowResharding(t, cluster(t), 0) })
	t.Run("wait-replicas", func(t *testing.T) {
		if err := rediscluster.Available(); err != nil && !rediscluster.Required() {
			t.Skip(err)
		}
		c, err := rediscluster.Start(testCtx(t), rediscluster.Options{Replicas: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		testRecordWritesFollowResharding(t, c, 1)
	})
}

func testRecordWritesFollowResharding(t *testing.T, c *rediscluster.Cluster, wait int) {
	ctx := testCtx(t)
	writer, err := NewRedis(RedisConfig{Addrs: c.Addrs()[:1], Timeout: 5 * time.Second, WaitReplicas: wait})
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Close()
	reader := newRedis(t, c, 5*time.Second)
	p, _ := newPublisher(t, writer, nil, 64, 1)

	// Four blocks in four slots: how each is split mid-migration.
	const (
		stayed = iota
		allMoved
		recordsMoved
		valueMoved
	)
	cand, candKeys, candVals := testBlocks(t, 64, 1000, nil)
	var ids []Ident
	var keys []string
	var vals [][]byte
	var slots []int
	seen := map[int]bool{}
	for i, k := range candKeys {
		slot, err := c.KeySlot(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if !seen[slot] && len(keys) < 4 {
			seen[slot] = true
			ids, keys, vals, slots = append(ids, cand[i]), append(keys, k), append(vals, candVals[i]), append(slots, slot)
		}
	}
	for i, id := range ids {
		if err := p.Publish(id, stampOf(t, p, id), len(vals[i])-HeaderSize, &memSource{payload: vals[i][HeaderSize:]}); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	sizes := sizesOf(vals)
	if got, errs := loadAll(t, reader, ids, keys, sizes, nil); errors.Join(errs...) != nil || got[3] == nil {
		t.Fatalf("before the resharding: %v", errs)
	}

	m, err := c.StartMigration(ctx, slots, func(from *rediscluster.Node) *rediscluster.Node {
		return c.Node((from.Index() + 1) % len(c.Nodes()))
	})
	if err != nil {
		t.Fatal(err)
	}
	finished := false
	defer func() {
		if !finished {
			m.Finish(context.Background())
		}
	}()
	for b, k := range keys {
		var move []string
		switch b {
		case allMoved:
			move = []string{k, GenKey(k), NamespaceGenKeyOf(k)}
		case recordsMoved:
			move = []string{GenKey(k), NamespaceGenKeyOf(k)}
		case valueMoved:
			move = []string{k}
		}
		if err := m.Migrate(ctx, move...); err != nil {
			t.Fatal(err)
		}
	}
	// A reader mid-migration: served only where value and records are on
	// the master it asks; elsewhere refused as unavailable.
	got, errs := loadAll(t, reader, ids, keys, sizes, nil)
	for b := range keys {
		switch {
		case b == stayed && (got[b] == nil || errs[b] != nil):
			t.Fatalf("block %d, on its old master whole: not served mid-migration (%v)", b, errs[b])
		case b != stayed && (got[b] != nil || !errors.Is(errs[b], ErrUnavailable)):
			t.Fatalf("block %d, split by the migration: served %v, err %v; want refused as unavailable", b, got[b] != nil, errs[b])
		}
	}

	write := func(when string) []GenWrite {
		t.Helper()
		var ws []GenWrite
		for _, k := range keys {
			ws = append(ws, GenWrite{Key: GenKey(k), Gen: NewGen(), Unlink: k}, GenWrite{Key: NamespaceGenKeyOf(k), Gen: NewGen()})
		}
		for i, err := range writer.SetGens(ctx, ws) {
			if err != nil {
				t.Fatalf("%s: record %s: %v", when, ws[i].Key, err)
			}
		}
		return ws
	}
	write("mid-migration")
	if got, errs := loadAll(t, reader, ids, keys, sizes, nil); got[0] != nil || got[1] != nil || got[2] != nil || got[3] != nil {
		t.Fatalf("a block served after its records were written mid-migration: %v", errs)
	}
	if err := m.Finish(ctx); err != nil {
		t.Fatal(err)
	}
	finished = true
	cc := c.ClusterClient()
	defer cc.Close()
	check := func(when string, ws []GenWrite) {
		t.Helper()
		for _, w := range ws {
			if v, err := cc.Get(ctx, w.Key).Result(); err != nil || v != genText(w.Gen) {
				t.Fatalf("%s: record %s is %q (%v), want the one written", when, w.Key, v, err)
			}
			if w.Unlink != "" {
				if n, err := cc.Exists(ctx, w.Unlink).Result(); err != nil || n != 0 {
					t.Fatalf("%s: the value %s the record makes stale is still there (%v)", when, w.Unlink, err)
				}
			}
		}
		// The reader (its map stale: MOVED, then reloaded) serves none.
		waitFor(t, func() error {
			got, errs := loadAll(t, reader, ids, keys, sizes, nil)
			for b := range keys {
				if got[b] != nil {
					t.Fatalf("%s: block %d served", when, b)
				}
				if errs[b] != nil && !errors.Is(errs[b], ErrStale) {
					return errs[b]
				}
			}
			return nil
		})
	}
	// ws of the mid-migration write is checked through the next one:
	// the writer's slot map still has the old owners (it followed ASK,
	// which reloads nothing), so these writes meet MOVED.
	check("after a write mid-migration, then one after the slots moved", write("after the slots moved"))
}
