package offload

import (
	"fmt"
	"time"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// use counts what one peer uid holds, to bound it (Limits.Max*PerUID).
type use struct {
	regs, regions int
}

// reserve books a registration of n regions for peer before its regions
// are opened, so that concurrent Registers cannot together pass the
// bounds. Register returns the booking (unreserveLocked) if it fails;
// Unregister when the registration goes.
func (s *Service) reserve(peer dma.Peer, n int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.closing {
		return ErrShuttingDown
	}
	u := s.mu.byUID[peer.UID]
	if u == nil {
		u = &use{}
	}
	lim := s.lim
	var err error
	switch {
	case s.mu.regCount+1 > lim.MaxRegistrations:
		err = fmt.Errorf("%w: %d registrations are live, at most %d (--max-registrations)", ErrLimit, s.mu.regCount, lim.MaxRegistrations)
	case u.regs+1 > lim.MaxRegistrationsPerUID:
		err = fmt.Errorf("%w: uid %d holds %d registrations, at most %d per uid (--max-registrations-per-uid)", ErrLimit, peer.UID, u.regs, lim.MaxRegistrationsPerUID)
	case s.mu.regionCount+n > lim.MaxRegions:
		err = fmt.Errorf("%w: %d regions are mapped and this registration adds %d, at most %d (--max-regions)", ErrLimit, s.mu.regionCount, n, lim.MaxRegions)
	case u.regions+n > lim.MaxRegionsPerUID:
		err = fmt.Errorf("%w: uid %d maps %d regions and this registration adds %d, at most %d per uid (--max-regions-per-uid)", ErrLimit, peer.UID, u.regions, n, lim.MaxRegionsPerUID)
	}
	if err != nil {
		s.m.refused.WithLabelValues("limit").Inc()
		// At most a line a second: a flooding client must not flood the
		// log too.
		if now := time.Now(); now.Sub(s.mu.lastRefusalLog) >= time.Second {
			s.mu.lastRefusalLog = now
			s.log.Warn("registration refused", "peer_pid", peer.PID, "peer_uid", peer.UID, "regions", n, "err", err)
		}
		return err
	}
	u.regs++
	u.regions += n
	s.mu.byUID[peer.UID] = u
	s.mu.regCount++
	s.mu.regionCount += n
	return nil
}

func (s *Service) unreserveLocked(uid uint32, n int) {
	u := s.mu.byUID[uid]
	u.regs--
	u.regions -= n
	if u.regs == 0 {
		delete(s.mu.byUID, uid)
	}
	s.mu.regCount--
	s.mu.regionCount -= n
}

// Limits are the service's bounds, defaults filled in.
func (s *Service) Limits() Limits { return s.lim }
