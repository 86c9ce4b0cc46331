package remote

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"
)

// Source is a block waiting to be published: the publisher reads its
// payload when it gets to it, then releases it (its owner may hold the
// block's memory until then).
type Source interface {
	// Read copies the block's payload into dst, which is exactly the
	// payload's length, and reports false when the block is gone.
	Read(dst []byte) bool
	// Release is called exactly once, after the last Read.
	Release()
}

// PublisherConfig shapes a publisher.
type PublisherConfig struct {
	Store    Store
	Keyspace Keyspace
	MAC      *MAC // nil: open values
	// Queue bounds the blocks waiting; past it Publish drops (default 1024).
	Queue int
	// Workers publish batches in parallel (default 2).
	Workers int
	// Batch bounds the blocks of one round trip (default 32) and
	// BatchBytes their payload (default 64 MiB): what a worker holds in
	// memory at once.
	Batch      int
	BatchBytes int
	// Timeout bounds each round trip to the store.
	Timeout time.Duration
	Metrics *Metrics
	Logger  *slog.Logger
	// Acked, if set, is told each block the store acknowledged holding
	// after this publisher's look or SET (published, or found there
	// already), unless its item was cancelled: it is called with the
	// publisher's lock held, so a Cancel that returns has seen every Acked
	// call it did not prevent, and none of the blocks it cancelled is
	// acked after. It must not block or call the Publisher. The Source has
	// been released by then; only its identity is of use.
	Acked func(src Source)
}

// Publisher is the write-behind queue: Publish never waits, a full queue
// drops (and counts), a block queued or in flight is not queued twice, and
// a block the store already holds is not sent again. A batch costs two
// round trips: a look at what the store holds (each block's header and
// its generation records), then the SETs (NX: another writer's value is
// never overwritten; one found stale is replaced). Its workers run until
// Close.
//
// Each block comes with its Stamp: the generation records its owner read
// when the block was stored (ReadStamps), before the store was reported
// done. The value is stamped with that, not with what the look reads: a
// look that finds the records changed since means an invalidation (on any
// node) came after the block was stored, and the block is not sent
// (stale); one that finds them unchanged sends it with the stamp, which
// any invalidation after the look makes stale wherever and whenever the
// SET lands. Stamped with what the look read, a block stored before an
// invalidation and published after it would be current (docs/remote.md,
// Invalidation).
type Publisher struct {
	cfg   PublisherConfig
	queue chan pubItem
	stop  chan struct{}
	wg    sync.WaitGroup
	bufs  sync.Pool // *[]byte value buffers

	// batching is held (read) by each worker over a batch: Barrier takes
	// it to wait for the batches in flight.
	batching sync.RWMutex

	mu struct {
		sync.Mutex
		// pending is the latest item of each key queued or in flight.
		// An item cancelled since may still be queued behind a newer one
		// of the same key: n counts them all.
		pending map[string]*pubState
		n       int
		closed  bool
		idle    chan struct{} // closed and replaced when n drops to 0
	}
}

type pubItem struct {
	key   string
	id    Ident
	hash  [MaxHashLen]byte
	stamp Stamp // the records read when the block was stored
	size  int
	src   Source
	state *pubState
}

// pubState is one queued item's: cancelled under Publisher.mu.
type pubState struct{ cancelled bool }

// NewPublisher starts the workers.
func NewPublisher(cfg PublisherConfig) *Publisher {
	if cfg.Queue <= 0 {
		cfg.Queue = 1024
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 2
	}
	if cfg.Batch <= 0 {
		cfg.Batch = 32
	}
	if cfg.BatchBytes <= 0 {
		cfg.BatchBytes = 64 << 20
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	p := &Publisher{cfg: cfg, queue: make(chan pubItem, cfg.Queue), stop: make(chan struct{})}
	p.mu.pending = map[string]*pubState{}
	p.mu.idle = make(chan struct{})
	close(p.mu.idle)
	p.wg.Add(cfg.Workers)
	for i := 0; i < cfg.Workers; i++ {
		go p.worker()
	}
	return p
}

// Publish queues a block of size payload bytes, stamped st (the
// generation records read when it was stored: ReadStamps). It never waits: a block
// already queued or in flight is released at once (duplicate), and so is
// one that finds the queue full (dropped, ErrQueueFull). A block whose
// queued item was cancelled (invalidated) is queued again: the item
// cancelled holds the invalidated bytes and is not sent, this one is.
func (p *Publisher) Publish(id Ident, st Stamp, size int, src Source) error {
	it := pubItem{id: id, stamp: Stamp{Key: st.Key, NS: st.NS}, size: size, src: src, state: &pubState{}}
	copy(it.hash[:], id.Hash)
	it.key = p.cfg.Keyspace.Key(id)
	m := p.cfg.Metrics.Blocks
	p.mu.Lock()
	if p.mu.closed {
		p.mu.Unlock()
		src.Release()
		m.WithLabelValues("publish", "dropped").Inc()
		return ErrQueueFull
	}
	if st, dup := p.mu.pending[it.key]; dup && !st.cancelled {
		p.mu.Unlock()
		src.Release()
		m.WithLabelValues("publish", "duplicate").Inc()
		return nil
	}
	select {
	case p.queue <- it:
	default:
		p.mu.Unlock()
		src.Release()
		m.WithLabelValues("publish", "dropped").Inc()
		return ErrQueueFull
	}
	if p.mu.n == 0 {
		p.mu.idle = make(chan struct{})
	}
	p.mu.n++
	p.mu.pending[it.key] = it.state
	p.mu.Unlock()
	return nil
}

// Depth is the number of blocks queued or in flight.
func (p *Publisher) Depth() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mu.n
}

