package offload

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote/fence"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// The remote tier behind the local ones (DESIGN §9): a store shared by
// every node (Redis Cluster). Blocks a Store makes ready are published
// write-behind; a Lookup asks the store about the keys past its local
// prefix in one round trip per store node and offers those it holds as
// TierRemote; a Load fetches them into staging CPU slots, verifies each
// before a byte reaches the engine, and keeps it in the CPU tier if the
// policy admits it. Remote blocks are never pinned by a lease: one gone by
// load time is MISSING.

// WriteMode says which blocks a node publishes to the remote tier.
type WriteMode uint8

// Write modes.
const (
	// WriteAll publishes every block a Store makes ready. The publish
	// queue pins the block's CPU slot until it is sent, so an eviction in
	// between does not lose it.
	WriteAll WriteMode = iota
	// WriteKept publishes a stored block only if the CPU tier still
	// holds it when its turn in the queue comes: a block the local policy
	// evicted or declined by then is not sent.
	WriteKept
	// WriteNone publishes nothing: this node only reads the remote tier.
	WriteNone
)

// ParseWriteMode reads all, kept or none.
func ParseWriteMode(s string) (WriteMode, error) {
	switch s {
	case "all":
		return WriteAll, nil
	case "kept":
		return WriteKept, nil
	case "none":
		return WriteNone, nil
	}
	return 0, fmt.Errorf("%q: want all, kept or none", s)
}

// RemoteConfig adds the remote tier.
type RemoteConfig struct {
	Store remote.Store
	MAC   *remote.MAC // nil: values carry no MAC
	// Timeout bounds one round trip to the store (a Lookup's, one batch
	// of a Load's, a publish batch's).
	Timeout time.Duration
	Write   WriteMode
	// Queue bounds the blocks waiting to be published (default 256).
	Queue int
	// Fetchers are the goroutines that fetch loads' remote blocks
	// (default 4); Publishers publish (default 2).
	Fetchers, Publishers int
	// BatchBytes bounds the payload of one fetch round trip (default
	// 64 MiB): a large load is fetched in several.
	BatchBytes uint64
	// MaxLookupKeys bounds the keys one Lookup asks the store about, over
	// all its namespaces (default 8192: 8192 blocks of 16 tokens is a
	// 128k-token prompt); the prefix stops there.
	MaxLookupKeys int
	// StateDir, for a node without a disk tier, keeps the fences file
	// (the invalidations whose records are still to be written) so that
	// they outlive a restart; with a disk tier it is in every disk
	// directory. "" without a disk tier: a restart forgets them.
	StateDir string
}

// remoteTier is the service's side of the remote tier.
type remoteTier struct {
	s       *Service
	store   remote.Store
	mac     *remote.MAC
	ks      remote.Keyspace
	timeout time.Duration
	write   WriteMode
	batch   uint64
	maxAsks int
	pub     *remote.Publisher
	m       *remote.Metrics
	log     *slog.Logger

	fence *fence.Set // what this node must not read back, and the records it still has to write
	// stateDir keeps the fences file without a disk tier, locked while
	// the tier runs (nil: none).
	stateDir *fence.DirState

	fetches chan fetchReq
	wg      sync.WaitGroup // fetchers, the health checker and the stamp reads
	stop    chan struct{}
}

// remoteNS is a namespace's identity in the remote store, computed once.
type remoteNS struct {
	once   sync.Once
	digest [32]byte
}

// fetchReq is the remote blocks of one load.
type fetchReq struct {
	lj     *loadJob
	blocks []remoteRead
}

// remoteRead is a block of a load that no local tier holds.
type remoteRead struct {
	key index.Key
	i   int // position in the job
}

const fetchQueue = 4096

// healthEvery is how often the remote tier checks that every store node
// answers (for the kvoffload_remote_up metric and the log).
const healthEvery = 2 * time.Second

func (c *RemoteConfig) validate() error {
	if c.Store == nil || c.Timeout <= 0 {
		return errors.New("remote tier: a store and a positive timeout are required")
	}
	return nil
}

