package offload

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// Invalidate and the remote tier. A block invalidated on this node is
// never loaded back from the store by this node: Invalidate fences its key
// (a namespace invalidated whole: the namespace) while it holds the index,
// so a Lookup does not offer it as REMOTE and a fetch in flight does not
// file it. It also reaches the store for every node: the publishes still
// queued for those keys are cancelled, and once the batches in flight have
// landed the keys are deleted from the store (a namespace invalidated whole
// is swept, in the background, by its key prefix).
//
// A delete that fails (a master down, slow, failing over) is kept and
// tried again every sweepRetry until it goes through: until then the
// master's copy is there for the other nodes, never for this one. Past
// maxPendingDeletes the namespace is swept whole instead. What the store
// held for the keys is gone for the other nodes once the delete (or the
// sweep) has gone through, unless a node publishes the block again (its
// own copy, when its engine stores it).
//
// A key's fence lifts when this node stores the key again (its engine
// computed the block anew) and its delete has gone through; stored again
// before that, the block is published once the delete has gone through (a
// publish before it would meet the old value, or be deleted with it). A
// namespace's fence lifts once a sweep that began after the invalidation
// has gone through every store node.
//
// With a disk tier, the deletes and sweeps still to go through are also
// kept on disk (remote_fences.go), written before Invalidate returns: a
// restarted node fences them again and resumes them.

// maxFencedKeys bounds the keys fenced one by one (about 100 bytes each).
// Past it a namespace is fenced and swept whole: more is invalidated in the
// store, never less.
const maxFencedKeys = 1 << 16

// maxPendingDeletes bounds the keys whose delete failed and is tried
// again (each also in the fences file, about 200 bytes). Past it the
// namespace is fenced and swept whole.
const maxPendingDeletes = 4096

// maxFencedNamespaces bounds the namespaces fenced whole whose sweep has
// not gone through yet; Invalidate of more whole namespaces is refused
// (ErrLimit) until sweeps go through.
const maxFencedNamespaces = 1024

// sweepRetry is how long a failed delete or sweep waits before the next try.
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
	store string // the key in the store
	// pending: its delete from the store has not gone through yet (the
	// first try runs, or it failed and is in fence.retry).
	pending bool
	// restored, while pending: this node stored the key again, in this
	// namespace; the fence lifts and the block is published once the
	// delete has gone through.
	restored *Namespace
	// gen is the fence generation of the key's latest invalidation: only
	// a delete sent for it (or later) ends pending.
	gen uint64
}

// nsFence is a namespace fenced whole.
type nsFence struct {
	gen uint64 // of its latest invalidation
	// prefixes are the key prefixes to sweep: the namespace's in this
	// node's keyspace, and in another one the node used before a restart
	// (a fence brought back from disk after the key file changed).
	prefixes []string
}

// fence is what this node must not read from the store, and what it still
// has to delete there.
type fence struct {
	n  atomic.Int64 // len(keys)+len(whole): the Lookup's fast path
	mu sync.Mutex
	// keys: fenced until this node stores them again and their delete
	// has gone through.
	keys map[fenceKey]*keyFence
	// whole: namespaces invalidated whole, by digest; fenced until a
	// sweep that began after their latest invalidation succeeds.
	whole map[[32]byte]*nsFence
	gen   uint64
	// retry: the keys whose delete failed, by store key, tried again by
	// the sweeper. Each is in keys (pending), or was brought back from
	// disk with its fence.
	retry map[string]fenceKey
	wake  chan struct{} // cap 1: the sweeper has work
	// version counts changes to what the fences file keeps (retry and
	// whole); saved is the version last written.
	version, saved uint64
}

func (f *fence) init() {
	f.keys = map[fenceKey]*keyFence{}
	f.whole = map[[32]byte]*nsFence{}
	f.retry = map[string]fenceKey{}
	f.wake = make(chan struct{}, 1)
}

func (f *fence) countLocked() { f.n.Store(int64(len(f.keys) + len(f.whole))) }

