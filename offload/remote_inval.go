package offload

import (
	"context"
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
// is swept, in the background, by its key prefix). What the store held for
// them is gone for the other nodes too, unless a node publishes the block
// again (its own copy, when its engine stores it). A key's fence lifts when
// this node stores the key again: its engine computed the block anew. A
// namespace's lifts once a sweep that began after the invalidation has
// gone through every store node; until then this node reads nothing of it
// from the store. Fences live in memory: after a restart, only the deletes
// remain.

// maxFencedKeys bounds the keys fenced one by one (about 100 bytes each).
// Past it a namespace is fenced and swept whole: more is invalidated in the
// store, never less.
const maxFencedKeys = 1 << 16

// sweepRetry is how long a failed sweep waits before the next try.
const sweepRetry = 2 * time.Second

// fenceKey is a key fenced on this node, by namespace digest: it outlives
// the namespace's id if the namespace is dropped and registered again.
type fenceKey struct {
	ns    [32]byte
	group uint32
	hash  [32]byte
}

// fence is what this node must not read from the store.
type fence struct {
	n  atomic.Int64 // len(keys)+len(whole): the Lookup's fast path
	mu sync.Mutex
	// keys: fenced until this node stores them again.
	keys map[fenceKey]struct{}
	// whole: namespaces invalidated whole, by digest, with the
	// generation of their latest invalidation; fenced until a sweep that
	// began after it succeeds.
	whole map[[32]byte]uint64
	gen   uint64
	wake  chan struct{} // cap 1: a sweep is wanted
}

func (f *fence) init() {
	f.keys = map[fenceKey]struct{}{}
	f.whole = map[[32]byte]uint64{}
	f.wake = make(chan struct{}, 1)
}

func (f *fence) countLocked() { f.n.Store(int64(len(f.keys) + len(f.whole))) }

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

// unfence lifts key k's fence: this node has just stored it again.
func (rt *remoteTier) unfence(ns *Namespace, k *index.Key) {
	f := &rt.fence
	if f.n.Load() == 0 {
		return
	}
	d := rt.digest(ns)
	f.mu.Lock()
	delete(f.keys, fenceKey{ns: d, group: k.Group, hash: k.Hash})
	f.countLocked()
	f.mu.Unlock()
}

// remoteInval is what an Invalidate still has to do in the store once it
// has let go of the index.
type remoteInval struct {
	rt   *remoteTier
	keys []string // store keys to delete
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
	wholeNS := func(d [32]byte) {
		f.gen++
		f.whole[d] = f.gen
		for k := range f.keys {
			if k.ns == d {
				delete(f.keys, k)
			}
		}
		prefixes = append(prefixes, rt.ks.NamespacePrefix(d))
	}
	if want == nil {
		for _, ns := range nss {
			wholeNS(rt.digest(ns))
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
			if len(f.keys) >= maxFencedKeys {
				rt.log.Warn("remote tier: too many keys invalidated one by one; the namespace is fenced and swept from the store whole",
					"namespace", ns.ID, "fenced_keys", len(f.keys))
				wholeNS(d)
				continue
			}
			f.keys[fenceKey{ns: d, group: k.Group, hash: k.Hash}] = struct{}{}
			inv.keys = append(inv.keys, rt.ks.Key(rt.ident(ns, &k)))
		}
	}
	f.countLocked()
	f.mu.Unlock()
	if len(prefixes) > 0 {
		select {
		case f.wake <- struct{}{}:
		default:
		}
	}
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
	return inv
}

// reach deletes the invalidated keys from the store, once the publish
// batches in flight (which may have read them before the fence) have
// landed: one round trip per store node, within the timeout. A node that
// fails keeps its copies for the other nodes; this node's fence holds.
func (inv *remoteInval) reach() {
	if inv == nil || len(inv.keys) == 0 {
		return
	}
	rt := inv.rt
	if rt.pub != nil {
		rt.pub.Barrier()
	}
	ctx, cancel := context.WithTimeout(context.Background(), rt.timeout)
	err := rt.store.Delete(ctx, inv.keys)
	cancel()
	if err != nil {
		rt.m.Blocks.WithLabelValues("invalidate", "error").Add(float64(len(inv.keys)))
		rt.log.Warn("remote tier: deleting invalidated blocks from the store failed; other nodes may still load them, this node does not",
			"blocks", len(inv.keys), "err", err)
		return
	}
	rt.m.Blocks.WithLabelValues("invalidate", "deleted").Add(float64(len(inv.keys)))
}

// sweeper deletes the namespaces invalidated whole from the store, by key
// prefix, and lifts their fences; a sweep that fails is tried again.
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
		f.mu.Lock()
		todo := make(map[[32]byte]uint64, len(f.whole))
		for d, gen := range f.whole {
			todo[d] = gen
		}
		f.mu.Unlock()
		if len(todo) == 0 {
			continue
		}
		// A batch in flight may have read a block of the namespace
		// before its publishes were cancelled: it lands first.
		if rt.pub != nil {
			rt.pub.Barrier()
		}
		failed := false
		for d, gen := range todo {
			n, err := rt.store.DeletePrefix(ctx, rt.ks.NamespacePrefix(d))
			rt.m.Blocks.WithLabelValues("sweep", "deleted").Add(float64(n))
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				failed = true
				rt.log.Warn("remote tier: sweeping a namespace invalidated whole from the store failed; trying again",
					"prefix", rt.ks.NamespacePrefix(d), "deleted", n, "err", err)
				continue
			}
			f.mu.Lock()
			if f.whole[d] == gen {
				delete(f.whole, d)
			}
			f.countLocked()
			f.mu.Unlock()
			rt.log.Info("remote tier: a namespace invalidated whole was swept from the store", "prefix", rt.ks.NamespacePrefix(d), "deleted", n)
		}
		if failed {
			retry.Reset(sweepRetry)
		}
	}
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
