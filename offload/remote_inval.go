package offload

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// Invalidate and the remote tier (docs/remote.md, Invalidation). The
// contract holds by generations, not by the order of deletes and writes:
// every block and every namespace has a generation record in the store,
// every value is stamped with the records its publisher read, and a reader
// (any node) refuses a value whose stamp is not what the records say now.
// An Invalidate writes new records: one per key invalidated (with the
// value's UNLINK behind it, on the same node), one per namespace
// invalidated whole. Once those writes are acknowledged, nothing the store
// held or will receive from before (a publish still queued or in flight, a
// SET that timed out and lands later, a key a resharding hid from a sweep)
// is served to any node: it is garbage, deleted when a load meets it, by
// the namespace's sweep, or by the store's eviction.
//
// Until a record's write is acknowledged the node fences the key (or the
// namespace): it neither offers nor loads it from the store. The fence is
// taken while the Invalidate holds the index, so a Lookup does not offer it
// and a fetch already in flight does not file it; the queued publishes of
// those keys are cancelled before the records are written. A write that
// fails (a master down, slow, failing over) is kept and tried again every
// sweepRetry until it goes through; with a disk tier it is also kept on
// disk (remote_fences.go) before Invalidate returns, so a restarted node
// fences the key again and writes the record. A fence whose record is
// written has done its work and goes as soon as no fetch that began before
// it is in flight.

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
// (ErrLimit) until they go through.
const maxFencedNamespaces = 1024

// maxSweeps bounds the namespaces whose garbage is still to be swept from
// the store; past it the oldest is left to the store's eviction.
const maxSweeps = 1024

// sweepRetry is how long a failed record write or sweep waits before the
// next try.
const sweepRetry = 2 * time.Second

