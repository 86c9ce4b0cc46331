package remote

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// memSource is a block in memory; gate, when set, holds Read until closed.
type memSource struct {
	payload  []byte
	gone     bool
	gate     chan struct{}
	reading  chan struct{} // gets a value when Read starts
	released atomic.Int32
}

func (s *memSource) Read(dst []byte) bool {
	if s.reading != nil {
		s.reading <- struct{}{}
	}
	if s.gate != nil {
		<-s.gate
	}
	if s.gone {
		return false
	}
	copy(dst, s.payload)
	return true
}

func (s *memSource) Release() { s.released.Add(1) }

func newPublisher(t *testing.T, s Store, mac *MAC, queue, workers int) (*Publisher, *Metrics) {
	t.Helper()
	m := NewMetrics(nil)
	p := NewPublisher(PublisherConfig{Store: Instrument(s, m), Keyspace: NewKeyspace(mac), MAC: mac, Queue: queue, Workers: workers, Timeout: 5 * time.Second, Metrics: m})
	t.Cleanup(p.Close)
	return p, m
}

// stampOf reads the stamp a block of id stored now carries.
func stampOf(t *testing.T, p *Publisher, id Ident) Stamp {
	t.Helper()
	st, ok := ReadStamps(testCtx(t), p.cfg.Store, []string{p.cfg.Keyspace.Key(id)})
	if !ok[0] {
		t.Fatal("the block's generation records could not be read")
	}
	return st[0]
}

func count(m *Metrics, result string) int {
	return int(testutil.ToFloat64(m.Blocks.WithLabelValues("publish", result)))
}

// TestPublisherPublishes: queued blocks reach the store as values that
// verify, each source released once; a block published again is found in
// the store and not sent again.
func TestPublisherPublishes(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 5*time.Second)
	mac := testMAC(t, 7)
	p, m := newPublisher(t, r, mac, 64, 2)
	ids, keys, vals := testBlocks(t, 40, 3000, mac)
	srcs := make([]*memSource, len(ids))
	for i, id := range ids {
		srcs[i] = &memSource{payload: vals[i][HeaderSize:]}
		if err := p.Publish(id, stampOf(t, p, id), len(vals[i])-HeaderSize, srcs[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	got, errs := loadAll(t, r, ids, keys, sizesOf(vals), mac)
	for i := range keys {
		if errs[i] != nil || !bytes.Equal(got[i], vals[i][HeaderSize:]) {
			t.Fatalf("block %d: err %v, stored payload equal %v", i, errs[i], bytes.Equal(got[i], vals[i][HeaderSize:]))
		}
		if n := srcs[i].released.Load(); n != 1 {
			t.Fatalf("block %d released %d times", i, n)
		}
	}
	if n := count(m, "published"); n != len(ids) {
		t.Fatalf("published %d, want %d", n, len(ids))
	}
	if b := testutil.ToFloat64(m.Bytes.WithLabelValues("publish")); int(b) != 40*3000+40*39/2 {
		t.Fatalf("published bytes %v", b)
	}
	// Again: every block is in the store already.
	for i, id := range ids {
		p.Publish(id, stampOf(t, p, id), len(vals[i])-HeaderSize, &memSource{payload: vals[i][HeaderSize:]})
	}
	p.Flush(testCtx(t))
	if n, e := count(m, "published"), count(m, "exists"); n != len(ids) || e != len(ids) {
		t.Fatalf("after publishing again: %d published, %d found in the store; want %d and %d", n, e, len(ids), len(ids))
	}
}

// TestPublisherDedupAndDrop: a block already queued is not queued again,
// a full queue drops (ErrQueueFull, counted, released at once), and a
// block gone by the time its turn comes is skipped. The worker is held in
// a Read so the queue's state is known.
func TestPublisherDedupAndDrop(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 5*time.Second)
	p, m := newPublisher(t, r, nil, 3, 1)
	ids, keys, vals := testBlocks(t, 6, 1000, nil)
	gate := make(chan struct{})
	first := &memSource{payload: vals[0][HeaderSize:], gate: gate, reading: make(chan struct{}, 1)}
	if err := p.Publish(ids[0], stampOf(t, p, ids[0]), len(vals[0])-HeaderSize, first); err != nil {
		t.Fatal(err)
	}
	<-first.reading // the worker holds block 0; the queue is empty
	srcs := []*memSource{first}
	for i := 1; i < 6; i++ {
		s := &memSource{payload: vals[i][HeaderSize:], gone: i == 3}
		srcs = append(srcs, s)
		err := p.Publish(ids[i], stampOf(t, p, ids[i]), len(vals[i])-HeaderSize, s)
		switch {
		case i <= 3 && err != nil:
			t.Fatalf("block %d: %v with room in the queue", i, err)
		case i > 3 && !errors.Is(err, ErrQueueFull):
			t.Fatalf("block %d: %v, want ErrQueueFull", i, err)
		case i > 3 && s.released.Load() != 1:
			t.Fatalf("dropped block %d not released", i)
		}
	}
	dup := &memSource{payload: vals[1][HeaderSize:]}
	if err := p.Publish(ids[1], stampOf(t, p, ids[1]), len(vals[1])-HeaderSize, dup); err != nil || dup.released.Load() != 1 {
		t.Fatalf("duplicate of a queued block: err %v, released %d", err, dup.released.Load())
	}
	dup0 := &memSource{payload: vals[0][HeaderSize:]}
	if err := p.Publish(ids[0], stampOf(t, p, ids[0]), len(vals[0])-HeaderSize, dup0); err != nil || dup0.released.Load() != 1 {
		t.Fatalf("duplicate of a block in flight: err %v, released %d", err, dup0.released.Load())
	}
	if d := p.Depth(); d != 4 {
		t.Fatalf("depth %d, want 4 (one in flight, three queued)", d)
	}
	close(gate)
	if err := p.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if d := p.Depth(); d != 0 {
		t.Fatalf("depth %d after flush", d)
	}
	for result, want := range map[string]int{"published": 3, "gone": 1, "dropped": 2, "duplicate": 2} {
		if n := count(m, result); n != want {
			t.Errorf("%s: %d, want %d", result, n, want)
		}
	}
	have := make([]Presence, len(keys))
	exists(testCtx(t), r, keys, have)
	for i, h := range have {
		if want := map[bool]Presence{true: Present, false: Absent}[i <= 2]; h != want {
			t.Errorf("block %d in the store: %v, want %v", i, h, want)
		}
	}
	for i, s := range srcs {
		if n := s.released.Load(); n != 1 {
			t.Errorf("block %d released %d times", i, n)
		}
	}
}

// TestPublisherCloseReleasesQueued: Close stops the workers and releases
// what is still queued, once.
func TestPublisherCloseReleasesQueued(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 5*time.Second)
	p, m := newPublisher(t, r, nil, 8, 1)
	ids, _, vals := testBlocks(t, 4, 100, nil)
	gate := make(chan struct{})
	held := &memSource{payload: vals[0][HeaderSize:], gate: gate, reading: make(chan struct{}, 1)}
	p.Publish(ids[0], stampOf(t, p, ids[0]), len(vals[0])-HeaderSize, held)
	<-held.reading
	var queued []*memSource
	for i := 1; i < 4; i++ {
		s := &memSource{payload: vals[i][HeaderSize:]}
		queued = append(queued, s)
		p.Publish(ids[i], stampOf(t, p, ids[i]), len(vals[i])-HeaderSize, s)
	}
	var wg sync.WaitGroup
	wg.Go(p.Close)
	<-p.stop // Close has begun: from here stopping wins over the queue
	close(gate)
	wg.Wait()
	for i, s := range append(queued, held) {
		if n := s.released.Load(); n != 1 {
			t.Errorf("source %d released %d times", i, n)
		}
	}
	if n := count(m, "dropped"); n != 3 {
		t.Errorf("dropped %d at close, want 3", n)
	}
	if err := p.Publish(ids[1], stampOf(t, p, ids[1]), 100, &memSource{}); !errors.Is(err, ErrQueueFull) {
		t.Errorf("publish after close: %v", err)
	}
	p.Flush(context.Background())
}

