// Package fence holds the remote tier's invalidation state on one node
// (docs/remote.md, Invalidation): what the node must not read from the
// store until an invalidation's generation records are written (its
// fences), the record writes still to go through (tried again after
// 100 ms, then less often, at least every 2 s,
// and kept in the disk tier's fences file so that they outlive a
// restart), and the garbage sweeps of namespaces invalidated whole. The
// contract holds by generations, not by the order of deletes and writes:
// every value is stamped with the records read when its block was stored,
// and a reader (any node) refuses a value whose stamp is not what the
// records say now. An Invalidate writes new records: one per key (with the
// value's UNLINK behind it, on the same node), one per bucket of a
// namespace invalidated whole. Once those writes are acknowledged, nothing
// the store held or will receive from before is served to any node.
//
// Until a record's write is acknowledged the node fences the key (or the
// namespace): it neither offers nor loads it from the store. The service
// takes the fence while it holds its index (Invalidate), so a Lookup does
// not offer it and a fetch already in flight does not file it; the queued
// publishes of those keys are cancelled before the records are written. A
// fence whose record is written has done its work and goes as soon as no
// fetch that began before it is in flight (BeginFetch, EndFetch).
package fence

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

var (
	// ErrUnrecorded: some of an invalidation's generation records could
	// not be written (a master down, slow, failing over): other nodes
	// may load the blocks until a retry writes them.
	ErrUnrecorded = errors.New("invalidation not yet recorded in the remote tier")
	// ErrTooManyWhole: the namespaces invalidated whole whose records
	// are still to be written would pass their bound.
	ErrTooManyWhole = errors.New("too many namespaces invalidated whole still to be recorded")
)

// StateFile keeps a small file durably (the disk tier's state files, in
// every --disk-dir).
type StateFile interface {
	SaveState(name string, data []byte) error
	// LoadState returns every copy by path (none: no file).
	LoadState(name string) (map[string][]byte, error)
}

// Config shapes a Set.
type Config struct {
	Store    remote.Store
	Keyspace remote.Keyspace // this node's
	// Timeout bounds one round trip (a record write, a sweep's page).
	Timeout time.Duration
	Metrics *remote.Metrics
	Log     *slog.Logger
	// State keeps the record writes still to go through across restarts;
	// nil (no disk tier): a restart forgets them.
	State StateFile
	// Cancel keeps the queued publishes whose keys match from being sent
	// (remote.Publisher.Cancel); nil when the node publishes nothing.
	Cancel func(match func(key string) bool) int
}

