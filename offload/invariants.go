package offload

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// ErrBusy: CheckInvariants was called with work in flight.
var ErrBusy = errors.New("work in flight")

// CheckInvariants checks that the service's bookkeeping agrees with
// itself, for tests and for the model-based test that calls it after every
// step. It walks the whole index and every slot: not for hot paths.
//
// Call it when nothing is in flight (no job accepted and unfinished, no
// disk write or erase queued, no remote publish queued: wait for the jobs'
// results, FlushDisk and FlushRemote); otherwise it returns an error
// wrapping ErrBusy. Leases may be held. The cleaner's writes are the
// service's own: it waits for them (up to 10 s).
// It checks that
//   - every index entry is ready and holds a copy, in a namespace the
//     service keeps, in a slot of that namespace's class for its group,
//     named by no other entry, and known to that class's policy (a block
//     the policy does not count is room it thinks free);
//   - the tiers' slots agree with that (Space.Audit): a slot is in use
//     exactly when an entry names it, released only while a lease pins it,
//     and its pins are exactly the leases' pins on it;
//   - the lease tables (per owner and in total) count what the leases hold;
//   - each class is referenced exactly by the groups of the namespaces the
//     service keeps, and the per-namespace entry counts add up;
//   - each registration's queue of results is in order and its byte count
//     is the sum of its results'.
//
// It returns nil or an error joining what it found (at most a few dozen).
func (s *Service) CheckInvariants() error {
	if s.cl != nil {
		// The cleaner writes ahead on its own, at any time: hold its
		// next pass off, and let the writes of its last one (and their
		// erases) land.
		s.cl.pass.Lock()
		defer s.cl.pass.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if s.inflight.Load() == 0 {
			_ = s.FlushDisk(ctx)
		}
		cancel()
	}
	if n, w, p := s.inflight.Load(), s.diskWrites.Load(), s.remotePublishing(); n != 0 || w != 0 || p != 0 {
		return fmt.Errorf("%w: %d jobs, %d disk writes, %d remote publishes", ErrBusy, n, w, p)
	}
	var errs []error
	fail := func(format string, args ...any) {
		if len(errs) < 40 {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}

	s.mu.Lock()
	nss := make(map[uint32]*Namespace, len(s.mu.byID))
	refs := map[*slots.Class]int{}
	for id, ns := range s.mu.byID {
		nss[id] = ns
		if s.mu.byPrint[string(ns.Fingerprint)] != ns || ns.ID != id {
			fail("namespace %d is filed wrong", id)
		}
		for _, c := range ns.classes {
			refs[c]++
		}
		for _, c := range ns.diskClasses {
			refs[c]++
		}
	}
	if len(s.mu.byPrint) != len(s.mu.byID) {
		fail("%d fingerprints for %d namespaces", len(s.mu.byPrint), len(s.mu.byID))
	}
	cpuPins, diskPins := map[slots.SlotID]uint32{}, map[slots.SlotID]uint32{}
	perOwner := map[Owner]ownerUse{}
	total := 0
	for id, ls := range s.mu.leases {
		n := 0
		for ns, byKey := range ls.pins {
			for k, p := range byKey {
				if k.NS != ns {
					fail("lease %d files a key of namespace %d under %d", id, k.NS, ns)
				}
				if p.disk {
					diskPins[p.slot]++
				} else {
					cpuPins[p.slot]++
				}
				n++
			}
		}
		if n != ls.n || n == 0 || ls.id != id {
			fail("lease %d holds %d pins, counts %d", id, n, ls.n)
		}
		u := perOwner[ls.owner]
		u.leases++
		u.pins += n
		perOwner[ls.owner] = u
		total += n
	}
	if total != s.mu.leasePins {
		fail("leases pin %d blocks, counted %d", total, s.mu.leasePins)
	}
	for o, u := range s.mu.owners {
		if *u != perOwner[o] || (u.leases == 0 && u.pins == 0) {
			fail("owner %d: counted %+v, holds %+v", o, *u, perOwner[o])
		}
	}
	for o := range perOwner {
		if s.mu.owners[o] == nil {
			fail("owner %d holds leases it is not counted for", o)
		}
	}
	regs := make([]*Registration, 0, len(s.mu.regs))
	for _, r := range s.mu.regs {
		regs = append(regs, r)
	}
	s.mu.Unlock()

	for c, n := range refs {
		if got := c.Refs(); got != n {
			fail("the %d-byte class has %d references, the namespaces hold %d", c.SlotBytes(), got, n)
		}
	}

	type named struct {
		k    index.Key
		tier string
		c    *slots.Class
	}
	cpuNamed, diskNamed := map[slots.SlotID]*slots.Class{}, map[slots.SlotID]*slots.Class{}
	var policyKeys []named
	perNS, readyNS := map[uint32]int{}, map[uint32]uint64{}
	s.ix.Range(func(k *index.Key, e *index.Entry) bool {
		perNS[k.NS]++
		if e.State == index.Ready {
			readyNS[k.NS]++
		}
		ns := nss[k.NS]
		switch {
		case ns == nil:
			fail("entry %x of namespace %d, which the service does not keep", k.Hash[:8], k.NS)
			return true
		case k.Group >= uint32(len(ns.classes)):
			fail("entry %x of namespace %d has group %d of %d", k.Hash[:8], k.NS, k.Group, len(ns.classes))
			return true
		case e.State != index.Ready || e.Flags != 0:
			fail("entry %x of namespace %d: state %d, flags %#x with nothing in flight", k.Hash[:8], k.NS, e.State, e.Flags)
		case e.CPU == index.NoSlot && e.Disk == index.NoSlot:
			fail("entry %x of namespace %d holds no copy", k.Hash[:8], k.NS)
		}
		if e.CPU != index.NoSlot {
			if cpuNamed[e.CPU] != nil {
				fail("cpu slot %d is named twice", e.CPU)
			}
			cpuNamed[e.CPU] = ns.classes[k.Group]
			policyKeys = append(policyKeys, named{*k, "cpu", ns.classes[k.Group]})
		}
		if e.Disk != index.NoSlot {
			if s.disk == nil {
				fail("entry %x names disk slot %d without a disk tier", k.Hash[:8], e.Disk)
				return true
			}
			if diskNamed[e.Disk] != nil {
				fail("disk slot %d is named twice", e.Disk)
			}
			diskNamed[e.Disk] = ns.diskClasses[k.Group]
			policyKeys = append(policyKeys, named{*k, "disk", ns.diskClasses[k.Group]})
		}
		return true
	})
	for i := range policyKeys {
		if n := &policyKeys[i]; !n.c.Holds(&n.k) {
			fail("%s tier: entry %x of namespace %d holds a slot its policy does not count", n.tier, n.k.Hash[:8], n.k.NS)
		}
	}
	for id := range nss {
		if got := s.ix.CountNS(id); got != perNS[id] {
			fail("namespace %d: the index counts %d entries, holds %d", id, got, perNS[id])
		}
	}
	// What Stats reports, from the index's counts.
	counted := s.ix.ReadyPerNS()
	for id, n := range counted {
		if n != readyNS[id] {
			fail("namespace %d: the index counts %d ready entries, holds %d", id, n, readyNS[id])
		}
	}
	for id, n := range readyNS {
		if _, ok := counted[id]; !ok {
			fail("namespace %d: the index counts no ready entry, holds %d", id, n)
		}
	}
	if err := s.cpu.Audit(cpuNamed, cpuPins); err != nil {
		errs = append(errs, err)
	}
	if s.disk != nil {
		if err := s.disk.Audit(diskNamed, diskPins); err != nil {
			errs = append(errs, err)
		}
		s.writing.Lock()
		if n := len(s.writing.byKey); n != 0 {
			fail("%d demotions are current with none in flight", n)
		}
		s.writing.Unlock()
	}

	for _, r := range regs {
		r.mu.Lock()
		size := 0
		var last uint64
		for i := range r.mu.done {
			res := &r.mu.done[i]
			size += res.wireBytes()
			if res.Seq <= last || res.Seq > r.mu.seq {
				fail("registration %d: result %d has seq %d after %d (last given %d)", r.ID, i, res.Seq, last, r.mu.seq)
			}
			last = res.Seq
		}
		if size != r.mu.doneBytes || len(r.mu.pending) != 0 || r.mu.reserved != 0 {
			fail("registration %d: %d result bytes counted as %d; %d pending, %d bytes reserved, with nothing in flight", r.ID, size, r.mu.doneBytes, len(r.mu.pending), r.mu.reserved)
		}
		r.mu.Unlock()
	}
	return errors.Join(errs...)
}