// Flush waits until every block queued so far has been published (or
// failed), or ctx ends. Tests and benchmarks use it to know what the store
// holds.
func (p *Publisher) Flush(ctx context.Context) error {
	p.mu.Lock()
	idle := p.mu.idle
	p.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Cancel keeps the blocks queued or in flight whose keys match from being
// published (a block invalidated on this node), unless their payload has
// been read already: Barrier waits for those. It returns how many matched.
// A block published after it is queued anew.
func (p *Publisher) Cancel(match func(key string) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for k, st := range p.mu.pending {
		if !st.cancelled && match(k) {
			st.cancelled = true
			n++
		}
	}
	return n
}

// Barrier waits until every batch in flight when it was called has ended
// (each is bounded by two round trips' timeouts). After Cancel then
// Barrier, no cancelled block is sent any more: one whose payload was read
// before the Cancel has reached the store (or failed) by then.
func (p *Publisher) Barrier() {
	p.batching.Lock()
	p.batching.Unlock() // nothing to guard: waiting for the holders is the point
}

// ack tells Acked that the store holds it (the item's block), unless it was
// cancelled (under mu: see PublisherConfig.Acked).
func (p *Publisher) ack(it *pubItem) {
	if p.cfg.Acked == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !it.state.cancelled {
		p.cfg.Acked(it.src)
	}
}

func (p *Publisher) cancelled(it *pubItem) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return it.state.cancelled
}

// Close stops the workers after their batch in flight and releases the
// blocks still queued (not published). It may be called more than once.
func (p *Publisher) Close() {
	p.mu.Lock()
	if p.mu.closed {
		p.mu.Unlock()
		return
	}
	p.mu.closed = true
	p.mu.Unlock()
	close(p.stop)
	p.wg.Wait()
	for {
		select {
		case it := <-p.queue:
			it.src.Release()
			p.done(&it)
			p.cfg.Metrics.Blocks.WithLabelValues("publish", "dropped").Inc()
		default:
			return
		}
	}
}

// done ends an item: the key leaves pending unless a newer item of it
// is queued.
func (p *Publisher) done(it *pubItem) {
	p.mu.Lock()
	if p.mu.pending[it.key] == it.state {
		delete(p.mu.pending, it.key)
	}
	p.mu.n--
	if p.mu.n == 0 {
		close(p.mu.idle)
	}
	p.mu.Unlock()
}

func (p *Publisher) worker() {
	defer p.wg.Done()
	batch := make([]pubItem, 0, p.cfg.Batch)
	for {
		// Stopping wins over a queue that is not empty: Close drops
		// what is left rather than wait for it.
		select {
		case <-p.stop:
			return
		default:
		}
		select {
		case it := <-p.queue:
			batch = append(batch[:0], it)
		case <-p.stop:
			return
		}
		bytes := batch[0].size
	fill:
		for len(batch) < p.cfg.Batch && bytes < p.cfg.BatchBytes {
			select {
			case it := <-p.queue:
				batch = append(batch, it)
				bytes += it.size
			default:
				break fill
			}
		}
		p.batching.RLock()
		p.publish(batch)
		p.batching.RUnlock()
		clear(batch)
	}
}

