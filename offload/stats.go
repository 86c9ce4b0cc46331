package offload

import (
	"fmt"
	"sync/atomic"

	"github.com/kvoffloadd/kvoffloadd/index"
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
}

// Stats counts blocks per namespace (a walk of the index: not for hot paths).
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
	}
	perNS := map[uint32]uint64{}
	s.ix.Range(func(k *index.Key, e *index.Entry) bool {
		if e.State == index.Ready {
			perNS[k.NS]++
		}
		return true
	})
	s.mu.Lock()
	for _, ns := range s.mu.byID {
		st.Namespaces = append(st.Namespaces, NamespaceStats{ID: ns.ID, Fingerprint: ns.Fingerprint, Registrations: ns.regs, Blocks: perNS[ns.ID]})
	}
	s.mu.Unlock()
	return st
}

// CheckAccounting compares the tiers' slot counts with the index, for tests
// and debugging: with no job, lease or disk write in flight, every used slot
// is named by exactly one index entry (or, on disk, quarantined) and no slot
// is pinned.
func (s *Service) CheckAccounting() error {
	var cpuN, diskN uint64
	s.ix.Range(func(k *index.Key, e *index.Entry) bool {
		if e.CPU != index.NoSlot {
			cpuN++
		}
		if e.Disk != index.NoSlot {
			diskN++
		}
		return true
	})
	_, cpuBlocks := s.cpu.Usage()
	if cpuBlocks != cpuN || s.cpu.Pinned() != 0 {
		return fmt.Errorf("cpu tier: %d slots used, %d named by the index, %d pinned", cpuBlocks, cpuN, s.cpu.Pinned())
	}
	if s.disk != nil {
		_, diskBlocks := s.disk.Usage()
		q := uint64(s.disk.Quarantined())
		if diskBlocks != diskN+q || s.disk.Pinned() != 0 {
			return fmt.Errorf("disk tier: %d slots used, %d named by the index, %d quarantined, %d pinned", diskBlocks, diskN, q, s.disk.Pinned())
		}
	}
	return nil
}
