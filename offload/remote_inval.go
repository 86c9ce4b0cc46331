package offload

import (
	"fmt"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote/fence"
)

// Invalidate and the remote tier (docs/remote.md, Invalidation): the
// node's fences, the generation records still to be written and the
// garbage sweeps are tiers/remote/fence's. This is the service's side of
// that seam: it names keys by namespace digest, and calls the fences from
// the paths that must respect them (a Lookup does not offer a fenced key,
// a fetch does not file one, a Store does not publish one).

// fenceKey is k's key in the fences.
func (rt *remoteTier) fenceKey(ns *Namespace, k *index.Key) fence.Key {
	return fence.Key{NS: rt.digest(ns), Group: k.Group, Hash: k.Hash}
}

// fenced reports whether this node must not read key k of ns from the
// store: its (or its namespace's) record is still to be written.
func (rt *remoteTier) fenced(ns *Namespace, k *index.Key) bool {
	fk := rt.fenceKey(ns, k)
	return rt.fence.Fenced(&fk)
}

// fencedSince reports whether a block of k a fetch begun at gen start read
// must not be filed: fenced now, or invalidated on this node since start.
func (rt *remoteTier) fencedSince(ns *Namespace, k *index.Key, start uint64) bool {
	fk := rt.fenceKey(ns, k)
	return rt.fence.FencedSince(&fk, start)
}

// beginFetch notes a fetch beginning and returns the gen it began at.
func (rt *remoteTier) beginFetch() uint64 { return rt.fence.BeginFetch() }

// endFetch notes the fetch begun at gen g ended.
func (rt *remoteTier) endFetch(g uint64) { rt.fence.EndFetch(g) }

// stored reports whether a block of key k this node has just stored (the
// caller holds its index entry, ready) may be published: not while its
// key's or namespace's record is still to be written. Its stamp, read
// while the Store ran, predates that record: the block stays local (a
// store after the record is written publishes).
func (rt *remoteTier) stored(ns *Namespace, k *index.Key) bool {
	return !rt.fenced(ns, k)
}

// canFenceWhole refuses an Invalidate of namespaces whole when the records
// still to be written would pass their bound (ErrLimit). A nil tier allows
// it.
func (rt *remoteTier) canFenceWhole(nss []*Namespace) error {
	if rt == nil {
		return nil
	}
	ds := make([][32]byte, len(nss))
	for i, ns := range nss {
		ds[i] = rt.digest(ns)
	}
	if err := rt.fence.CanFenceWhole(ds); err != nil {
		return fmt.Errorf("%w: %w", ErrLimit, err)
	}
	return nil
}

// fenceInvalidated fences the invalidated keys (want; nil: the namespaces
// whole), cancels their queued publishes and returns the generation
// records to write. Invalidate calls it while it holds s.inval, after the
// index has lost the keys: a fetch files its block under s.inval (read), so
// it either comes before (and Invalidate removes it) or sees the fence. A
// nil tier does nothing.
func (rt *remoteTier) fenceInvalidated(nss []*Namespace, want map[index.Key]struct{}) *fence.Inval {
	if rt == nil {
		return nil
	}
	var inv *fence.Inval
	if want == nil {
		ds := make([][32]byte, len(nss))
		for i, ns := range nss {
			ds[i] = rt.digest(ns)
		}
		inv = rt.fence.Invalidate(ds, nil)
	} else {
		byID := make(map[uint32]*Namespace, len(nss))
		for _, ns := range nss {
			byID[ns.ID] = ns
		}
		refs := make([]fence.KeyRef, 0, len(want))
		for k := range want {
			ns := byID[k.NS]
			refs = append(refs, fence.KeyRef{Key: rt.fenceKey(ns, &k), Store: rt.ks.Key(rt.ident(ns, &k)), Namespace: ns.ID})
		}
		inv = rt.fence.Invalidate(nil, refs)
	}
	// After the Cancel: no acknowledgement of a publish it cancelled is
	// reported after these (remote.PublisherConfig.Acked). A namespace
	// invalidated whole is reported by the Invalidate's reset, which ends
	// after this too.
	for k := range want {
		rt.s.ev.RemoteChanged(&k, false)
	}
	return inv
}

// RemoteFences reports the keys and the namespaces this node does not read
// from the remote tier because they were invalidated here and their
// generation records are not written yet (or a fetch begun before still
// needs their fence). Tests wait on it.
func (s *Service) RemoteFences() (keys, namespaces int) {
	if s.rem == nil {
		return 0, 0
	}
	return s.rem.fence.Counts()
}

// RemotePendingDeletes reports the invalidated keys whose generation
// record is still to be written to the remote tier (their first try
// failed), and the namespaces invalidated whole whose record is.
func (s *Service) RemotePendingDeletes() (keys, namespaces int) {
	if s.rem == nil {
		return 0, 0
	}
	return s.rem.fence.Pending()
}

// RemoteSweeps reports the namespaces whose garbage is still to be swept
// from the remote tier.
func (s *Service) RemoteSweeps() int {
	if s.rem == nil {
		return 0
	}
	return s.rem.fence.Sweeps()
}
