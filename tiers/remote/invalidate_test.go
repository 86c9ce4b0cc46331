package remote

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
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
	n, err := r.DeletePrefix(testCtx(t), NewKeyspace(nil).NamespacePrefix(ids[0].NS))
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
	if err := p.Publish(ids[0], len(vals[0])-HeaderSize, srcs[0]); err != nil {
		t.Fatal(err)
	}
	<-srcs[0].reading // the worker's batch is in flight, reading block 0
	for i := 1; i < 3; i++ {
		if err := p.Publish(ids[i], len(vals[i])-HeaderSize, srcs[i]); err != nil {
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