// Set is one node's fences. Its sweeper goroutine runs from Open to Close.
type Set struct {
	cfg    Config
	f      fence
	saveMu sync.Mutex // orders the saves of the fences file
	stop   chan struct{}
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// Open brings the fences file back (an unreadable one is an error: the
// daemon must not start) and starts the sweeper.
func Open(cfg Config) (*Set, error) {
	s := &Set{cfg: cfg, stop: make(chan struct{})}
	s.f.init()
	if err := s.load(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.wg.Add(1)
	go s.sweeper(ctx)
	return s, nil
}

// Close stops the sweeper and saves the fences file. The store must still
// be open.
func (s *Set) Close() {
	close(s.stop)
	s.cancel()
	s.wg.Wait()
	// The sweeper may have stopped between a delete and its save.
	if err := s.save(); err != nil {
		s.cfg.Log.Warn("remote tier: could not update the fences file at close; it lists deletes that went through since (the next start tries them again)", "err", err)
	}
}

// maxPendingKeys bounds, per namespace, the keys whose generation record
// is still to be written (each also in the fences file, about 200 bytes).
// Past it that namespace is invalidated whole instead: more is invalidated,
// never less, and only in the namespace that passed it.
const maxPendingKeys = 4096

// maxLingering bounds the fences whose record is written but that a fetch
// begun before them still needs; past it they go and every fetch begun
// before the latest invalidation files nothing (its blocks serve the load
// only).
const maxLingering = 1 << 16

// maxFencedNamespaces bounds the namespaces invalidated whole whose record
// is still to be written; Invalidate of more whole namespaces is refused
// (ErrTooManyWhole) until they go through.
const maxFencedNamespaces = 1024

// maxSweeps bounds the namespaces whose garbage is still to be swept from
// the store; past it the oldest is left to the store's eviction.
const maxSweeps = 1024

// retryFirst is how long a failed record write or sweep waits before its
// next try; each try that leaves work doubles the wait, up to sweepRetry.
// A record write fails mostly for moments (a master failing over, a slot
// map reloading) while other nodes may load the block: the first retry
// comes soon; a master that stays down is not asked ten times a second.
const (
	retryFirst = 100 * time.Millisecond
	sweepRetry = 2 * time.Second
)

// Key is a key fenced on this node, by namespace digest: it outlives
// the namespace's id if the namespace is dropped and registered again.
type Key struct {
	NS    [32]byte // namespace digest
	Group uint32
	Hash  [32]byte // zero padded
}

// keyFence is the state of one fenced key.
type keyFence struct {
	store string // the value's key in the store
	// pending: its generation record is not written yet (the first try
	// runs, or it failed and is in fence.retry). Not pending: it lingers
	// for the fetches begun before it.
	pending bool
	// gen is the fence generation of the key's latest invalidation: only
	// a record written for it (or later) ends pending.
	gen uint64
}

// nsFence is a namespace invalidated whole.
type nsFence struct {
	gen uint64 // of its latest invalidation
	// pending are the keyspaces (their prefixes) whose copies of the
	// namespace's generation record (one per bucket) are still to be
	// written: this node's, or another one the node used before a
	// restart (brought back from disk after the key file changed).
	pending []string
}

// fence is what this node must not read from the store, and the
// generation records it still has to write there.
type fence struct {
	n  atomic.Int64 // len(keys)+len(whole): the fast path
	mu sync.Mutex
	// keys: pending, or lingering for a fetch in flight.
	keys map[Key]*keyFence
	// perNS counts the pending keys of each namespace (maxPendingKeys).
	perNS map[[32]byte]int
	// whole: namespaces invalidated whole, by digest; pending or
	// lingering like keys.
	whole map[[32]byte]*nsFence
	gen   uint64
	// floor: a fetch begun before it files nothing (lingering fences
	// were dropped past maxLingering).
	floor atomic.Uint64
	// retry: the keys whose record write failed, by value key, tried
	// again by the sweeper. Each is in keys (pending), or was brought
	// back from disk in another keyspace.
	retry map[string]Key
	// sweeps: namespace prefixes whose garbage the sweeper deletes;
	// swept: the masters each has been through (a failed round keeps
	// what it did).
	sweeps []string
	swept  map[string]*remote.Swept
	// fetching counts the fetches in flight by the gen they began at.
	fetching map[uint64]int
	wake     chan struct{} // cap 1: the sweeper has work
	// version counts changes to what the fences file keeps (the pending
	// records); saved is the version last written.
	version, saved uint64
}

func (f *fence) init() {
	f.keys = map[Key]*keyFence{}
	f.perNS = map[[32]byte]int{}
	f.whole = map[[32]byte]*nsFence{}
	f.retry = map[string]Key{}
	f.swept = map[string]*remote.Swept{}
	f.fetching = map[uint64]int{}
	f.wake = make(chan struct{}, 1)
}

func (f *fence) countLocked() { f.n.Store(int64(len(f.keys) + len(f.whole))) }

func (f *fence) kick() {
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// reapLocked drops the fences that have done their work (their record is
// written) and that no fetch in flight began before.
func (f *fence) reapLocked() {
	oldest := uint64(math.MaxUint64)
	for g := range f.fetching {
		oldest = min(oldest, g)
	}
	lingering := 0
	for k, kf := range f.keys {
		if !kf.pending {
			if kf.gen <= oldest {
				delete(f.keys, k)
			} else {
				lingering++
			}
		}
	}
	for d, nf := range f.whole {
		if len(nf.pending) == 0 {
			if nf.gen <= oldest {
				delete(f.whole, d)
			} else {
				lingering++
			}
		}
	}
	if lingering > maxLingering {
		for k, kf := range f.keys {
			if !kf.pending {
				delete(f.keys, k)
			}
		}
		for d, nf := range f.whole {
			if len(nf.pending) == 0 {
				delete(f.whole, d)
			}
		}
		f.floor.Store(f.gen + 1)
	}
	f.countLocked()
}

// pendingLocked counts the keys whose record is still to be written.
func (f *fence) pendingLocked() int {
	n := 0
	for _, c := range f.perNS {
		n += c
	}
	return n
}

// beginFetch notes a fetch beginning and returns the gen it began at.
func (s *Set) BeginFetch() uint64 {
	f := &s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fetching[f.gen]++
	return f.gen
}

// endFetch notes the fetch begun at gen g ended.
func (s *Set) EndFetch(g uint64) {
	f := &s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fetching[g]--; f.fetching[g] <= 0 {
		delete(f.fetching, g)
	}
	if f.n.Load() > 0 {
		f.reapLocked()
	}
}

// Fenced reports whether this node must not read key k from the store:
// its (or its namespace's) record is still to be written.
func (s *Set) Fenced(k *Key) bool {
	f := &s.f
	if f.n.Load() == 0 {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if nf, ok := f.whole[k.NS]; ok && len(nf.pending) > 0 {
		return true
	}
	kf, ok := f.keys[*k]
	return ok && kf.pending
}

// FencedSince reports whether a block of k a fetch begun at gen start read
// must not be filed: fenced now, or invalidated on this node since start
// (the fetch may have read it before the record was written).
func (s *Set) FencedSince(k *Key, start uint64) bool {
	f := &s.f
	if start < f.floor.Load() {
		return true
	}
	if f.n.Load() == 0 {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if nf, ok := f.whole[k.NS]; ok && (len(nf.pending) > 0 || nf.gen > start) {
		return true
	}
	kf, ok := f.keys[*k]
	return ok && (kf.pending || kf.gen > start)
}

// wholeLocked invalidates namespace d whole in keyspace ks (its prefix):
// its records there are to be written (its key fences go: the namespace's
// records cover them) and its garbage swept. It returns the records'
// writes.
func (s *Set) wholeLocked(d [32]byte, ks string) []remote.GenWrite {
	f := &s.f
	f.gen++
	nf := f.whole[d]
	if nf == nil {
		nf = &nsFence{}
		f.whole[d] = nf
	}
	nf.gen = f.gen
	if !containsString(nf.pending, ks) {
		nf.pending = append(nf.pending, ks)
	}
	for k, kf := range f.keys {
		if k.NS == d {
			if kf.pending {
				f.perNS[d]--
			}
			delete(f.keys, k)
		}
	}
	delete(f.perNS, d)
	for sk, k := range f.retry {
		if k.NS == d {
			delete(f.retry, sk)
		}
	}
	prefix := remote.KeyspaceOf(ks).NamespacePrefix(d)
	if !containsString(f.sweeps, prefix) {
		if len(f.sweeps) >= maxSweeps {
			delete(f.swept, f.sweeps[0])
			f.sweeps = f.sweeps[1:]
		}
		f.sweeps = append(f.sweeps, prefix)
	}
	f.swept[prefix] = &remote.Swept{} // invalidated again: every master again
	f.version++
	return nsWrites(d, ks)
}

// nsWrites are the writes of every copy of namespace d's generation
// record in keyspace ks, each with a new generation.
func nsWrites(d [32]byte, ks string) []remote.GenWrite {
	keys := remote.KeyspaceOf(ks).NamespaceGenKeys(d)
	ws := make([]remote.GenWrite, len(keys))
	for i, k := range keys {
		ws[i] = remote.GenWrite{Key: k, Gen: remote.NewGen()}
	}
	return ws
}

func containsString(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// CanFenceWhole refuses (ErrTooManyWhole) an Invalidate of the
// namespaces nss (digests) whole when the records still to be written
// would pass maxFencedNamespaces.
func (s *Set) CanFenceWhole(nss [][32]byte) error {
	f := &s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, nf := range f.whole {
		if len(nf.pending) > 0 {
			n++
		}
	}
	for _, d := range nss {
		if nf, ok := f.whole[d]; !ok || len(nf.pending) == 0 {
			n++
		}
	}
	if n > maxFencedNamespaces {
		return fmt.Errorf("%w: %d namespaces invalidated whole are still to be recorded in the remote tier (at most %d); try again once the cluster answers",
			ErrTooManyWhole, n-len(nss), maxFencedNamespaces)
	}
	return nil
}

// genWrite is one record write of an invalidation and what it settles:
// a key's record, or every copy of a namespace's (ws) in keyspace ks.
type genWrite struct {
	w   remote.GenWrite
	ws  []remote.GenWrite
	ks  string
	fk  Key      // a key's
	ns  [32]byte // a namespace's (whole)
	key bool
	gen uint64
}

// flatten lists the store writes of ws, and for each the write it is part of.
func flatten(ws []genWrite) ([]remote.GenWrite, []int) {
	var out []remote.GenWrite
	var of []int
	for i := range ws {
		if ws[i].key {
			out = append(out, ws[i].w)
			of = append(of, i)
			continue
		}
		for _, w := range ws[i].ws {
			out = append(out, w)
			of = append(of, i)
		}
	}
	return out, of
}

// joinErrs folds the errors of flattened writes back: one per write, the
// first error of its parts.
func joinErrs(n int, of []int, errs []error) []error {
	out := make([]error, n)
	for j, err := range errs {
		if out[of[j]] == nil {
			out[of[j]] = err
		}
	}
	return out
}

// Inval is what an Invalidate still has to do in the store once it has
// let go of the index (Reach).
type Inval struct {
	s      *Set
	writes []genWrite
}

// KeyRef is a key an Invalidate names: its fence key, its value's key in
// the store, and its namespace's id on this node (for the log).
type KeyRef struct {
	Key       Key
	Store     string
	Namespace uint32
}

// Invalidate fences the invalidated keys (or, with keys nil, the
// namespaces whole, by digest), cancels their queued publishes (Config.Cancel)
// and returns the generation records to write (Reach). The caller holds
// what keeps a fetch from filing a block meanwhile, after its index has
// lost the keys: a fetch files its block under it, so it either comes
// before (and the caller removes it) or sees the fence.
func (s *Set) Invalidate(whole [][32]byte, keys []KeyRef) *Inval {
	inv := &Inval{s: s}
	var prefixes, stores []string
	wholeNow := map[[32]byte]bool{}
	fenceWhole := func(d [32]byte) {
		wholeNow[d] = true
		ws := s.wholeLocked(d, s.cfg.Keyspace.Prefix())
		inv.writes = append(inv.writes, genWrite{ws: ws, ks: s.cfg.Keyspace.Prefix(), ns: d, gen: s.f.gen})
		prefixes = append(prefixes, s.cfg.Keyspace.NamespacePrefix(d))
	}
	f := &s.f
	f.mu.Lock()
	if keys == nil {
		for _, d := range whole {
			fenceWhole(d)
		}
	} else {
		for _, ref := range keys {
			d := ref.Key.NS
			if nf, ok := f.whole[d]; wholeNow[d] || ok && len(nf.pending) > 0 {
				// Invalidated whole, its records still to be written:
				// they cover the key. Tried again now, so that the call
				// answers for them (an error while they are missing).
				if !wholeNow[d] {
					wholeNow[d] = true
					for _, ks := range nf.pending {
						inv.writes = append(inv.writes, genWrite{ws: nsWrites(d, ks), ks: ks, ns: d, gen: nf.gen})
					}
				}
				continue
			}
			fk := ref.Key
			kf := f.keys[fk]
			if (kf == nil || !kf.pending) && (f.perNS[d] >= maxPendingKeys || f.pendingLocked() >= maxPendingTotal) {
				s.cfg.Log.Warn("remote tier: too many keys of one namespace invalidated with their records still to be written; the namespace is invalidated whole",
					"namespace", ref.Namespace, "pending_keys", f.perNS[d])
				fenceWhole(d)
				continue
			}
			f.gen++
			if kf == nil {
				kf = &keyFence{store: ref.Store}
				f.keys[fk] = kf
			}
			if !kf.pending {
				f.perNS[d]++
			}
			kf.pending, kf.gen = true, f.gen
			inv.writes = append(inv.writes, genWrite{
				w:  remote.GenWrite{Key: remote.GenKey(kf.store), Gen: remote.NewGen(), Unlink: kf.store},
				fk: fk, key: true, gen: f.gen,
			})
			stores = append(stores, kf.store)
		}
	}
	f.countLocked()
	f.mu.Unlock()
	if s.cfg.Cancel != nil && len(inv.writes) > 0 {
		set := make(map[string]struct{}, len(stores))
		for _, k := range stores {
			set[k] = struct{}{}
		}
		s.cfg.Cancel(func(key string) bool {
			if _, ok := set[key]; ok {
				return true
			}
			for _, p := range prefixes {
				if strings.HasPrefix(key, p) {
					return true
				}
			}
			return false
		})
	}
	if len(prefixes) > 0 {
		f.kick() // the garbage sweep
	}
	return inv
}

// Reach writes the invalidation's generation records (each key's with its
// value's UNLINK behind it), one round trip per store node, within the
// timeout: from their acknowledgement on, no node is served a value
// written before. Those that failed are tried again in the background;
// with a disk tier, they are on disk before it returns. It does not wait
// for the publish batches in flight: what they send after is stamped with
// the generations before and refused. unrecorded wraps
// ErrRemoteUnrecorded when some record was not written (other nodes may
// load those blocks until a retry writes it); err is the fences file's.
func (inv *Inval) Reach() (unrecorded, err error) {
	if inv == nil {
		return nil, nil
	}
	s := inv.s
	if len(inv.writes) > 0 {
		ws, of := flatten(inv.writes)
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
		errs := s.cfg.Store.SetGens(ctx, ws)
		cancel()
		failed, first := s.settleWrites(inv.writes, joinErrs(len(inv.writes), of, errs), false)
		if failed > 0 {
			unrecorded = fmt.Errorf("%w: %d of the invalidation's %d generation records could not be written (%w); this node does not load the blocks, other nodes may until a retry (after %v, then at least every %v, or this call again) writes them",
				ErrUnrecorded, failed, len(inv.writes), first, retryFirst, sweepRetry)
		}
	}
	return unrecorded, s.save()
}

// settleWrites records how record writes went: a key's written ends its
// pending (its fence lingers); one not written goes to the retry set (past
// its namespace's bound, the namespace is invalidated whole). A
// namespace's written ends its pending; one not written stays and is
// tried again. It returns how many were not written, and the first error.
func (s *Set) settleWrites(ws []genWrite, errs []error, retried bool) (failed int, first error) {
	f := &s.f
	var firstErr error
	written := 0
	f.mu.Lock()
	for i, w := range ws {
		if !w.key {
			nf := f.whole[w.ns]
			if errs[i] != nil {
				failed++
				firstErr = cmp(firstErr, errs[i])
				continue
			}
			written++
			if nf != nil && nf.gen <= w.gen {
				nf.pending = removeString(nf.pending, w.ks)
				f.version++
			}
			continue
		}
		sk := w.w.Unlink
		kf := f.keys[w.fk]
		if errs[i] == nil {
			written++
			if _, ok := f.retry[sk]; ok && (kf == nil || kf.gen <= w.gen) {
				delete(f.retry, sk)
				f.version++
			}
			if kf != nil && kf.store == sk && kf.pending && kf.gen <= w.gen {
				kf.pending = false
				f.perNS[w.fk.NS]--
			}
			continue
		}
		failed++
		firstErr = cmp(firstErr, errs[i])
		if _, ok := f.retry[sk]; ok {
			continue
		}
		if kf == nil || kf.store != sk || !kf.pending {
			continue // invalidated whole, or written by another try, meanwhile
		}
		f.retry[sk] = w.fk
		f.version++
	}
	pending := len(f.retry)
	for _, nf := range f.whole {
		if len(nf.pending) > 0 {
			pending++
		}
	}
	f.reapLocked()
	f.mu.Unlock()
	s.cfg.Metrics.Blocks.WithLabelValues("invalidate", "deleted").Add(float64(written))
	switch {
	case failed > 0 && !retried:
		s.cfg.Metrics.Blocks.WithLabelValues("invalidate", "error").Add(float64(failed))
		s.cfg.Log.Warn("remote tier: recording invalidated blocks in the store failed; trying again until it goes through (other nodes may load them until then, this node does not)",
			"records", failed, "pending", pending, "err", firstErr)
	case written > 0 && retried:
		s.cfg.Log.Info("remote tier: invalidations whose record had failed are recorded in the store", "records", written, "still_pending", pending)
	}
	if failed > 0 && !retried {
		f.kick() // the sweeper tries again (and then after retryFirst, ...)
	}
	return failed, firstErr
}

func cmp(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

func removeString(ss []string, s string) []string {
	out := ss[:0]
	for _, x := range ss {
		if x != s {
			out = append(out, x)
		}
	}
	return out
}

// retryWrites tries the pending record writes again, one round trip per
// store node. It reports whether some remain.
func (s *Set) retryWrites() bool {
	f := &s.f
	f.mu.Lock()
	var ws []genWrite
	for sk, fk := range f.retry {
		var gen uint64
		if kf := f.keys[fk]; kf != nil {
			gen = kf.gen
		}
		ws = append(ws, genWrite{w: remote.GenWrite{Key: remote.GenKey(sk), Gen: remote.NewGen(), Unlink: sk}, fk: fk, key: true, gen: gen})
	}
	for d, nf := range f.whole {
		for _, ks := range nf.pending {
			ws = append(ws, genWrite{ws: nsWrites(d, ks), ks: ks, ns: d, gen: nf.gen})
		}
	}
	f.mu.Unlock()
	if len(ws) == 0 {
		return false
	}
	gw, of := flatten(ws)
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
	errs := s.cfg.Store.SetGens(ctx, gw)
	cancel()
	s.settleWrites(ws, joinErrs(len(ws), of, errs), true)
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.retry) > 0 {
		return true
	}
	for _, nf := range f.whole {
		if len(nf.pending) > 0 {
			return true
		}
	}
	return false
}

// sweeper tries the failed record writes again and sweeps the garbage of
// the namespaces invalidated whole from the store, by key prefix; a round
// with work left waits (retryFirst, doubling to sweepRetry) and tries
// again; new work (a failed write, a namespace to sweep) starts the wait
// over. It keeps the fences file up to date.
func (s *Set) sweeper(ctx context.Context) {
	defer s.wg.Done()
	f := &s.f
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	delay := retryFirst
	for {
		select {
		case <-s.stop:
			return
		case <-f.wake:
			delay = retryFirst
		case <-retry.C:
		}
		again := s.retryWrites()
		if s.sweep(ctx) {
			again = true
		}
		if ctx.Err() != nil {
			return
		}
		if err := s.save(); err != nil {
			s.cfg.Log.Warn("remote tier: could not update the fences file; it lists records written since (a restart writes them again)", "err", err)
		}
		if again {
			retry.Reset(delay)
			delay = min(2*delay, sweepRetry)
		} else {
			delay = retryFirst
		}
	}
}

// sweep deletes the garbage of the namespaces invalidated whole (what the
// store still holds under their prefixes). It is garbage collection only:
// the namespace's record already makes every value there stale, so a key a
// resharding hid from the sweep costs memory, never a wrong block. It
// reports whether some sweep failed (tried again later).
func (s *Set) sweep(ctx context.Context) bool {
	f := &s.f
	f.mu.Lock()
	todo := append([]string(nil), f.sweeps...)
	done := make([]*remote.Swept, len(todo))
	for i, p := range todo {
		done[i] = f.swept[p]
	}
	f.mu.Unlock()
	failed := false
	for i, p := range todo {
		n, err := s.cfg.Store.DeletePrefix(ctx, p, done[i])
		s.cfg.Metrics.Blocks.WithLabelValues("sweep", "deleted").Add(float64(n))
		if err != nil {
			if ctx.Err() != nil {
				return true
			}
			failed = true
			s.cfg.Log.Warn("remote tier: sweeping the garbage of a namespace invalidated whole failed; trying again (the masters it went through are not scanned again)",
				"prefix", p, "deleted", n, "masters_done", done[i].Len(), "err", err)
			continue
		}
		f.mu.Lock()
		if f.swept[p] == done[i] { // not invalidated again meanwhile
			f.sweeps = removeString(f.sweeps, p)
			delete(f.swept, p)
		}
		f.mu.Unlock()
		s.cfg.Log.Info("remote tier: the garbage of a namespace invalidated whole was swept from the store", "prefix", p, "deleted", n)
	}
	return failed
}

// Counts reports the keys and the namespaces this node does not read from
// the store because they were invalidated here and their generation
// records are not written yet (or a fetch begun before still needs their
// fence).
func (s *Set) Counts() (keys, namespaces int) {
	f := &s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.keys), len(f.whole)
}

// Pending reports the invalidated keys whose generation record is still
// to be written (their first try failed), and the namespaces invalidated
// whole whose records are.
func (s *Set) Pending() (keys, namespaces int) {
	f := &s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, nf := range f.whole {
		if len(nf.pending) > 0 {
			namespaces++
		}
	}
	return len(f.retry), namespaces
}

// Sweeps reports the namespaces whose garbage is still to be swept from
// the store.
func (s *Set) Sweeps() int {
	f := &s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.sweeps)
}
