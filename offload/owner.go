package offload

import (
	"fmt"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// Owner is who makes a call: the connection it came over and the process
// behind that connection. A registration belongs to the Owner that made it;
// rpc/server decides which later calls may name it (docs/operations.md,
// Security).
type Owner struct {
	// Conn names the connection, unique for the daemon's life; 0 is no
	// connection (an in-process caller).
	Conn uint64
	// Peer is the process on the other end, from SO_PEERCRED and
	// SO_PEERGROUPS at accept.
	Peer dma.Peer
}

// use counts what one uid holds, to bound it (Limits.Max*PerUID).
type use struct {
	regs, regions int
}

// reserveLocked books a registration of n regions for uid before its
// regions are opened, so that concurrent Registers cannot together pass the
// bounds. The caller holds s.mu and must unreserveLocked on failure or when
// the registration goes.
func (s *Service) reserveLocked(uid uint32, n int) error {
	u := s.mu.byUID[uid]
	if u == nil {
		u = &use{}
	}
	lim := s.lim
	switch {
	case s.mu.regCount+1 > lim.MaxRegistrations:
		return fmt.Errorf("%w: %d registrations are live, at most %d (--max-registrations)", ErrLimit, s.mu.regCount, lim.MaxRegistrations)
	case u.regs+1 > lim.MaxRegistrationsPerUID:
		return fmt.Errorf("%w: uid %d holds %d registrations, at most %d per uid (--max-registrations-per-uid)", ErrLimit, uid, u.regs, lim.MaxRegistrationsPerUID)
	case s.mu.regionCount+n > lim.MaxRegions:
		return fmt.Errorf("%w: %d regions are mapped and this registration adds %d, at most %d (--max-regions)", ErrLimit, s.mu.regionCount, n, lim.MaxRegions)
	case u.regions+n > lim.MaxRegionsPerUID:
		return fmt.Errorf("%w: uid %d maps %d regions and this registration adds %d, at most %d per uid (--max-regions-per-uid)", ErrLimit, uid, u.regions, n, lim.MaxRegionsPerUID)
	}
	u.regs++
	u.regions += n
	s.mu.byUID[uid] = u
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

// Owner is who made the registration.
func (r *Registration) Owner() Owner { return r.own }
