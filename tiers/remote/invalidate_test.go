package remote

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
)

// TestRedisDeletePrefix: every key under one namespace's prefix goes, on
// every master, over several SCAN pages; another namespace's keys stay.
func TestRedisDeletePrefix(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 5*time.Second)
	ids, keys, vals := testBlocks(t, 2500, 16, nil) // > one 1000-key page per master
	_, otherKeys, otherVals := testBlocks(t, 20, 16, nil)
	setAll(t, r, keys, vals)
	setAll(t, r, otherKeys, otherVals)
	if len(byNode(t, c, keys)) != len(c.Nodes()) {
		t.Fatal("the keys do not cover every master")
	}
	n, err := r.DeletePrefix(testCtx(t), NewKeyspace(nil).NamespacePrefix(ids[0].NS), nil)
	if err != nil {
		t.Fatal(err)
	}
	if n != len(keys) {
		t.Fatalf("deleted %d keys, want %d", n, len(keys))
	}
	have := make([]Presence, len(keys))
	if err := exists(testCtx(t), r, keys, have); err != nil {
		t.Fatal(err)
	}
	for i, p := range have {
		if p != Absent {
			t.Fatalf("key %d: %v after the sweep", i, p)
		}
	}
	have = have[:len(otherKeys)]
	if err := exists(testCtx(t), r, otherKeys, have); err != nil {
		t.Fatal(err)
	}
	for i, p := range have {
		if p != Present {
			t.Fatalf("another namespace's key %d: %v after the sweep", i, p)
		}
	}
}

// TestPublisherCancelAndBarrier: a cancelled block still queued is not
// published; one whose payload was being read when it was cancelled is,
// and Barrier returns only once that batch has landed in the store.
func TestPublisherCancelAndBarrier(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 5*time.Second)
	p, m := newPublisher(t, r, nil, 8, 1)
	ids, keys, vals := testBlocks(t, 3, 1000, nil)
	srcs := make([]*memSource, len(ids))
	for i := range ids {
		srcs[i] = &memSource{payload: vals[i][HeaderSize:]}
	}
	srcs[0].gate, srcs[0].reading = make(chan struct{}), make(chan struct{}, 1)
	if err := p.Publish(ids[0], stampOf(t, p, ids[0]), len(vals[0])-HeaderSize, srcs[0]); err != nil {
		t.Fatal(err)
	}
	<-srcs[0].reading // the worker's batch is in flight, reading block 0
	for i := 1; i < 3; i++ {
		if err := p.Publish(ids[i], stampOf(t, p, ids[i]), len(vals[i])-HeaderSize, srcs[i]); err != nil {
			t.Fatal(err)
		}
	}
	if n := p.Cancel(func(k string) bool { return k == keys[0] || k == keys[1] }); n != 2 {
		t.Fatalf("Cancel matched %d, want 2", n)
	}
	barrier := make(chan struct{})
	go func() { p.Barrier(); close(barrier) }()
	select {
	case <-barrier:
		t.Fatal("Barrier returned while a batch was in flight")
	default:
	}
	close(srcs[0].gate)
	<-barrier
	// Block 0's batch has landed: it was read before the Cancel.
	got, errs := getAll(t, testCtx(t), r, keys[:1], sizesOf(vals[:1]))
	if errs[0] != nil || got[0] == nil {
		t.Fatalf("block 0 (read before the Cancel) is not in the store after Barrier: %v", errs[0])
	}
	if err := p.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	got, errs = getAll(t, testCtx(t), r, keys, sizesOf(vals))
	for i, want := range []bool{true, false, true} {
		if errs[i] != nil || (got[i] != nil) != want {
			t.Fatalf("block %d: in the store %v (err %v), want %v", i, got[i] != nil, errs[i], want)
		}
		if n := srcs[i].released.Load(); n != 1 {
			t.Fatalf("block %d released %d times", i, n)
		}
	}
	if n := int(testutil.ToFloat64(m.Blocks.WithLabelValues("publish", "cancelled"))); n != 1 {
		t.Fatalf("cancelled %d, want 1", n)
	}
}

