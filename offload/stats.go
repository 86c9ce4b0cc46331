package offload

import (
	"sort"
	"sync/atomic"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
)

// counters mirror the Prometheus metrics Stats reports over the API.
type counters struct {
	lookups, lookupHits, stored, loaded, failed, evictions atomic.Uint64
}

// TierStats is one tier's use.
type TierStats struct {
	Name                             string
	CapacityBytes, UsedBytes, Blocks uint64
}

// NamespaceStats is one namespace's state.
type NamespaceStats struct {
	ID            uint32
	Fingerprint   []byte
	Registrations int
	Blocks        uint64
}

// Stats is a snapshot of the service.
type Stats struct {
	Tiers                                                                    []TierStats
	Namespaces                                                               []NamespaceStats
	Lookups, LookupHits, BlocksStored, BlocksLoaded, BlocksFailed, Evictions uint64
	// DiskRecovery is the disk tier's recovery of its files; nil without
	// a disk tier.
	DiskRecovery *disk.RecoveryStats
}

// Stats reports the tiers' use, the counters, and the blocks ready per
// namespace, from counts the index keeps: its cost does not grow with the
// number of blocks (operators poll it during recovery).
func (s *Service) Stats() Stats {
	used, blocks := s.cpu.Usage()
	st := Stats{
		Tiers:        []TierStats{{Name: "cpu", CapacityBytes: s.cpu.Capacity(), UsedBytes: used, Blocks: blocks}},
		Lookups:      s.c.lookups.Load(),
		LookupHits:   s.c.lookupHits.Load(),
		BlocksStored: s.c.stored.Load(),
		BlocksLoaded: s.c.loaded.Load(),
		BlocksFailed: s.c.failed.Load(),
		Evictions:    s.c.evictions.Load(),
	}
	if s.disk != nil {
		used, blocks := s.disk.Usage()
		st.Tiers = append(st.Tiers, TierStats{Name: "disk", CapacityBytes: s.disk.Capacity(), UsedBytes: used, Blocks: blocks})
		r := s.disk.Recovery()
		st.DiskRecovery = &r
	}
	perNS := s.ix.ReadyPerNS()
	s.mu.Lock()
	for _, ns := range s.mu.byID {
		st.Namespaces = append(st.Namespaces, NamespaceStats{ID: ns.ID, Fingerprint: ns.Fingerprint, Registrations: ns.regs, Blocks: perNS[ns.ID]})
	}
	s.mu.Unlock()
	sort.Slice(st.Namespaces, func(i, j int) bool { return st.Namespaces[i].ID < st.Namespaces[j].ID })
	return st
}

// CheckAccounting is CheckInvariants under its older name.
func (s *Service) CheckAccounting() error { return s.CheckInvariants() }