func (f *fence) kick() {
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// fenced reports whether this node must not read key k of ns from the store.
func (rt *remoteTier) fenced(ns *Namespace, k *index.Key) bool {
	f := &rt.fence
	if f.n.Load() == 0 {
		return false
	}
	d := rt.digest(ns)
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.whole[d]; ok {
		return true
	}
	_, ok := f.keys[fenceKey{ns: d, group: k.Group, hash: k.Hash}]
	return ok
}

// stored notes that this node has just stored key k again (the caller
// holds its index entry, ready). It reports whether the block may be
// published now: not while the delete of the value invalidated is still to
// go through (the fence then lifts and the block is published after it).
func (rt *remoteTier) stored(ns *Namespace, k *index.Key) bool {
	f := &rt.fence
	if f.n.Load() == 0 {
		return true
	}
	fk := fenceKey{ns: rt.digest(ns), group: k.Group, hash: k.Hash}
	f.mu.Lock()
	defer f.mu.Unlock()
	kf, ok := f.keys[fk]
	switch {
	case !ok:
		return true
	case kf.pending:
		kf.restored = ns
		return false
	}
	delete(f.keys, fk)
	f.countLocked()
	return true
}

// wholeLocked fences namespace d whole (its key fences and pending deletes
// go: the sweep covers them), to be swept by prefix p, and returns p.
func (rt *remoteTier) wholeLocked(d [32]byte, p string) string {
	f := &rt.fence
	f.gen++
	nf := f.whole[d]
	if nf == nil {
		nf = &nsFence{}
		f.whole[d] = nf
	}
	nf.gen = f.gen
	if !containsString(nf.prefixes, p) {
		nf.prefixes = append(nf.prefixes, p)
	}
	for k := range f.keys {
		if k.ns == d {
			delete(f.keys, k)
		}
	}
	for sk, k := range f.retry {
		if k.ns == d {
			delete(f.retry, sk)
		}
	}
	f.version++
	return p
}

func containsString(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// canFenceWhole refuses an Invalidate of namespaces whole when the sweeps
// still to go through would pass maxFencedNamespaces. A nil tier allows it.
func (rt *remoteTier) canFenceWhole(nss []*Namespace) error {
	if rt == nil {
		return nil
	}
	f := &rt.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	n := len(f.whole)
	for _, ns := range nss {
		if _, ok := f.whole[rt.digest(ns)]; !ok {
			n++
		}
	}
	if n > maxFencedNamespaces {
		return fmt.Errorf("%w: %d namespaces invalidated whole are still to be swept from the remote tier (at most %d); try again once the cluster answers",
			ErrLimit, len(f.whole), maxFencedNamespaces)
	}
	return nil
}

// remoteInval is what an Invalidate still has to do in the store once it
// has let go of the index.
type remoteInval struct {
	rt    *remoteTier
	keys  []string // store keys to delete
	fkeys []fenceKey
	gens  []uint64
}

// fenceInvalidated fences the invalidated keys (want; nil: the namespaces
// whole) and cancels their queued publishes. Invalidate calls it while it
// holds s.inval, after the index has lost the keys: a fetch files its block
// under s.inval (read), so it either comes before (and Invalidate removes
// it) or sees the fence. A nil tier does nothing.
func (rt *remoteTier) fenceInvalidated(nss []*Namespace, want map[index.Key]struct{}) *remoteInval {
	if rt == nil {
		return nil
	}
	inv := &remoteInval{rt: rt}
	var prefixes []string
	f := &rt.fence
	f.mu.Lock()
	if want == nil {
		for _, ns := range nss {
			d := rt.digest(ns)
			prefixes = append(prefixes, rt.wholeLocked(d, rt.ks.NamespacePrefix(d)))
		}
	} else {
		byID := make(map[uint32]*Namespace, len(nss))
		for _, ns := range nss {
			byID[ns.ID] = ns
		}
		for k := range want {
			ns := byID[k.NS]
			d := rt.digest(ns)
			if _, ok := f.whole[d]; ok {
				continue
			}
			fk := fenceKey{ns: d, group: k.Group, hash: k.Hash}
			f.gen++
			if kf := f.keys[fk]; kf != nil {
				// Fenced already: deleted again (it may have been
				// published again since), and a store since is undone.
				kf.pending, kf.restored, kf.gen = true, nil, f.gen
			} else {
				if len(f.keys) >= maxFencedKeys {
					rt.log.Warn("remote tier: too many keys invalidated one by one; the namespace is fenced and swept from the store whole",
						"namespace", ns.ID, "fenced_keys", len(f.keys))
					prefixes = append(prefixes, rt.wholeLocked(d, rt.ks.NamespacePrefix(d)))
					continue
				}
				f.keys[fk] = &keyFence{store: rt.ks.Key(rt.ident(ns, &k)), pending: true, gen: f.gen}
			}
			inv.keys = append(inv.keys, f.keys[fk].store)
			inv.fkeys = append(inv.fkeys, fk)
			inv.gens = append(inv.gens, f.gen)
		}
	}
	f.countLocked()
	f.mu.Unlock()
	if rt.pub != nil && (len(inv.keys) > 0 || len(prefixes) > 0) {
		set := make(map[string]struct{}, len(inv.keys))
		for _, k := range inv.keys {
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
	// Only now: the sweep's Barrier must come after the Cancel, or a batch
	// that took a block of the namespace from the queue in between could
	// land behind the sweep and outlive the fence.
	if len(prefixes) > 0 {
		f.kick()
	}
	return inv
}

// reach deletes the invalidated keys from the store, once the publish
// batches in flight (which may have read them before the fence) have
// landed: one round trip per store node, within the timeout. The keys it
// could not delete are tried again in the background; with a disk tier,
// they (and the namespaces to sweep) are on disk before it returns.
func (inv *remoteInval) reach() error {
	if inv == nil {
		return nil
	}
	rt := inv.rt
	if len(inv.keys) > 0 {
		if rt.pub != nil {
			rt.pub.Barrier()
		}
		ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
		errs := rt.store.Delete(ctx, inv.keys)
		cancel()
		rt.settleDeletes(inv.keys, inv.fkeys, inv.gens, errs, false)
	}
	return rt.saveFences()
}

// settleDeletes records how deletes of fenced keys went: a key deleted is
// no longer pending (its fence lifts if this node stored it again since,
// and the block is published); a key not deleted goes to the retry set
// (past its bound, its namespace is fenced and swept whole).
func (rt *remoteTier) settleDeletes(keys []string, fkeys []fenceKey, gens []uint64, errs []error, retried bool) {
	f := &rt.fence
	var republish []*Namespace
	var rkeys []fenceKey
	var firstErr error
	deleted, failed := 0, 0
	sweep := false
	f.mu.Lock()
	for i, sk := range keys {
		fk := fkeys[i]
		kf := f.keys[fk]
		if errs[i] == nil {
			deleted++
			if _, ok := f.retry[sk]; ok {
				delete(f.retry, sk)
				f.version++
			}
			if kf != nil && kf.store == sk && kf.gen <= gens[i] {
				kf.pending = false
				if kf.restored != nil {
					republish = append(republish, kf.restored)
					rkeys = append(rkeys, fk)
					delete(f.keys, fk)
				}
			}
			continue
		}
		failed++
		if firstErr == nil {
			firstErr = errs[i]
		}
		if _, ok := f.retry[sk]; ok {
			continue
		}
		if kf == nil || kf.store != sk || !kf.pending {
			continue // swept whole, or deleted by another try, meanwhile
		}
		if len(f.retry) >= maxPendingDeletes {
			rt.log.Warn("remote tier: too many deletes of invalidated blocks pending; the namespace is fenced and swept from the store whole",
				"pending", len(f.retry))
			rt.wholeLocked(fk.ns, nsPrefixOf(sk))
			sweep = true
			continue
		}
		f.retry[sk] = fk
		f.version++
	}
	pending := len(f.retry)
	f.countLocked()
	f.mu.Unlock()
	rt.m.Blocks.WithLabelValues("invalidate", "deleted").Add(float64(deleted))
	switch {
	case failed > 0 && !retried:
		rt.m.Blocks.WithLabelValues("invalidate", "error").Add(float64(failed))
		rt.log.Warn("remote tier: deleting invalidated blocks from the store failed; trying again until it goes through (other nodes may load them until then, this node does not)",
			"blocks", failed, "pending", pending, "err", firstErr)
	case deleted > 0 && retried:
		rt.log.Info("remote tier: invalidated blocks whose delete had failed are deleted from the store", "blocks", deleted, "still_pending", pending)
	}
	if failed > 0 || sweep {
		f.kick()
	}
	for i, ns := range republish {
		rt.republish(ns, rkeys[i])
	}
}

// retryDeletes tries the pending deletes again, one round trip per store
// node. It reports whether some remain.
func (rt *remoteTier) retryDeletes() bool {
	f := &rt.fence
	f.mu.Lock()
	keys := make([]string, 0, len(f.retry))
	fkeys := make([]fenceKey, 0, len(f.retry))
	gens := make([]uint64, 0, len(f.retry))
	for sk, fk := range f.retry {
		keys = append(keys, sk)
		fkeys = append(fkeys, fk)
		var gen uint64
		if kf := f.keys[fk]; kf != nil {
			gen = kf.gen
		}
		gens = append(gens, gen)
	}
	f.mu.Unlock()
	if len(keys) == 0 {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
	errs := rt.store.Delete(ctx, keys)
	cancel()
	rt.settleDeletes(keys, fkeys, gens, errs, true)
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.retry) > 0
}

// republish publishes a block this node stored again while the delete of
// its invalidated value was pending, now that the delete has gone
// through: from whatever CPU slot holds it now (none: not published).
func (rt *remoteTier) republish(ns *Namespace, fk fenceKey) {
	s := rt.s
	if rt.pub == nil || s.nsByID(ns.ID) != ns {
		return
	}
	k := index.Key{NS: ns.ID, Group: fk.group, Hash: fk.hash}
	payload := ns.Layout.PayloadBytes(k.Group)
	src := &publishSource{s: s, key: k, slot: index.NoSlot, n: payload}
	ready := false
	s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
		ready = found && e.State == index.Ready && e.CPU != index.NoSlot
		if ready && rt.write == WriteAll {
			if ready = s.cpu.Pin(e.CPU); ready {
				src.slot = e.CPU
			}
		}
		return found
	})
	if ready {
		rt.pub.Publish(rt.ident(ns, &k), int(payload), src)
	}
}

// sweeper tries the failed deletes again and sweeps the namespaces
// invalidated whole from the store, by key prefix, lifting their fences; a
// round with work left waits sweepRetry and tries again. It keeps the
// fences file up to date.
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
		again := rt.retryDeletes()
		if rt.sweep(ctx) {
			again = true
		}
		if ctx.Err() != nil {
			return
		}
		if err := rt.saveFences(); err != nil {
			rt.log.Warn("remote tier: could not update the fences file; it lists deletes that went through since (a restart tries them again)", "err", err)
		}
		if again {
			retry.Reset(sweepRetry)
		}
	}
}

