package offload

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"

	"github.com/zeebo/xxh3"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// Durable invalidation marks. Invalidate erases the disk copy the index
// names, but a block's bytes can lie in other slots too, and would come
// back at the next start: a copy the index let go of without erasing it (a
// disk eviction, a chunk moving to another slot size, a read that failed
// with the bytes intact, an older copy recovery declined), or the named
// copy itself when the daemon is killed before its erase lands. So
// Invalidate also records, in the disk tier's catalog and durably before
// it returns, a mark per key (or per namespace, invalidated whole): the
// disk tier's write clock once the index has let go of the keys
// (disk.Tier.WriteClock). Recovery erases every copy of a marked key
// written before its mark; a copy written after (the key stored again) is
// kept. Once a recovery has looked at every chunk, the marks of earlier
// runs have done their work and go.

// maxKeyMarks bounds the keys marked one by one in one namespace (about
// 100 bytes of catalog each). Past it further keys go into the namespace's
// filter.
const maxKeyMarks = 1024

// The filter: the keys marked past maxKeyMarks, as a Bloom filter of
// filterBits bits (8 KiB of catalog, 11 KB as JSON) with filterHashes
// hashes and one clock, the newest of its keys' marks. A block of a key
// the filter has, written before that clock, is erased: the keys that
// collide with the filter's (about 2% at its fullest) and the blocks of
// its keys stored again before the newest mark are erased too. More is
// erased than was invalidated, never less, and routine invalidations do not
// cost the namespace's whole disk cache. Past maxFilterKeys the namespace
// is marked whole.
const (
	filterBits    = 1 << 16
	filterHashes  = 4
	maxFilterKeys = 8192
)

// markKey is a key within its namespace.
type markKey struct {
	group uint32
	hash  [32]byte
}

// marks are a namespace's invalidation marks, guarded by Service.marksMu.
type marks struct {
	all  uint64             // every block written before it is invalidated
	keys map[markKey]uint64 // the key's blocks written before it
	// filter (filterBits/8 bytes, nil: none) holds filterKeys keys whose
	// blocks written before filterBefore are invalidated.
	filter       []byte
	filterKeys   int
	filterBefore uint64
}

// keyMark is a key's mark as the catalog keeps it.
type keyMark struct {
	Group  uint32 `json:"group"`
	Hash   []byte `json:"hash"`
	Before uint64 `json:"before"`
}

// marksMeta are the fields namespaceMeta carries for the marks.
type marksMeta struct {
	InvalidatedBefore uint64    `json:"invalidated_before,omitempty"`
	Invalidated       []keyMark `json:"invalidated,omitempty"`
	// The filter; JSON encodes the bytes as base64.
	InvalidatedFilter       []byte `json:"invalidated_filter,omitempty"`
	InvalidatedFilterKeys   int    `json:"invalidated_filter_keys,omitempty"`
	InvalidatedFilterBefore uint64 `json:"invalidated_filter_before,omitempty"`
}

func (m *marks) meta() marksMeta {
	out := marksMeta{InvalidatedBefore: m.all, InvalidatedFilter: m.filter, InvalidatedFilterKeys: m.filterKeys, InvalidatedFilterBefore: m.filterBefore}
	for k, before := range m.keys {
		h := k.hash // the whole 32 bytes: a hash may end in zeros
		out.Invalidated = append(out.Invalidated, keyMark{Group: k.group, Hash: h[:], Before: before})
	}
	sort.Slice(out.Invalidated, func(i, j int) bool {
		a, b := out.Invalidated[i], out.Invalidated[j]
		return a.Group < b.Group || a.Group == b.Group && string(a.Hash) < string(b.Hash)
	})
	return out
}

// decodeMarks reads the marks of a catalog entry.
func decodeMarks(b []byte) (marks, error) {
	var m marksMeta
	if err := json.Unmarshal(b, &m); err != nil {
		return marks{}, err
	}
	out := marks{all: m.InvalidatedBefore}
	if m.InvalidatedFilter != nil {
		if len(m.InvalidatedFilter) != filterBits/8 {
			return marks{}, fmt.Errorf("invalidation filter of %d bytes, want %d", len(m.InvalidatedFilter), filterBits/8)
		}
		out.filter, out.filterKeys, out.filterBefore = m.InvalidatedFilter, m.InvalidatedFilterKeys, m.InvalidatedFilterBefore
	}
	for i, km := range m.Invalidated {
		if len(km.Hash) != 32 {
			return marks{}, fmt.Errorf("invalidation mark %d has a %d-byte hash", i, len(km.Hash))
		}
		if out.keys == nil {
			out.keys = map[markKey]uint64{}
		}
		var k markKey
		k.group = km.Group
		copy(k.hash[:], km.Hash)
		out.keys[k] = max(out.keys[k], km.Before)
	}
	return out, nil
}

// merge takes in the marks of o.
func (m *marks) merge(o marks) {
	m.all = max(m.all, o.all)
	if o.filter != nil {
		if m.filter == nil {
			m.filter = make([]byte, filterBits/8)
		}
		for i := range m.filter {
			m.filter[i] |= o.filter[i]
		}
		m.filterKeys += o.filterKeys
		m.filterBefore = max(m.filterBefore, o.filterBefore)
	}
	for k, before := range o.keys {
		m.mark(k, before)
	}
}