// openRemote starts the remote tier (its config validated by New). It
// fails only when the fences file cannot be read, or StateDir is another
// daemon's; the store is closed then.
func (s *Service) openRemote(cfg RemoteConfig, reg prometheus.Registerer) error {
	if cfg.Queue <= 0 {
		cfg.Queue = 256
	}
	if cfg.Fetchers <= 0 {
		cfg.Fetchers = 4
	}
	if cfg.BatchBytes == 0 {
		cfg.BatchBytes = 64 << 20
	}
	if cfg.MaxLookupKeys <= 0 {
		cfg.MaxLookupKeys = 8192
	}
	m := remote.NewMetrics(reg)
	rt := &remoteTier{
		s: s, mac: cfg.MAC, ks: remote.NewKeyspace(cfg.MAC), timeout: cfg.Timeout, write: cfg.Write,
		batch: cfg.BatchBytes, maxAsks: cfg.MaxLookupKeys, m: m, log: s.log, store: remote.Instrument(cfg.Store, m),
		fetches: make(chan fetchReq, fetchQueue), stop: make(chan struct{}),
	}
	if cfg.Write != WriteNone {
		rt.pub = remote.NewPublisher(remote.PublisherConfig{
			Store: rt.store, Keyspace: rt.ks, MAC: cfg.MAC, Queue: cfg.Queue, Workers: cfg.Publishers,
			Timeout: cfg.Timeout, Metrics: m, Logger: s.log,
			// This node's publish acknowledged: a router sees the block
			// as STORAGE/REMOTE (docs/events.md, The remote tier).
			Acked: func(src remote.Source) {
				if p, ok := src.(*publishSource); ok {
					s.ev.RemoteChanged(&p.key, true)
				}
			},
		})
	}
	fcfg := fence.Config{Store: rt.store, Keyspace: rt.ks, Timeout: cfg.Timeout, Metrics: m, Log: s.log}
	var ferr error
	switch {
	case s.disk != nil:
		fcfg.State = s.disk
	case cfg.StateDir != "":
		if rt.stateDir, ferr = fence.OpenDirState(cfg.StateDir); ferr == nil {
			fcfg.State = rt.stateDir
		}
	}
	if rt.pub != nil {
		fcfg.Cancel = rt.pub.Cancel
	}
	var fs *fence.Set
	if ferr == nil {
		fs, ferr = fence.Open(fcfg)
	}
	if ferr != nil {
		if rt.pub != nil {
			rt.pub.Close()
		}
		if rt.stateDir != nil {
			rt.stateDir.Close()
		}
		rt.store.Close()
		return ferr
	}
	rt.fence = fs
	if reg != nil {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvoffload_remote_publish_queue_depth", Help: "Blocks queued or in flight to be published to the remote tier.",
		}, func() float64 {
			if rt.pub == nil {
				return 0
			}
			return float64(rt.pub.Depth())
		}))
		pending := func(namespaces bool) func() float64 {
			return func() float64 {
				keys, nss := s.RemotePendingDeletes()
				if namespaces {
					return float64(nss)
				}
				return float64(keys)
			}
		}
		const help = "Invalidations on this node whose generation records are still to be written to the remote tier, tried again after 100 ms, then less often (at least every 2 s): kind=key, keys whose write failed; kind=namespace, namespaces invalidated whole. This node does not read them from the remote tier meanwhile; other nodes may."
		for kind, namespaces := range map[string]bool{"key": false, "namespace": true} {
			reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "kvoffload_remote_pending_deletes", Help: help, ConstLabels: prometheus.Labels{"kind": kind},
			}, pending(namespaces)))
		}
	}
	// A store that is down at start is a warning: the local tiers serve,
	// and every later call tries the store again.
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	err := rt.store.Ping(ctx)
	cancel()
	rt.setUp(err, true)
	rt.wg.Add(cfg.Fetchers + 1)
	for i := 0; i < cfg.Fetchers; i++ {
		go rt.fetcher()
	}
	go rt.health(err == nil)
	s.rem = rt
	return nil
}

func (rt *remoteTier) setUp(err error, first bool) {
	if err == nil {
		rt.m.Up.Set(1)
		rt.log.Info("remote tier: every store node answers", "keyspace", rt.ks.Prefix())
		return
	}
	rt.m.Up.Set(0)
	msg := "remote tier: the store does not answer; serving the local tiers and trying again"
	if first {
		msg = "remote tier: the store does not answer at start; serving the local tiers and trying again"
	}
	rt.log.Warn(msg, "err", err)
}