// TestPublisherRepublishesAfterCancel: a block published again after its
// queued publish was cancelled is queued anew and sent, with the new
// source's bytes; the cancelled item is not sent, and both are released.
// It used to count as a duplicate of the cancelled item and be dropped.
func TestPublisherRepublishesAfterCancel(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 5*time.Second)
	p, m := newPublisher(t, r, nil, 8, 1)
	ids, keys, vals := testBlocks(t, 2, 1000, nil)
	gate := make(chan struct{})
	var open sync.Once
	release := func() { open.Do(func() { close(gate) }) }
	t.Cleanup(release) // before the publisher's Close, which waits for the worker
	held := &memSource{payload: vals[0][HeaderSize:], gate: gate, reading: make(chan struct{}, 1)}
	p.Publish(ids[0], stampOf(t, p, ids[0]), len(vals[0])-HeaderSize, held)
	<-held.reading // the one worker holds block 0
	size := len(vals[1]) - HeaderSize
	stale := &memSource{payload: bytes.Repeat([]byte{0xee}, size)} // what was invalidated
	if err := p.Publish(ids[1], stampOf(t, p, ids[1]), size, stale); err != nil {
		t.Fatal(err)
	}
	if n := p.Cancel(func(k string) bool { return k == keys[1] }); n != 1 {
		t.Fatalf("cancel matched %d, want 1", n)
	}
	if n := p.Cancel(func(k string) bool { return k == keys[1] }); n != 0 {
		t.Fatalf("cancelling again matched %d, want 0", n)
	}
	fresh := &memSource{payload: vals[1][HeaderSize:]}
	if err := p.Publish(ids[1], stampOf(t, p, ids[1]), size, fresh); err != nil {
		t.Fatal(err)
	}
	if d := p.Depth(); d != 3 {
		t.Errorf("depth %d, want 3 (one in flight, the cancelled item and the new one queued)", d)
	}
	release()
	if err := p.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	got, errs := loadAll(t, r, ids[1:], keys[1:], sizesOf(vals[1:]), nil)
	if errs[0] != nil || !bytes.Equal(got[0], vals[1][HeaderSize:]) {
		t.Fatalf("the block published again after a cancel: err %v, stored payload is the new one: %v", errs[0], bytes.Equal(got[0], vals[1][HeaderSize:]))
	}
	for result, want := range map[string]int{"published": 2, "cancelled": 1, "duplicate": 0} {
		if n := count(m, result); n != want {
			t.Errorf("%s: %d, want %d", result, n, want)
		}
	}
	for i, s := range []*memSource{held, stale, fresh} {
		if n := s.released.Load(); n != 1 {
			t.Errorf("source %d released %d times", i, n)
		}
	}
}