// publish sends one batch: a look at what the store holds and at the
// generation records, then the SETs of the blocks the store does not hold
// (current) and whose records are still those of their stamps, each value
// assembled with one copy (the block's payload read into place behind its
// header) and stamped with its item's stamp.
func (p *Publisher) publish(batch []pubItem) {
	m := p.cfg.Metrics
	defer func() {
		for i := range batch {
			p.done(&batch[i])
		}
	}()
	fs := make([]Fetch, len(batch))
	heads := make([]byte, len(batch)*HeaderSize)
	for i := range batch {
		fs[i] = Fetch{Key: batch[i].key, Head: heads[i*HeaderSize : (i+1)*HeaderSize]}
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Timeout)
	err := p.cfg.Store.Get(ctx, fs)
	cancel()
	var items []Item
	var sent []int
	var bufs []*[]byte
	for i := range batch {
		it := &batch[i]
		id := it.id
		id.Hash = it.hash[:len(id.Hash)]
		found, stale, cerr := CheckHead(&fs[i], id, uint64(it.size), p.cfg.MAC)
		switch {
		case found:
			m.Blocks.WithLabelValues("publish", "exists").Inc()
			it.src.Release()
			p.ack(it)
			continue
		case cerr != nil:
			// Not known what the store holds: not worth a blind
			// SET of megabytes into a failing node.
			m.Blocks.WithLabelValues("publish", "error").Inc()
			it.src.Release()
			continue
		case !it.stamp.Current(fs[i].Gen, fs[i].NSGen):
			// Invalidated (on some node) since it was stored, or
			// its record lost: these bytes are not to be shared.
			m.Blocks.WithLabelValues("publish", "stale").Inc()
			it.src.Release()
			continue
		}
		if p.cancelled(it) {
			m.Blocks.WithLabelValues("publish", "cancelled").Inc()
			it.src.Release()
			continue
		}
		buf := p.buf(HeaderSize + it.size)
		ok := it.src.Read((*buf)[HeaderSize:])
		it.src.Release()
		if !ok {
			p.bufs.Put(buf)
			m.Blocks.WithLabelValues("publish", "gone").Inc()
			continue
		}
		st := Stamp{Key: it.stamp.Key, NS: it.stamp.NS, Write: rand.Uint64()}
		if err := EncodeHeader(*buf, id, st, p.cfg.MAC); err != nil {
			p.bufs.Put(buf)
			m.Blocks.WithLabelValues("publish", "error").Inc()
			p.cfg.Logger.Error("remote tier: a block could not be encoded", "err", err)
			continue
		}
		items = append(items, Item{Key: it.key, Value: *buf, Replace: stale})
		sent = append(sent, i)
		bufs = append(bufs, buf)
	}
	if err != nil {
		p.cfg.Logger.Debug("remote tier: publish: the look at the store failed for some blocks", "err", err)
	}
	if len(items) == 0 {
		return
	}
	ctx, cancel = context.WithTimeout(context.Background(), p.cfg.Timeout)
	errs := p.cfg.Store.Set(ctx, items)
	cancel()
	var first error
	for j, i := range sent {
		switch {
		case errs[j] != nil:
			m.Blocks.WithLabelValues("publish", "error").Inc()
			first = errors.Join(first, errs[j])
		case items[j].Kept:
			m.Blocks.WithLabelValues("publish", "exists").Inc()
			p.ack(&batch[i])
		default:
			m.Blocks.WithLabelValues("publish", "published").Inc()
			m.Bytes.WithLabelValues("publish").Add(float64(batch[i].size))
			p.ack(&batch[i])
		}
	}
	for _, b := range bufs {
		p.bufs.Put(b)
	}
	if first != nil {
		p.cfg.Logger.Debug("remote tier: publish: SET failed for some blocks", "err", first)
	}
}

// buf returns a value buffer of n bytes from the pool.
func (p *Publisher) buf(n int) *[]byte {
	if b, _ := p.bufs.Get().(*[]byte); b != nil && cap(*b) >= n {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n)
	return &b
}

// ReadStamps reads the generation records of the values keys (creating
// them where absent), in one round trip per store node under ctx: the
// stamps blocks stored now carry when they are published. ok[i] is false
// for a key the store could not answer for (such a block is not
// published: nothing says which invalidations came before it).
func ReadStamps(ctx context.Context, s Store, keys []string) (stamps []Stamp, ok []bool) {
	fs := make([]Fetch, len(keys))
	for i, k := range keys {
		fs[i] = Fetch{Key: k, CreateGen: true}
	}
	s.Get(ctx, fs) // per key: fs[i].Err
	stamps, ok = make([]Stamp, len(keys)), make([]bool, len(keys))
	for i := range fs {
		if fs[i].Err == nil && fs[i].Gen != 0 && fs[i].NSGen != 0 {
			stamps[i], ok[i] = Stamp{Key: fs[i].Gen, NS: fs[i].NSGen}, true
		}
	}
	return stamps, ok
}