// health pings the store until the service closes, logging when it goes
// down or comes back. The tier does not wait for it: every batch tries the
// store anyway, so recovery needs nothing from here.
func (rt *remoteTier) health(up bool) {
	defer rt.wg.Done()
	t := time.NewTicker(healthEvery)
	defer t.Stop()
	for {
		select {
		case <-rt.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
		err := rt.store.Ping(ctx)
		cancel()
		if (err == nil) != up {
			up = err == nil
			rt.setUp(err, false)
		}
	}
}

// close stops the fetchers (no load is in flight by then), drops what is
// queued for publishing (releasing its pins) and closes the store.
func (rt *remoteTier) close() error {
	close(rt.stop)
	rt.wg.Wait()
	rt.fence.Close()
	if rt.stateDir != nil {
		rt.stateDir.Close() // after the fences file's last save
	}
	if rt.pub != nil {
		rt.pub.Close()
	}
	return rt.store.Close()
}

// digest is the namespace's identity in the store: its fingerprint and
// layout (remote.NamespaceDigest).
func (rt *remoteTier) digest(ns *Namespace) [32]byte {
	ns.remote.once.Do(func() {
		ns.remote.digest = remote.NamespaceDigest(ns.Fingerprint, layoutBytes(ns.Layout))
	})
	return ns.remote.digest
}

// layoutBytes is the layout's canonical encoding for the namespace digest.
func layoutBytes(l layout.Layout) []byte {
	b := []byte("hash_bytes=")
	b = strconv.AppendInt(b, int64(l.HashBytes), 10)
	for _, sg := range l.Segments {
		b = append(b, ";g"...)
		b = strconv.AppendUint(b, uint64(sg.Group), 10)
		b = append(b, '=')
		b = strconv.AppendUint(b, sg.Bytes, 10)
	}
	return b
}

func (rt *remoteTier) ident(ns *Namespace, k *index.Key) remote.Ident {
	return remote.Ident{NS: rt.digest(ns), Group: k.Group, Hash: k.Hash[:ns.Layout.HashBytes]}
}

// extendLookup continues a Lookup past its local prefix: the keys from
// res.Ready on are asked of the store (those no local tier holds, in every
// namespace) in one batch, one round trip per store node, and the prefix
// grows over every key each namespace holds locally or remotely. A key the
// store could not answer for ends the prefix, as a miss would.
func (rt *remoteTier) extendLookup(nss []*Namespace, keys Keys, n int, res *LookupResult) {
	from := res.Ready
	// One Lookup asks about at most MaxLookupKeys keys (over all its
	// namespaces): the prefix a remote check can add is bounded, and so
	// is the batch a client can make the daemon send.
	n = min(n, from+max(1, rt.maxAsks/len(nss)))
	if from >= n {
		return
	}
	hb := nss[0].Layout.HashBytes
	type ask struct{ i, j int }
	var asks []ask
	var names []string
	// local[i*len(nss)+j]: namespace j holds key i in a local tier.
	local := make([]Tier, (n-from)*len(nss))
	for i := from; i < n; i++ {
		hash := keys.Hashes[i*hb : (i+1)*hb]
		for j, ns := range nss {
			k := makeKey(ns.ID, keys.Group, hash)
			if e, found := rt.s.ix.Get(&k); found && e.Offerable() {
				local[(i-from)*len(nss)+j] = slowest(TierNone, 0, e)
				continue
			}
			if rt.fenced(ns, &k) {
				continue // invalidated here: a miss, not asked
			}
			asks = append(asks, ask{i, j})
			names = append(names, rt.ks.Key(rt.ident(ns, &k)))
		}
	}
	// Each key's header and generation records in one round trip per
	// store node: a value an invalidation made stale (on any node) is a
	// miss, not offered.
	remoteAt := make([]bool, len(local))
	failed := make([]bool, len(local))
	if len(names) > 0 {
		fs := make([]remote.Fetch, len(names))
		heads := make([]byte, len(names)*remote.HeaderSize)
		for a, name := range names {
			fs[a] = remote.Fetch{Key: name, Head: heads[a*remote.HeaderSize : (a+1)*remote.HeaderSize]}
		}
		ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
		if err := rt.store.Get(ctx, fs); err != nil {
			rt.log.Debug("remote tier: lookup: some keys unanswered", "err", err)
		}
		cancel()
		for a, q := range asks {
			ns := nss[q.j]
			hash := keys.Hashes[q.i*hb : (q.i+1)*hb]
			k := makeKey(ns.ID, keys.Group, hash)
			found, _, err := remote.CheckHead(&fs[a], rt.ident(ns, &k), ns.Layout.PayloadBytes(keys.Group), rt.mac)
			p := (q.i-from)*len(nss) + q.j
			switch {
			case err != nil:
				failed[p] = true
			case found:
				remoteAt[p] = true
			}
		}
	}
	hits, result := 0, "miss"
	for i := from; i < n; i++ {
		tier := TierNone
		ok := true
		for j := range nss {
			p := (i-from)*len(nss) + j
			here := local[p]
			switch {
			case remoteAt[p]:
				here = TierRemote
			case here == TierNone:
				ok = false
				if failed[p] {
					result = "error"
				}
			}
			if j == 0 || rank(here) < rank(tier) {
				tier = here
			}
		}
		if !ok {
			break
		}
		res.Ready++
		res.Tiers = append(res.Tiers, tier)
		if tier == TierRemote {
			hits++
		}
	}
	rt.m.Blocks.WithLabelValues("lookup", "hit").Add(float64(hits))
	if res.Ready < n {
		rt.m.Blocks.WithLabelValues("lookup", result).Inc()
	}
}

// fetch queues a load's remote blocks for the fetchers; a full queue fails
// them at once (the engine recomputes rather than waits).
func (rt *remoteTier) fetch(lj *loadJob, blocks []remoteRead) {
	select {
	case rt.fetches <- fetchReq{lj: lj, blocks: blocks}:
	default:
		rt.log.Warn("remote tier: the fetch queue is full; the blocks fail IO_ERROR", "blocks", len(blocks))
		for _, b := range blocks {
			lj.remoteDone(b, index.NoSlot, false, IOError)
		}
	}
}

func (rt *remoteTier) fetcher() {
	defer rt.wg.Done()
	for {
		select {
		case req := <-rt.fetches:
			rt.fetchLoad(req)
		case <-rt.stop:
			return
		}
	}
}

// fetchLoad fetches one load's remote blocks in batches of at most
// BatchBytes, each into staging CPU slots. A batch takes the slots it can;
// the blocks it settles and keeps in the CPU tier make the policy evict
// others, so the next batch finds slots again. Blocks no slot can be found
// for fail NO_SPACE.
func (rt *remoteTier) fetchLoad(req fetchReq) {
	lj := req.lj
	c := lj.r.ns.classes[lj.job.Keys.Group]
	payload := lj.r.ns.Layout.PayloadBytes(lj.job.Keys.Group)
	per := max(1, int(rt.batch/max(payload, 1)))
	// Taken before the fences are looked at: a block read from the store
	// is not filed if its key was invalidated here since (fetchBatch).
	start := rt.beginFetch()
	defer rt.endFetch(start)
	left := req.blocks[:0:0]
	for _, b := range req.blocks {
		if rt.fenced(lj.r.ns, &b.key) {
			rt.m.Blocks.WithLabelValues("load", Missing.String()).Inc()
			lj.remoteDone(b, index.NoSlot, false, Missing)
			continue
		}
		left = append(left, b)
	}
	if len(left) == 0 {
		return
	}
	c.Grow(min(len(left), per))
	for len(left) > 0 {
		var batch []remoteRead
		var staging []cpu.SlotID
		for len(left) > 0 && len(batch) < per {
			sl, ok := c.AllocStaging()
			if !ok {
				break
			}
			batch = append(batch, left[0])
			staging = append(staging, sl)
			left = left[1:]
		}
		if len(batch) == 0 {
			for _, b := range left {
				rt.m.Blocks.WithLabelValues("load", "no_space").Inc()
				lj.remoteDone(b, index.NoSlot, false, NoSpace)
			}
			return
		}
		rt.fetchBatch(lj, c, payload, batch, staging, start)
	}
}

// fetchBatch reads one batch of blocks from the store straight into their
// staging slots, verifies each, deletes corrupt values from the store,
// offers the good ones to the CPU tier's policy and settles every block.
func (rt *remoteTier) fetchBatch(lj *loadJob, c *slots.Class, payload uint64, batch []remoteRead, staging []cpu.SlotID, start uint64) {
	s, ns := rt.s, lj.r.ns
	fs := make([]remote.Fetch, len(batch))
	heads := make([]byte, len(batch)*remote.HeaderSize)
	for i, b := range batch {
		key := rt.ks.Key(rt.ident(ns, &b.key))
		fs[i] = remote.Fetch{
			Key:  key,
			Head: heads[i*remote.HeaderSize : (i+1)*remote.HeaderSize],
			Body: s.cpu.Slot(staging[i], layout.AlignUp(payload))[:payload],
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
	err := rt.store.Get(ctx, fs)
	cancel()
	if err != nil {
		rt.log.Debug("remote tier: load: some blocks unanswered", "err", err)
	}
	status := make([]Status, len(batch))
	var corrupt []string
	var gone []index.Key // found missing, or deleted below: gone from the remote tier
	var promote []index.Key
	inserted := make([]bool, len(batch))
	for i, b := range batch {
		found, verr := remote.CheckFetch(&fs[i], rt.ident(ns, &b.key), payload, rt.mac)
		switch {
		case verr != nil && errors.Is(verr, remote.ErrUnavailable):
			status[i] = IOError
		case !found:
			status[i] = Missing
			gone = append(gone, b.key)
		case errors.Is(verr, remote.ErrStale):
			// Written before an invalidation of its key or namespace
			// (on any node): garbage, never served.
			status[i] = Missing
			corrupt = append(corrupt, fs[i].Key)
			gone = append(gone, b.key)
			rt.m.Errors.WithLabelValues("verify", "stale").Inc()
		case verr != nil:
			status[i] = Corrupt
			corrupt = append(corrupt, fs[i].Key)
			gone = append(gone, b.key)
			rt.m.Errors.WithLabelValues("verify", remote.VerifyKind(verr)).Inc()
			rt.log.Warn("remote tier: a value failed verification; the block is reported CORRUPT and the value deleted from the store",
				"key", fs[i].Key, "registration", lj.r.ID, "job", lj.job.ID, "block_id", lj.job.BlockIDs[b.i], "err", verr)
		}
	}
	// Filed under s.inval (read): an Invalidate either comes after and
	// removes the entry, or has fenced the key since this fetch began and
	// the block is MISSING (tiers/remote/fence).
	s.inval.RLock()
	for i, b := range batch {
		if status[i] != OK {
			continue
		}
		if rt.fencedSince(ns, &b.key, start) {
			status[i] = Missing
			continue
		}
		// The block is whole and verified in its staging slot: it may
		// be offered now. Kept if the policy admits it.
		s.ix.Mutate(&b.key, func(e *index.Entry, found bool) bool {
			if found {
				return true // stored or fetched meanwhile: ours serves this load only
			}
			e.State, e.CPU, e.Flags = index.Ready, staging[i], index.Promoting
			inserted[i] = true
			return true
		})
		if inserted[i] {
			promote = append(promote, b.key)
		}
	}
	s.inval.RUnlock()
	if len(corrupt) > 0 {
		// Deleted before the job completes, so no node (this one
		// included) is offered the value again; a stale one is garbage.
		// A good value written under the key meanwhile goes too: it
		// costs a recompute, never a wrong block.
		ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
		if err := errors.Join(rt.store.Delete(ctx, corrupt)...); err != nil {
			rt.log.Warn("remote tier: deleting corrupt or stale values failed; another load will find them again", "err", err)
		}
		cancel()
	}
	for i := range gone {
		s.ev.RemoteChanged(&gone[i], false)
	}
	c.Admit(promote)
	for i, b := range batch {
		if status[i] == OK && inserted[i] {
			s.ix.Mutate(&b.key, func(e *index.Entry, found bool) bool {
				if !found || e.CPU != staging[i] {
					// Evicted or invalidated since: whoever removed
					// it released the slot; our pin keeps it until
					// the copy has drained.
					return found
				}
				if e.Flags&index.Promoting != 0 {
					e.Flags &^= index.Promoting // admitted: the CPU tier keeps it
					return true
				}
				// The policy declined it: the slot serves this load
				// only, and is freed when the copy has drained.
				s.cpu.Release(e.CPU)
				e.CPU = index.NoSlot
				return e.Holds()
			})
		}
		rt.m.Blocks.WithLabelValues("load", status[i].String()).Inc()
		if status[i] == OK {
			rt.m.Bytes.WithLabelValues("load").Add(float64(payload))
		}
		// A slot handed to the index is released by whoever removes the
		// entry; one that never was serves this load only.
		lj.remoteDone(b, staging[i], !inserted[i], status[i])
	}
}

// rank orders tiers by how fast a load from them is: a block counts at
// the slowest tier any namespace holds it in.
func rank(t Tier) int {
	return [...]int{TierNone: 0, TierRemote: 1, TierDisk: 2, TierCPU: 3, TierCPUAndDisk: 4}[t]
}

// storeStamps is the generation records of a Store's blocks, read (one
// round trip per store node, created where absent) while their copies run:
// the stamp each block is published with. The Store's jobs complete, and
// its result goes out, only once the read is done, so every Invalidate
// that begins after a Store returned writes its records after they were
// read: a block stored before an invalidation is stale after it, on every
// node, however late it is published (docs/remote.md, Invalidation).
type storeStamps struct {
	mu     sync.Mutex
	done   bool
	then   []func()
	stamps map[index.Key]remote.Stamp // those read
}

// readStamps starts the read of the stamps of the keys a Store claimed
// (by group). Nil without remote publishing, or with nothing to read.
func (rt *remoteTier) readStamps(ns *Namespace, keys [][]index.Key) *storeStamps {
	if rt == nil || rt.pub == nil {
		return nil
	}
	var ks []index.Key
	for _, g := range keys {
		ks = append(ks, g...)
	}
	if len(ks) == 0 {
		return nil
	}
	names := make([]string, len(ks))
	for i := range ks {
		names[i] = rt.ks.Key(rt.ident(ns, &ks[i]))
	}
	st := &storeStamps{}
	// Owned by the tier (close waits); bounded by the timeout, and by the
	// Stores in flight.
	rt.wg.Add(1)
	go func() {
		defer rt.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
		got, ok := remote.ReadStamps(ctx, rt.store, names)
		cancel()
		m := make(map[index.Key]remote.Stamp, len(ks))
		for i := range ks {
			if ok[i] {
				m[ks[i]] = got[i]
			}
		}
		st.mu.Lock()
		st.stamps, st.done = m, true
		then := st.then
		st.then = nil
		st.mu.Unlock()
		for _, f := range then {
			f()
		}
	}()
	return st
}

// after runs f once the stamps are read: at once if they are (or st is
// nil), else on the reading goroutine.
func (st *storeStamps) after(f func()) {
	if st != nil {
		st.mu.Lock()
		if !st.done {
			st.then = append(st.then, f)
			st.mu.Unlock()
			return
		}
		st.mu.Unlock()
	}
	f()
}

// of is k's stamp; false when it could not be read (nothing says which
// invalidations came before the block: it is not published).
func (st *storeStamps) of(k *index.Key) (remote.Stamp, bool) {
	if st == nil {
		return remote.Stamp{}, false
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	g, ok := st.stamps[*k]
	return g, ok
}

// publishStored hands a block a Store just made ready to the publisher,
// stamped with the records read while the Store ran. The caller still
// holds the store's pin on slot. A store that did not make the block
// ready (invalidated or dropped while its copy ran) publishes nothing, and
// neither does one of a key whose invalidation on this node is still to
// be recorded in the store (its stamp would be older than that record).
func (rt *remoteTier) publishStored(ns *Namespace, k index.Key, slot cpu.SlotID, stamps *storeStamps) {
	s := rt.s
	if rt.pub == nil {
		return
	}
	stamp, ok := stamps.of(&k)
	if !ok {
		rt.m.Blocks.WithLabelValues("publish", "error").Inc()
		return
	}
	payload := ns.Layout.PayloadBytes(k.Group)
	s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
		if !found || e.State != index.Ready {
			return found
		}
		// Under the entry's lock: an Invalidate drops the entry (under
		// this lock) before it fences the key and cancels its queued
		// publishes, so the item is queued before that Cancel (which then
		// cancels it) or belongs to a store after the Invalidate.
		if !rt.stored(ns, &k) || e.CPU != slot {
			return found
		}
		src := &publishSource{s: s, key: k, slot: index.NoSlot, n: payload}
		if rt.write == WriteAll {
			// Pinned while the entry names it, so it is in use; the
			// publisher unpins it when done. A slot at its pin
			// ceiling is not published.
			if !s.cpu.Pin(slot) {
				return found
			}
			src.slot = slot
		}
		rt.pub.Publish(rt.ident(ns, &k), stamp, int(payload), src)
		return found
	})
}

// publishSource reads a block for the publisher from its CPU slot: the one
// pinned at publish time (WriteAll), or whichever the block has when its
// turn comes (WriteKept).
type publishSource struct {
	s    *Service
	key  index.Key
	slot cpu.SlotID // pinned; NoSlot: look it up at Read
	n    uint64
}

func (p *publishSource) Read(dst []byte) bool {
	s := p.s
	slot := p.slot
	if slot == index.NoSlot {
		s.ix.Mutate(&p.key, func(e *index.Entry, found bool) bool {
			if found && e.State == index.Ready && e.CPU != index.NoSlot && s.cpu.Pin(e.CPU) {
				slot = e.CPU
			}
			return found
		})
		if slot == index.NoSlot {
			return false
		}
		defer s.cpu.Unpin(slot)
	}
	copy(dst, s.cpu.Slot(slot, layout.AlignUp(p.n))[:p.n])
	return true
}

func (p *publishSource) Release() {
	if p.slot != index.NoSlot {
		p.s.cpu.Unpin(p.slot)
		p.slot = index.NoSlot
	}
}

// remoteDone settles one remote block of a load: a good one joins the
// copies (its staging slot released after the copy unless the CPU tier
// keeps it), a failed one joins the failures and its staging slot goes.
func (lj *loadJob) remoteDone(b remoteRead, staging cpu.SlotID, release bool, st Status) {
	s := lj.r.s
	if st != OK && staging != index.NoSlot {
		s.cpu.Release(staging)
		s.cpu.Unpin(staging)
	}
	lj.mu.Lock()
	if st == OK {
		lj.refs = append(lj.refs, blockRef{key: b.key, slot: staging, i: b.i, release: release})
	} else {
		lj.res.Failures = append(lj.res.Failures, lj.r.failure(&lj.job, b.i, st))
	}
	lj.left--
	last := lj.left == 0
	lj.mu.Unlock()
	if last {
		lj.copy()
	}
}

// FlushRemote waits until every block queued for the remote tier has been
// published (or failed), or ctx ends. Tests and benchmarks use it to know
// what the store holds.
func (s *Service) FlushRemote(ctx context.Context) error {
	if s.rem == nil || s.rem.pub == nil {
		return nil
	}
	return s.rem.pub.Flush(ctx)
}

// remotePublishing is the blocks queued or in flight to the remote tier
// (they pin CPU slots with WriteAll).
func (s *Service) remotePublishing() int {
	if s.rem == nil || s.rem.pub == nil {
		return 0
	}
	return s.rem.pub.Depth()
}

// RemoteKey is the store key of a block of namespace nsID (docs/remote.md),
// false without a remote tier or for an unknown namespace.
func (s *Service) RemoteKey(nsID, group uint32, hash []byte) (string, bool) {
	ns := s.nsByID(nsID)
	if s.rem == nil || ns == nil || len(hash) != ns.Layout.HashBytes {
		return "", false
	}
	k := makeKey(nsID, group, hash)
	return s.rem.ks.Key(s.rem.ident(ns, &k)), true
}