// TestGenerations: on a real cluster, a block's value and both its
// generation records share a slot; a value is current until its key's or
// its namespace's record is written anew, and stale after (whatever is
// still stored under the key); a publish never overwrites another
// writer's current value (two nodes whose kernels computed different
// bytes), and replaces a stale one.
func TestGenerations(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 5*time.Second)
	p, m := newPublisher(t, r, nil, 8, 1)
	ids, keys, vals := testBlocks(t, 2, 1000, nil)
	sizes := sizesOf(vals)
	for i, k := range keys {
		slot, err := c.KeySlot(testCtx(t), k)
		if err != nil {
			t.Fatal(err)
		}
		for _, rec := range []string{GenKey(k), NamespaceGenKeyOf(k)} {
			if s, err := c.KeySlot(testCtx(t), rec); err != nil || s != slot {
				t.Fatalf("block %d: record %s in slot %d, its value in %d (%v)", i, rec, s, slot, err)
			}
		}
	}
	publish := func(i int, payload []byte) {
		t.Helper()
		if err := p.Publish(ids[i], stampOf(t, p, ids[i]), len(payload), &memSource{payload: payload}); err != nil {
			t.Fatal(err)
		}
		if err := p.Flush(testCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	current := func(i int, want []byte) {
		t.Helper()
		got, errs := loadAll(t, r, ids[i:i+1], keys[i:i+1], sizes[i:i+1], nil)
		if errs[0] != nil || !bytes.Equal(got[0], want) {
			t.Fatalf("block %d: current %v (err %v), want the payload given", i, got[0] != nil, errs[0])
		}
	}
	stale := func(i int) {
		t.Helper()
		if got, errs := loadAll(t, r, ids[i:i+1], keys[i:i+1], sizes[i:i+1], nil); got[0] != nil || !errors.Is(errs[0], ErrStale) {
			t.Fatalf("block %d: served %v, err %v; want stale", i, got[0] != nil, errs[0])
		}
	}
	first := vals[0][HeaderSize:]
	other := bytes.Repeat([]byte{0x77}, len(first))
	publish(0, first)
	current(0, first)
	publish(0, other) // another node's bytes for the same block
	current(0, first)
	if n := count(m, "exists"); n != 1 {
		t.Fatalf("a second writer's publish: exists %d, want 1", n)
	}
	// The key's record written anew: what is stored is stale, and a
	// publish replaces it.
	if errs := r.SetGens(testCtx(t), []GenWrite{{Key: GenKey(keys[0]), Gen: NewGen()}}); errs[0] != nil {
		t.Fatal(errs[0])
	}
	stale(0)
	publish(0, other)
	current(0, other)
	// The namespace's records written anew: every block of it is stale.
	publish(1, vals[1][HeaderSize:])
	current(1, vals[1][HeaderSize:])
	var ws []GenWrite
	for _, k := range NewKeyspace(nil).NamespaceGenKeys(ids[0].NS) {
		ws = append(ws, GenWrite{Key: k, Gen: NewGen()})
	}
	for _, err := range r.SetGens(testCtx(t), ws) {
		if err != nil {
			t.Fatal(err)
		}
	}
	stale(0)
	stale(1)
}

// scanCalls is how many SCANs node n has served.
func scanCalls(t *testing.T, n *rediscluster.Node) int {
	t.Helper()
	cl := n.Client()
	defer cl.Close()
	info, err := cl.Info(testCtx(t), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if rest, ok := strings.CutPrefix(line, "cmdstat_scan:calls="); ok {
			v, _ := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
			return v
		}
	}
	return 0
}

// TestRedisSweepKeepsWhatARoundDid: a sweep with a master down fails, and
// the next try (the master back, with its data) scans only that master:
// the masters a round went through are not scanned again.
func TestRedisSweepKeepsWhatARoundDid(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 500*time.Millisecond)
	ids, keys, vals := testBlocks(t, 60, 100, nil)
	setAll(t, r, keys, vals)
	victim := c.Node(2)
	if err := victim.Snapshot(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	victim.Kill()
	t.Cleanup(func() {
		victim.Restart(context.Background())
		victim.DropSnapshot()
	})
	prefix := NewKeyspace(nil).NamespacePrefix(ids[0].NS)
	var done Swept
	if _, err := r.DeletePrefix(testCtx(t), prefix, &done); err == nil {
		t.Fatal("a sweep with a master down succeeded")
	}
	if n := done.Len(); n != len(c.Nodes())-1 {
		t.Fatalf("%d masters swept through, want the %d alive", n, len(c.Nodes())-1)
	}
	before := map[*rediscluster.Node]int{}
	for _, n := range c.Nodes() {
		if n != victim {
			before[n] = scanCalls(t, n)
		}
	}
	if err := victim.Restart(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() error { return r.Ping(testCtx(t)) })
	if _, err := r.DeletePrefix(testCtx(t), prefix, &done); err != nil {
		t.Fatal(err)
	}
	for n, calls := range before {
		if got := scanCalls(t, n); got != calls {
			t.Errorf("master %s scanned again (%d SCANs, %d before)", n.Addr(), got, calls)
		}
	}
	have := make([]Presence, len(keys))
	exists(testCtx(t), r, keys, have)
	for i, p := range have {
		if p != Absent {
			t.Fatalf("key %d: %v after the sweep went through", i, p)
		}
	}
}