// sweep sweeps every namespace fenced whole and lifts the fences of those
// whose sweep went through. It reports whether some failed.
func (rt *remoteTier) sweep(ctx context.Context) bool {
	f := &rt.fence
	type todo struct {
		d        [32]byte
		gen      uint64
		prefixes []string
	}
	f.mu.Lock()
	var todos []todo
	for d, nf := range f.whole {
		todos = append(todos, todo{d, nf.gen, append([]string(nil), nf.prefixes...)})
	}
	f.mu.Unlock()
	if len(todos) == 0 {
		return false
	}
	// A batch in flight may have read a block of the namespace before
	// its publishes were cancelled: it lands first.
	if rt.pub != nil {
		rt.pub.Barrier()
	}
	failed := false
	for _, t := range todos {
		ok := true
		total := 0
		for _, p := range t.prefixes {
			n, err := rt.store.DeletePrefix(ctx, p)
			total += n
			rt.m.Blocks.WithLabelValues("sweep", "deleted").Add(float64(n))
			if err != nil {
				if ctx.Err() != nil {
					return true
				}
				ok = false
				rt.log.Warn("remote tier: sweeping a namespace invalidated whole from the store failed; trying again",
					"prefix", p, "deleted", n, "err", err)
			}
		}
		if !ok {
			failed = true
			continue
		}
		f.mu.Lock()
		if nf := f.whole[t.d]; nf != nil && nf.gen == t.gen {
			delete(f.whole, t.d)
			f.version++
		}
		f.countLocked()
		f.mu.Unlock()
		rt.log.Info("remote tier: a namespace invalidated whole was swept from the store", "prefixes", t.prefixes, "deleted", total)
	}
	return failed
}

// RemoteFences reports the keys and the namespaces this node does not read
// from the remote tier because they were invalidated here (a namespace's
// until its sweep has gone through). Tests wait on it.
func (s *Service) RemoteFences() (keys, namespaces int) {
	if s.rem == nil {
		return 0, 0
	}
	f := &s.rem.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.keys), len(f.whole)
}

// RemotePendingDeletes reports the invalidated keys whose delete from the
// remote tier failed and is being tried again, and the namespaces
// invalidated whole whose sweep has not gone through yet.
func (s *Service) RemotePendingDeletes() (keys, namespaces int) {
	if s.rem == nil {
		return 0, 0
	}
	f := &s.rem.fence
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.retry), len(f.whole)
}
