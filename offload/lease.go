package offload

import (
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// A lease holds pins a Lookup took so the blocks it offered survive until
// the Load that names it, or until the deadline if that Load never comes
// (the client went away). Eviction may still drop a leased block from the
// index; the Load that names the lease then reads it from the pinned slot,
// which cannot have been reused.
type lease struct {
	pins     map[index.Key]leasePin
	deadline time.Time
}

type leasePin struct {
	slot slots.SlotID
	disk bool // a disk slot; else a CPU slot
}

// pin pins where e's block is (its CPU copy if it has one). The caller holds
// the entry's index lock.
func (ls *lease) pin(s *Service, k index.Key, e *index.Entry) {
	if ls.pins == nil {
		ls.pins = map[index.Key]leasePin{}
	}
	if _, dup := ls.pins[k]; dup {
		return
	}
	if e.CPU != index.NoSlot {
		s.cpu.Pin(e.CPU)
		ls.pins[k] = leasePin{slot: e.CPU}
		return
	}
	s.disk.Pin(e.Disk)
	ls.pins[k] = leasePin{slot: e.Disk, disk: true}
}

func (ls *lease) empty() bool { return len(ls.pins) == 0 }

// take hands the pin the lease holds for k to the caller. A nil lease
// holds nothing.
func (ls *lease) take(k index.Key) (leasePin, bool) {
	if ls == nil {
		return leasePin{}, false
	}
	p, ok := ls.pins[k]
	delete(ls.pins, k)
	return p, ok
}

func (s *Service) addLease(ls *lease, d time.Duration) uint64 {
	ls.deadline = time.Now().Add(d)
	s.mu.Lock()
	s.mu.nextLs++
	id := s.mu.nextLs
	s.mu.leases[id] = ls
	s.mu.Unlock()
	s.m.leases.Inc()
	return id
}

// takeLease removes a lease from the table and hands its pins to the
// caller, who must drop each (unpinLease does all). Unknown or expired: nil.
func (s *Service) takeLease(id uint64) *lease {
	s.mu.Lock()
	ls, ok := s.mu.leases[id]
	delete(s.mu.leases, id)
	s.mu.Unlock()
	if !ok {
		return nil
	}
	s.m.leases.Dec()
	return ls
}

func (s *Service) unpinLease(ls *lease) {
	for _, p := range ls.pins {
		s.unpin(p)
	}
}

func (s *Service) unpin(p leasePin) {
	if p.disk {
		s.disk.Unpin(p.slot)
	} else {
		s.cpu.Unpin(p.slot)
	}
}

// releaseLeases drops leases past their deadline at now, or all of them.
func (s *Service) releaseLeases(now time.Time, all bool) {
	var expired []*lease
	s.mu.Lock()
	for id, ls := range s.mu.leases {
		if all || now.After(ls.deadline) {
			expired = append(expired, ls)
			delete(s.mu.leases, id)
		}
	}
	s.mu.Unlock()
	for _, ls := range expired {
		s.unpinLease(ls)
		s.m.leases.Dec()
	}
}

// reapLeases expires leases; it stops when the service closes.
func (s *Service) reapLeases() {
	defer s.reaper.Done()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case now := <-t.C:
			s.releaseLeases(now, false)
		case <-s.stop:
			return
		}
	}
}