// fenceKey is a key fenced on this node, by namespace digest: it outlives
// the namespace's id if the namespace is dropped and registered again.
type fenceKey struct {
	ns    [32]byte
	group uint32
	hash  [32]byte
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
	keys map[fenceKey]*keyFence
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
	retry map[string]fenceKey
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
	f.keys = map[fenceKey]*keyFence{}
	f.perNS = map[[32]byte]int{}
	f.whole = map[[32]byte]*nsFence{}
	f.retry = map[string]fenceKey{}
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
func (rt *remoteTier) beginFetch() uint64 {
	f := &rt.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fetching[f.gen]++
	return f.gen
}

// endFetch notes the fetch begun at gen g ended.
func (rt *remoteTier) endFetch(g uint64) {
	f := &rt.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fetching[g]--; f.fetching[g] <= 0 {
		delete(f.fetching, g)
	}
	if f.n.Load() > 0 {
		f.reapLocked()
	}
}

// fenced reports whether this node must not read key k of ns from the
// store: its (or its namespace's) record is still to be written.
func (rt *remoteTier) fenced(ns *Namespace, k *index.Key) bool {
	f := &rt.fence
	if f.n.Load() == 0 {
		return false
	}
	d := rt.digest(ns)
	f.mu.Lock()
	defer f.mu.Unlock()
	if nf, ok := f.whole[d]; ok && len(nf.pending) > 0 {
		return true
	}
	kf, ok := f.keys[fenceKey{ns: d, group: k.Group, hash: k.Hash}]
	return ok && kf.pending
}

// fencedSince reports whether a block of k a fetch begun at gen start read
// must not be filed: fenced now, or invalidated on this node since start
// (the fetch may have read it before the record was written).
func (rt *remoteTier) fencedSince(ns *Namespace, k *index.Key, start uint64) bool {
	f := &rt.fence
	if start < f.floor.Load() {
		return true
	}
	if f.n.Load() == 0 {
		return false
	}
	d := rt.digest(ns)
	f.mu.Lock()
	defer f.mu.Unlock()
	if nf, ok := f.whole[d]; ok && (len(nf.pending) > 0 || nf.gen > start) {
		return true
	}
	kf, ok := f.keys[fenceKey{ns: d, group: k.Group, hash: k.Hash}]
	return ok && (kf.pending || kf.gen > start)
}

// stored reports whether a block of key k this node has just stored (the
// caller holds its index entry, ready) may be published: not while its
// key's or namespace's record is still to be written. Its stamp, read
// while the Store ran, predates that record: the block stays local (a
// store after the record is written publishes).
func (rt *remoteTier) stored(ns *Namespace, k *index.Key) bool {
	return !rt.fenced(ns, k)
}

// wholeLocked invalidates namespace d whole in keyspace ks (its prefix):
// its records there are to be written (its key fences go: the namespace's
// records cover them) and its garbage swept. It returns the records'
// writes.
func (rt *remoteTier) wholeLocked(d [32]byte, ks string) []remote.GenWrite {
	f := &rt.fence
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
		if k.ns == d {
			if kf.pending {
				f.perNS[d]--
			}
			delete(f.keys, k)
		}
	}
	delete(f.perNS, d)
	for sk, k := range f.retry {
		if k.ns == d {
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

// canFenceWhole refuses an Invalidate of namespaces whole when the records
// still to be written would pass maxFencedNamespaces. A nil tier allows it.
func (rt *remoteTier) canFenceWhole(nss []*Namespace) error {
	if rt == nil {
		return nil
	}
	f := &rt.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, nf := range f.whole {
		if len(nf.pending) > 0 {
			n++
		}
	}
	for _, ns := range nss {
		if nf, ok := f.whole[rt.digest(ns)]; !ok || len(nf.pending) == 0 {
			n++
		}
	}
	if n > maxFencedNamespaces {
		return fmt.Errorf("%w: %d namespaces invalidated whole are still to be recorded in the remote tier (at most %d); try again once the cluster answers",
			ErrLimit, n-len(nss), maxFencedNamespaces)
	}
	return nil
}

// genWrite is one record write of an invalidation and what it settles:
// a key's record, or every copy of a namespace's (ws) in keyspace ks.
type genWrite struct {
	w   remote.GenWrite
	ws  []remote.GenWrite
	ks  string
	fk  fenceKey // a key's
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

// remoteInval is what an Invalidate still has to do in the store once it
// has let go of the index.
type remoteInval struct {
	rt     *remoteTier
	writes []genWrite
}

// fenceInvalidated fences the invalidated keys (want; nil: the namespaces
// whole), cancels their queued publishes and returns the generation
// records to write. Invalidate calls it while it holds s.inval, after the
// index has lost the keys: a fetch files its block under s.inval (read), so
// it either comes before (and Invalidate removes it) or sees the fence. A
// nil tier does nothing.
func (rt *remoteTier) fenceInvalidated(nss []*Namespace, want map[index.Key]struct{}) *remoteInval {
	if rt == nil {
		return nil
	}
	inv := &remoteInval{rt: rt}
	var prefixes, keys []string
	wholeNow := map[[32]byte]bool{}
	whole := func(d [32]byte) {
		wholeNow[d] = true
		ws := rt.wholeLocked(d, rt.ks.Prefix())
		inv.writes = append(inv.writes, genWrite{ws: ws, ks: rt.ks.Prefix(), ns: d, gen: rt.fence.gen})
		prefixes = append(prefixes, rt.ks.NamespacePrefix(d))
	}
	f := &rt.fence
	f.mu.Lock()
	if want == nil {
		for _, ns := range nss {
			whole(rt.digest(ns))
		}
	} else {
		byID := make(map[uint32]*Namespace, len(nss))
		for _, ns := range nss {
			byID[ns.ID] = ns
		}
		for k := range want {
			ns := byID[k.NS]
			d := rt.digest(ns)
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
			fk := fenceKey{ns: d, group: k.Group, hash: k.Hash}
			kf := f.keys[fk]
			if (kf == nil || !kf.pending) && (f.perNS[d] >= maxPendingKeys || f.pendingLocked() >= maxPendingTotal) {
				rt.log.Warn("remote tier: too many keys of one namespace invalidated with their records still to be written; the namespace is invalidated whole",
					"namespace", ns.ID, "pending_keys", f.perNS[d])
				whole(d)
				continue
			}
			f.gen++
			if kf == nil {
				kf = &keyFence{store: rt.ks.Key(rt.ident(ns, &k))}
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
			keys = append(keys, kf.store)
		}
	}
	f.countLocked()
	f.mu.Unlock()
	if rt.pub != nil && len(inv.writes) > 0 {
		set := make(map[string]struct{}, len(keys))
		for _, k := range keys {
			set[k] = struct{}{}
		}
		rt.pub.Cancel(func(key string) bool {
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
	// After the Cancel: no acknowledgement of a publish it cancelled is
	// reported after these (remote.PublisherConfig.Acked). A namespace
	// invalidated whole is reported by the Invalidate's reset, which ends
	// after this too.
	for k := range want {
		rt.s.ev.RemoteChanged(&k, false)
	}
	if len(prefixes) > 0 {
		f.kick() // the garbage sweep
	}
	return inv
}

// reach writes the invalidation's generation records (each key's with its
// value's UNLINK behind it), one round trip per store node, within the
// timeout: from their acknowledgement on, no node is served a value
// written before. Those that failed are tried again in the background;
// with a disk tier, they are on disk before it returns. It does not wait
// for the publish batches in flight: what they send after is stamped with
// the generations before and refused. unrecorded wraps
// ErrRemoteUnrecorded when some record was not written (other nodes may
// load those blocks until a retry writes it); err is the fences file's.
func (inv *remoteInval) reach() (unrecorded, err error) {
	if inv == nil {
		return nil, nil
	}
	rt := inv.rt
	if len(inv.writes) > 0 {
		ws, of := flatten(inv.writes)
		ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
		errs := rt.store.SetGens(ctx, ws)
		cancel()
		failed, first := rt.settleWrites(inv.writes, joinErrs(len(inv.writes), of, errs), false)
		if failed > 0 {
			unrecorded = fmt.Errorf("%w: %d of the invalidation's %d generation records could not be written (%w); this node does not load the blocks, other nodes may until a retry (every %v, or this call again) writes them",
				ErrRemoteUnrecorded, failed, len(inv.writes), first, sweepRetry)
		}
	}
	return unrecorded, rt.saveFences()
}

// settleWrites records how record writes went: a key's written ends its
// pending (its fence lingers); one not written goes to the retry set (past
// its namespace's bound, the namespace is invalidated whole). A
// namespace's written ends its pending; one not written stays and is
// tried again. It returns how many were not written, and the first error.
func (rt *remoteTier) settleWrites(ws []genWrite, errs []error, retried bool) (failed int, first error) {
	f := &rt.fence
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
				f.perNS[w.fk.ns]--
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
	rt.m.Blocks.WithLabelValues("invalidate", "deleted").Add(float64(written))
	switch {
	case failed > 0 && !retried:
		rt.m.Blocks.WithLabelValues("invalidate", "error").Add(float64(failed))
		rt.log.Warn("remote tier: recording invalidated blocks in the store failed; trying again until it goes through (other nodes may load them until then, this node does not)",
			"records", failed, "pending", pending, "err", firstErr)
	case written > 0 && retried:
		rt.log.Info("remote tier: invalidations whose record had failed are recorded in the store", "records", written, "still_pending", pending)
	}
	if failed > 0 && !retried {
		f.kick() // the sweeper tries again (and then every sweepRetry)
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
func (rt *remoteTier) retryWrites() bool {
	f := &rt.fence
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
	ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
	errs := rt.store.SetGens(ctx, gw)
	cancel()
	rt.settleWrites(ws, joinErrs(len(ws), of, errs), true)
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
// with work left waits sweepRetry and tries again. It keeps the fences file
// up to date.
func (rt *remoteTier) sweeper(ctx context.Context) {
	defer rt.wg.Done()
	f := &rt.fence
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	for {
		select {
		case <-rt.stop:
			return
		case <-f.wake:
		case <-retry.C:
		}
		again := rt.retryWrites()
		if rt.sweep(ctx) {
			again = true
		}
		if ctx.Err() != nil {
			return
		}
		if err := rt.saveFences(); err != nil {
			rt.log.Warn("remote tier: could not update the fences file; it lists records written since (a restart writes them again)", "err", err)
		}
		if again {
			retry.Reset(sweepRetry)
		}
	}
}

// sweep deletes the garbage of the namespaces invalidated whole (what the
// store still holds under their prefixes). It is garbage collection only:
// the namespace's record already makes every value there stale, so a key a
// resharding hid from the sweep costs memory, never a wrong block. It
// reports whether some sweep failed (tried again later).
func (rt *remoteTier) sweep(ctx context.Context) bool {
	f := &rt.fence
	f.mu.Lock()
	todo := append([]string(nil), f.sweeps...)
	done := make([]*remote.Swept, len(todo))
	for i, p := range todo {
		done[i] = f.swept[p]
	}
	f.mu.Unlock()
	failed := false
	for i, p := range todo {
		n, err := rt.store.DeletePrefix(ctx, p, done[i])
		rt.m.Blocks.WithLabelValues("sweep", "deleted").Add(float64(n))
		if err != nil {
			if ctx.Err() != nil {
				return true
			}
			failed = true
			rt.log.Warn("remote tier: sweeping the garbage of a namespace invalidated whole failed; trying again (the masters it went through are not scanned again)",
				"prefix", p, "deleted", n, "masters_done", done[i].Len(), "err", err)
			continue
		}
		f.mu.Lock()
		if f.swept[p] == done[i] { // not invalidated again meanwhile
			f.sweeps = removeString(f.sweeps, p)
			delete(f.swept, p)
		}
		f.mu.Unlock()
		rt.log.Info("remote tier: the garbage of a namespace invalidated whole was swept from the store", "prefix", p, "deleted", n)
	}
	return failed
}

// RemoteFences reports the keys and the namespaces this node does not read
// from the remote tier because they were invalidated here and their
// generation records are not written yet (or a fetch begun before still
// needs their fence). Tests wait on it.
func (s *Service) RemoteFences() (keys, namespaces int) {
	if s.rem == nil {
		return 0, 0
	}
	f := &s.rem.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.keys), len(f.whole)
}

// RemotePendingDeletes reports the invalidated keys whose generation
// record is still to be written to the remote tier (their first try
// failed), and the namespaces invalidated whole whose record is.
func (s *Service) RemotePendingDeletes() (keys, namespaces int) {
	if s.rem == nil {
		return 0, 0
	}
	f := &s.rem.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, nf := range f.whole {
		if len(nf.pending) > 0 {
			namespaces++
		}
	}
	return len(f.retry), namespaces
}

// RemoteSweeps reports the namespaces whose garbage is still to be swept
// from the remote tier.
func (s *Service) RemoteSweeps() int {
	if s.rem == nil {
		return 0
	}
	f := &s.rem.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.sweeps)
}