// filterBit is the i-th filter bit of k (double hashing).
func filterBit(k markKey, i int) uint64 {
	var b [36]byte
	b[0], b[1], b[2], b[3] = byte(k.group), byte(k.group>>8), byte(k.group>>16), byte(k.group>>24)
	copy(b[4:], k.hash[:])
	h := xxh3.Hash128(b[:])
	return (h.Lo + uint64(i)*(h.Hi|1)) % filterBits
}

func (m *marks) filterHas(k markKey) bool {
	for i := 0; i < filterHashes; i++ {
		if bit := filterBit(k, i); m.filter[bit/8]&(1<<(bit%8)) == 0 {
			return false
		}
	}
	return true
}

// mark marks k's blocks written before clock.
func (m *marks) mark(k markKey, clock uint64) {
	if clock <= m.all {
		return
	}
	if m.keys == nil {
		m.keys = map[markKey]uint64{}
	}
	if _, ok := m.keys[k]; ok || len(m.keys) < maxKeyMarks {
		m.keys[k] = max(m.keys[k], clock)
		return
	}
	if m.filterKeys >= maxFilterKeys {
		m.all = max(clock, m.filterBefore)
		for _, before := range m.keys {
			m.all = max(m.all, before)
		}
		m.keys, m.filter, m.filterKeys, m.filterBefore = nil, nil, 0, 0
		return
	}
	if m.filter == nil {
		m.filter = make([]byte, filterBits/8)
	}
	for i := 0; i < filterHashes; i++ {
		bit := filterBit(k, i)
		m.filter[bit/8] |= 1 << (bit % 8)
	}
	m.filterKeys++
	m.filterBefore = max(m.filterBefore, clock)
}

// covers reports whether a block of k written at write is invalidated.
func (m *marks) covers(k *index.Key, write uint64) bool {
	if write < m.all {
		return true
	}
	mk := markKey{group: k.Group, hash: k.Hash}
	if before, ok := m.keys[mk]; ok && write < before {
		return true
	}
	return m.filter != nil && write < m.filterBefore && m.filterHas(mk)
}

// markInvalidated records durably that the blocks of nss written before
// clock are invalidated: every one (keys nil) or those of keys.
func (s *Service) markInvalidated(nss []*Namespace, keys map[index.Key]struct{}, clock uint64) error {
	if s.disk == nil {
		return nil
	}
	s.marksMu.Lock()
	defer s.marksMu.Unlock()
	var errs []error
	for _, ns := range nss {
		if keys == nil {
			ns.marks.all, ns.marks.keys = max(ns.marks.all, clock), nil
			ns.marks.filter, ns.marks.filterKeys, ns.marks.filterBefore = nil, 0, 0
		} else {
			for k := range keys {
				if k.NS == ns.ID {
					ns.marks.mark(markKey{group: k.Group, hash: k.Hash}, clock)
				}
			}
		}
		if err := s.disk.SaveNamespace(digestOf(ns.Fingerprint), encodeMeta(ns)); err != nil {
			errs = append(errs, fmt.Errorf("namespace %d: %w", ns.ID, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		s.log.Error("an invalidation could not be recorded in the disk tier's catalog: after a kill -9 its blocks may come back", "err", err)
		return storageError(fmt.Errorf("the blocks are invalidated, but recording it in the disk tier's catalog failed (if the daemon is killed before their disk copies are erased, they may come back at the next start): %w", err))
	}
	return nil
}

// pruneMarks drops the marks of runs before epoch (the write clock's epoch
// when this run's recovery started): that recovery looked at every chunk
// and erased what they cover.
func (s *Service) pruneMarks(epoch uint32) {
	s.mu.Lock()
	nss := make([]*Namespace, 0, len(s.mu.byID))
	for _, ns := range s.mu.byID {
		nss = append(nss, ns)
	}
	s.mu.Unlock()
	s.marksMu.Lock()
	defer s.marksMu.Unlock()
	old := func(clock uint64) bool { return uint32(clock>>32) < epoch }
	for _, ns := range nss {
		changed := false
		if ns.marks.all != 0 && old(ns.marks.all) {
			ns.marks.all, changed = 0, true
		}
		if ns.marks.filter != nil && old(ns.marks.filterBefore) {
			ns.marks.filter, ns.marks.filterKeys, ns.marks.filterBefore = nil, 0, 0
			changed = true
		}
		for k, before := range ns.marks.keys {
			if old(before) {
				delete(ns.marks.keys, k)
				changed = true
			}
		}
		if !changed {
			continue
		}
		if err := s.disk.SaveNamespace(digestOf(ns.Fingerprint), encodeMeta(ns)); err != nil {
			// Kept on disk: the next recovery erases what they cover
			// again (nothing), and prunes them then.
			s.log.Warn("disk tier: could not drop spent invalidation marks from the catalog", "namespace", ns.ID, "err", err)
		}
	}
}
