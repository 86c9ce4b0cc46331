package offload

import (
	"fmt"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// Owner names who holds a lease: the connection that took it (rpc/server
// passes its connection number). Lease ids are not capabilities: only the
// owner's Loads use a lease; another connection naming it gets no pins from
// it (its blocks load if they are still cached) and the lease stays its
// owner's. Owner 0 is a caller inside the process.
type Owner uint64

// A lease holds pins a Lookup took so the blocks it offered survive until
// the Loads that name it, or until the deadline if they never come (the
// client went away). Eviction may still drop a leased block from the
// index; the Load that names the lease then reads it from the pinned slot,
// which cannot have been reused.
//
// A lease taken over several namespaces (one per tensor-parallel rank)
// keeps each namespace's pins apart: a Load through a registration takes
// only its own namespace's, and the lease ends when every namespace's pins
// are taken.
type lease struct {
	id       uint64
	owner    Owner
	pins     map[uint32]map[index.Key]leasePin // by namespace
	n        int                               // pins held
	deadline time.Time
}

type leasePin struct {
	slot slots.SlotID
	disk bool // a disk slot; else a CPU slot
}

// ownerUse is what one owner holds, against Limits.MaxLeasesPerOwner and
// MaxLeasePinsPerOwner.
type ownerUse struct {
	leases, pins int
}

// pin pins where e's block is (its CPU copy if it has one). The caller holds
// the entry's index lock. It reports whether it took a pin (false when the
// lease pins k already) and whether the lease holds k now (false when the
// slot takes no more pins).
func (ls *lease) pin(s *Service, k index.Key, e *index.Entry) (fresh, ok bool) {
	if ls.pins == nil {
		ls.pins = map[uint32]map[index.Key]leasePin{}
	}
	byKey := ls.pins[k.NS]
	if byKey == nil {
		byKey = map[index.Key]leasePin{}
		ls.pins[k.NS] = byKey
	}
	if _, dup := byKey[k]; dup {
		return false, true
	}
	p := leasePin{slot: e.CPU}
	if e.CPU == index.NoSlot {
		p = leasePin{slot: e.Disk, disk: true}
	}
	if !s.pinSlot(p) {
		return false, false
	}
	byKey[k] = p
	ls.n++
	return true, true
}

// pinSlot takes one pin on p's slot.
func (s *Service) pinSlot(p leasePin) bool {
	if p.disk {
		return s.disk.Pin(p.slot)
	}
	return s.cpu.Pin(p.slot)
}

// take hands the pin the lease holds for k to the caller. A nil lease
// holds nothing.
func (ls *lease) take(k index.Key) (leasePin, bool) {
	if ls == nil {
		return leasePin{}, false
	}
	p, ok := ls.pins[k.NS][k]
	if ok {
		delete(ls.pins[k.NS], k)
		ls.n--
	}
	return p, ok
}

// addLease files a lease for owner, within the owner's and the daemon's
// bounds; past them it drops the lease's pins and refuses.
func (s *Service) addLease(ls *lease, owner Owner, d time.Duration) (uint64, error) {
	ls.deadline = time.Now().Add(d)
	ls.owner = owner
	s.mu.Lock()
	u := s.mu.owners[owner]
	if u == nil {
		u = &ownerUse{}
	}
	var err error
	switch {
	case u.leases+1 > s.lim.MaxLeasesPerOwner:
		err = fmt.Errorf("%w: this connection holds %d leases, at most %d (leases end when a Load names them or after lease_ms)", ErrLimit, u.leases, s.lim.MaxLeasesPerOwner)
	case u.pins+ls.n > s.lim.MaxLeasePinsPerOwner:
		err = fmt.Errorf("%w: this lease would pin %d blocks beside the %d this connection's leases pin, at most %d", ErrLimit, ls.n, u.pins, s.lim.MaxLeasePinsPerOwner)
	case len(s.mu.leases)+1 > s.lim.MaxLeases || s.mu.leasePins+ls.n > s.lim.MaxLeasePins:
		err = fmt.Errorf("%w: the daemon holds %d leases pinning %d blocks, at most %d and %d", ErrLimit, len(s.mu.leases), s.mu.leasePins, s.lim.MaxLeases, s.lim.MaxLeasePins)
	}
	if err != nil {
		s.mu.Unlock()
		s.unpinLease(ls)
		s.m.refused.WithLabelValues("lease_limit").Inc()
		return 0, err
	}
	s.mu.owners[owner] = u
	u.leases++
	u.pins += ls.n
	s.mu.leasePins += ls.n
	s.mu.nextLs++
	ls.id = s.mu.nextLs
	s.mu.leases[ls.id] = ls
	s.mu.Unlock()
	s.m.leases.Inc()
	return ls.id, nil
}

// takeLease takes out of lease id the pins of namespace ns and hands them
// to the caller, who must drop each (unpinLease does all). The lease ends
// once no namespace's pins are left. A lease that is unknown, expired or
// not owner's gives nothing (and another owner's stays as it is).
func (s *Service) takeLease(id uint64, owner Owner, ns uint32) *lease {
	s.mu.Lock()
	ls, ok := s.mu.leases[id]
	if ok && ls.owner != owner {
		s.mu.Unlock()
		s.m.refused.WithLabelValues("lease_not_owned").Inc()
		s.log.Warn("a load named a lease of another connection; it loads without it", "lease", id, "caller", owner, "owner", ls.owner)
		return nil
	}
	if !ok {
		s.mu.Unlock()
		return nil
	}
	byKey := ls.pins[ns]
	delete(ls.pins, ns)
	out := &lease{id: id, owner: owner, pins: map[uint32]map[index.Key]leasePin{ns: byKey}, n: len(byKey)}
	ls.n -= out.n
	s.releaseUseLocked(ls.owner, 0, out.n)
	ended := len(ls.pins) == 0
	if ended {
		delete(s.mu.leases, id)
		s.releaseUseLocked(ls.owner, 1, 0)
	}
	s.mu.Unlock()
	if ended {
		s.m.leases.Dec()
	}
	return out
}

// releaseUseLocked gives back leases and pins an owner held.
func (s *Service) releaseUseLocked(owner Owner, leases, pins int) {
	s.mu.leasePins -= pins
	u := s.mu.owners[owner]
	if u == nil {
		return
	}
	u.leases -= leases
	u.pins -= pins
	if u.leases == 0 && u.pins == 0 {
		delete(s.mu.owners, owner)
	}
}

func (s *Service) unpinLease(ls *lease) {
	for _, byKey := range ls.pins {
		for _, p := range byKey {
			s.unpin(p)
		}
	}
}

func (s *Service) unpin(p leasePin) {
	if p.disk {
		s.disk.Unpin(p.slot)
	} else {
		s.cpu.Unpin(p.slot)
	}
}

// voidLeases drops the pins leases hold on invalidated blocks: every pin
// in the namespaces of all, and the pins of keys. A Load naming such a
// lease then finds those blocks MISSING (or, once stored again, their new
// copy): never the invalidated bytes, even where the lease pinned them
// before eviction dropped them from the index. A lease left with no pin
// ends.
func (s *Service) voidLeases(all map[uint32]bool, keys map[index.Key]struct{}) {
	var drop []leasePin
	take := func(byKey map[index.Key]leasePin, k index.Key) {
		if p, ok := byKey[k]; ok {
			drop = append(drop, p)
			delete(byKey, k)
		}
	}
	s.mu.Lock()
	for id, ls := range s.mu.leases {
		before := len(drop)
		for ns, byKey := range ls.pins {
			switch {
			case all[ns]:
				for k := range byKey {
					take(byKey, k)
				}
			case len(byKey) <= len(keys):
				for k := range byKey {
					if _, ok := keys[k]; ok {
						take(byKey, k)
					}
				}
			default:
				for k := range keys {
					take(byKey, k)
				}
			}
			if len(byKey) == 0 {
				delete(ls.pins, ns)
			}
		}
		n := len(drop) - before
		if n == 0 {
			continue
		}
		ls.n -= n
		ended := 0
		if len(ls.pins) == 0 {
			delete(s.mu.leases, id)
			s.m.leases.Dec()
			ended = 1
		}
		s.releaseUseLocked(ls.owner, ended, n)
	}
	s.mu.Unlock()
	for _, p := range drop {
		s.unpin(p)
	}
}

// releaseLeases drops the leases that match.
func (s *Service) releaseLeases(match func(*lease) bool) {
	var gone []*lease
	s.mu.Lock()
	for id, ls := range s.mu.leases {
		if match(ls) {
			gone = append(gone, s.dropLeaseLocked(id, ls))
		}
	}
	s.mu.Unlock()
	s.endLeases(gone)
}

// dropLeaseLocked takes lease id out of the table and its owner's count;
// endLeases then unpins it, outside s.mu.
func (s *Service) dropLeaseLocked(id uint64, ls *lease) *lease {
	delete(s.mu.leases, id)
	s.releaseUseLocked(ls.owner, 1, ls.n)
	return ls
}

// endLeases unpins leases dropLeaseLocked took out.
func (s *Service) endLeases(gone []*lease) {
	for _, ls := range gone {
		s.unpinLease(ls)
		s.m.leases.Dec()
	}
}

// MaxReleaseIDs bounds the lease ids one ReleaseLeases names.
const MaxReleaseIDs = 4096

// ReleaseLeases ends the leases of ids that owner holds (a client dropped
// the lookups that took them: no Load will name them) and says how many
// there were. Other owners' leases, and ids unknown or already ended, are
// left alone.
func (s *Service) ReleaseLeases(owner Owner, ids []uint64) (int, error) {
	if len(ids) > MaxReleaseIDs {
		return 0, fmt.Errorf("%w: %d lease ids, at most %d", ErrInvalid, len(ids), MaxReleaseIDs)
	}
	var gone []*lease
	s.mu.Lock()
	for _, id := range ids {
		ls, ok := s.mu.leases[id]
		if !ok || ls.owner != owner {
			continue
		}
		gone = append(gone, s.dropLeaseLocked(id, ls))
	}
	s.mu.Unlock()
	s.endLeases(gone)
	return len(gone), nil
}

// ReleaseOwner drops every lease owner holds: its connection closed, and
// no one else may use them.
func (s *Service) ReleaseOwner(owner Owner) {
	s.releaseLeases(func(ls *lease) bool { return ls.owner == owner })
}

// reapLeases expires leases and drops namespaces no one uses; it stops
// when the service closes.
func (s *Service) reapLeases() {
	defer s.reaper.Done()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	sweep := time.Now()
	for {
		select {
		case now := <-t.C:
			s.releaseLeases(func(ls *lease) bool { return now.After(ls.deadline) })
			if now.Sub(sweep) >= namespaceSweep {
				sweep = now
				s.sweepNamespaces()
			}
		case <-s.stop:
			return
		}
	}
}