// TestPublisherAcked: Acked hears of each block the store acknowledged
// (published, or found there), and not of one cancelled while its payload
// was being read: its SET lands, but an Invalidate's Cancel came before the
// acknowledgement, so it is never reported stored after the removal.
func TestPublisherAcked(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 5*time.Second)
	m := NewMetrics(nil)
	var mu sync.Mutex
	var acked []Source
	p := NewPublisher(PublisherConfig{Store: Instrument(r, m), Keyspace: NewKeyspace(nil), Queue: 8, Workers: 1, Timeout: 5 * time.Second, Metrics: m,
		Acked: func(src Source) {
			mu.Lock()
			acked = append(acked, src)
			mu.Unlock()
		}})
	t.Cleanup(p.Close)
	ids, keys, vals := testBlocks(t, 2, 1000, nil)
	gate := make(chan struct{})
	var open sync.Once
	release := func() { open.Do(func() { close(gate) }) }
	t.Cleanup(release)
	held := &memSource{payload: vals[0][HeaderSize:], gate: gate, reading: make(chan struct{}, 1)}
	p.Publish(ids[0], stampOf(t, p, ids[0]), len(vals[0])-HeaderSize, held)
	<-held.reading // its payload is being read: the Cancel comes too late to stop the SET
	if n := p.Cancel(func(k string) bool { return k == keys[0] }); n != 1 {
		t.Fatalf("cancel matched %d, want 1", n)
	}
	release()
	size := len(vals[1]) - HeaderSize
	first := &memSource{payload: vals[1][HeaderSize:]}
	again := &memSource{payload: vals[1][HeaderSize:]}
	for _, src := range []*memSource{first, again} {
		if err := p.Publish(ids[1], stampOf(t, p, ids[1]), size, src); err != nil {
			t.Fatal(err)
		}
		if err := p.Flush(testCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	if n := count(m, "published"); n != 2 {
		t.Fatalf("published %d, want 2 (the cancelled block's SET landed)", n)
	}
	if n := count(m, "exists"); n != 1 {
		t.Fatalf("exists %d, want 1", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(acked) != 2 || acked[0] != Source(first) || acked[1] != Source(again) {
		t.Fatalf("acked %v; want the block published and the one found there, not the cancelled one (%p)", acked, held)
	}
}

// TestPublisherStampsWhatWasReadAtStore: a block is stamped with the
// records read when it was stored, not with what the publisher's look
// reads. One whose key (or namespace) was invalidated between its store
// and its turn is not sent (stale); the others are, and verify. Stamped
// at the look, the invalidated one would be current.
func TestPublisherStampsWhatWasReadAtStore(t *testing.T) {
	c := cluster(t)
	r := newRedis(t, c, 5*time.Second)
	p, m := newPublisher(t, r, nil, 8, 1)
	ids, keys, vals := testBlocks(t, 3, 1000, nil)
	stamps := make([]Stamp, len(ids))
	for i := range ids {
		stamps[i] = stampOf(t, p, ids[i])
	}
	// Invalidated after the store: block 0's key, and block 1's
	// namespace (its bucket's copy of the record).
	gs := []GenWrite{{Key: GenKey(keys[0]), Gen: NewGen()}, {Key: NamespaceGenKeyOf(keys[1]), Gen: NewGen()}}
	for _, err := range r.SetGens(testCtx(t), gs) {
		if err != nil {
			t.Fatal(err)
		}
	}
	srcs := make([]*memSource, len(ids))
	for i := range ids {
		srcs[i] = &memSource{payload: vals[i][HeaderSize:]}
		if err := p.Publish(ids[i], stamps[i], len(vals[i])-HeaderSize, srcs[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Flush(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	for result, want := range map[string]int{"published": 1, "stale": 2} {
		if n := count(m, result); n != want {
			t.Errorf("%s: %d, want %d", result, n, want)
		}
	}
	have := make([]Presence, len(keys))
	exists(testCtx(t), r, keys, have)
	for i, h := range have {
		if want := map[bool]Presence{true: Present, false: Absent}[i == 2]; h != want {
			t.Errorf("block %d in the store: %v, want %v", i, h, want)
		}
	}
	for i, s := range srcs {
		if n := s.released.Load(); n != 1 {
			t.Errorf("block %d released %d times", i, n)
		}
	}
}
