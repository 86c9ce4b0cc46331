package offload

import (
	"time"

	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
)

// A lease holds pins a Lookup took so the blocks it offered survive until
// the Load that names it, or until the deadline if that Load never comes
// (the client went away).
type lease struct {
	slots    []cpu.SlotID
	deadline time.Time
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

// releaseLease drops a lease's pins; an unknown or expired id is ignored.
func (s *Service) releaseLease(id uint64) {
	s.mu.Lock()
	ls, ok := s.mu.leases[id]
	delete(s.mu.leases, id)
	s.mu.Unlock()
	if ok {
		s.unpinLease(ls)
	}
}

func (s *Service) unpinLease(ls *lease) {
	for _, sl := range ls.slots {
		s.cpu.Unpin(sl)
	}
	s.m.leases.Dec()
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
