package model

import (
	"fmt"
	"os"
	"slices"
	"time"
)

// The model: per key, which generations of its bytes the daemon may hold
// right now. It is an over-approximation built only from what the runner did
// and saw, so a check against it never fails a correct daemon:
//
//   - A store the daemon accepted may have made its key present (the claim
//     happens inside the Store call).
//   - An invalidation makes a key absent: nothing of it may be offered until
//     a later store.
//   - A failed block of a load or store (IO_ERROR, CORRUPT, DMA_ERROR, and
//     for a store any failure, which means it claimed the key) makes the key
//     absent, except for stores issued after that job.
//   - Eviction may drop any key at any time; what it may not do is go
//     uncounted: a key stored while the daemon's loss counter stood at n
//     (Metrics.Losses) must be offered while it still stands at n.
//   - A restart keeps what may be on disk (or nothing, without a disk tier or
//     with --disk-reset), except what was invalidated: an Invalidate that
//     returned holds across a clean stop and a SIGKILL alike (its marks in
//     the disk tier's catalog, docs/disk-format.md "Invalidation and
//     restarts").

type keyState struct {
	gen       uint32   // the generation the next store writes
	present   []uint32 // generations that may be in the daemon
	lastStore int      // tick of the last accepted store since the last clear
	lastClear int      // tick of the last definite clear (invalidate, failure)
	inflight  int      // stores of this key accepted and not settled
	// loading: load jobs of this key accepted and not settled; okLoad: the
	// tick at which the last OK load of it was read. A failed disk read
	// drops only the disk copy: a CPU copy another load made meanwhile
	// (promoted from a good read of the same slot) stays, and is offered.
	loading int
	okLoad  int
	// must: a store's OK was seen and nothing cleared the key since; it
	// must be offered while the loss counter stays at mustBase.
	must     bool
	mustBase float64
	corrupt  bool // external corruption may have hit its disk copy
	// freed: generations dropped from the index without an Invalidate (a
	// failed load or store): a disk copy freed but not erased may come
	// back at a restart, verified (docs/disk-format.md, "Freeing a slot
	// does not erase it").
	freed []uint32
	// ghosts: invalidated generations; nothing may bring them back (only
	// the ghost-after-restart tolerance lets a restart do it).
	ghosts []uint32
}

func addGen(s []uint32, g uint32) []uint32 {
	if slices.Contains(s, g) {
		return s
	}
	return append(s, g)
}

// Model is the runner's picture of what the daemon may hold.
type Model struct {
	sh   Shape
	keys map[KeyRef]*keyState
	tick int
	// readFaults: the current incarnation's fault plan can fail disk I/O
	// (any disk fault may end in a failed read or a dropped disk copy).
	readFaults bool
	tol        Tolerances
	// arenaRecovering: a persistent arena's recovery (held, Proc.HoldCPU)
	// still runs; it may file a copy from before the restart after a
	// failed store or load of the key.
	arenaRecovering bool
	// watch, when set, logs every event of one key (KVMODEL_WATCH=ns1/g0/c1.0).
	watch string
	logf  func(string, ...any)
}

func (m *Model) trace(k KeyRef, what string, a ...any) {
	if m.watch != "" && k.String() == m.watch {
		s := m.keys[k]
		m.logf("watch %s tick %d: %s -> present %v gen %d lastStore %d lastClear %d must %v inflight %d", k, m.tick, fmt.Sprintf(what, a...), s.present, s.gen, s.lastStore, s.lastClear, s.must, s.inflight)
	}
}

// Tolerances turn off checks for defects already filed (see
// /work/notes/model-findings.md and docs/model-test.md), so a run can go on
// finding new ones. Each names what it lets pass.
type Tolerances map[string]bool

// Known tolerances.
var KnownTolerances = map[string]string{
	"lease-after-invalidate": "a load naming a lease taken before an Invalidate may return the invalidated bytes (or CORRUPT, the discarded disk copy)",
	"ghost-after-restart":    "a block invalidated before a restart (clean or SIGKILL) may come back: Invalidate erases only the disk copy the index names, not older freed copies (after a failed load, an eviction), nor one whose erase had not landed",
	"failed-keeps-cpu":       "a block whose disk read failed may still be offered from a CPU copy another load made",
	"lease-one-rank":         "the first rank's Load of a lease taken over several namespaces uses the whole lease (issue 9 item 1)",
	"two-jobs-one-block":     "two jobs of one Load may target one engine block (issue 9 item 3)",
	"foreign-registration":   "any connection may use another's registration id (issue 9 item 4)",
	"class-goroutines":       "the goroutines of a block-size class stay after its last user (issue 9 item 8)",
	"lost-completions":       "a Completions reply cut off by its deadline loses its results (issue 9 item 2)",
	"lost-wait-results":      "results of a Store or Load with wait and ack_seq, returned in a reply its caller gave up on, are lost (without ack_seq that is documented)",
	"discard-under-read":     "an Invalidate zeroes the disk slot a load in flight is reading: the load fails CORRUPT",
	"register-race-leak":     "a Register racing its connection's close is never released (issue 9 item 6)",
	"lease-beyond-prefix":    "a Lookup with a lease over several namespaces returns a lease (pinning blocks) when nothing is ready in all of them",
}

func newModel(sh Shape, tol Tolerances, logf func(string, ...any)) *Model {
	return &Model{sh: sh, keys: map[KeyRef]*keyState{}, tol: tol, watch: os.Getenv("KVMODEL_WATCH"), logf: logf}
}

func (m *Model) key(k KeyRef) *keyState {
	s := m.keys[k]
	if s == nil {
		s = &keyState{lastStore: -1}
		m.keys[k] = s
	}
	return s
}

// next advances the clock; every request the runner sends gets a tick.
func (m *Model) next() int {
	m.tick++
	return m.tick
}

// maybePresent reports whether the daemon may hold k.
func (m *Model) maybePresent(k KeyRef) bool { return len(m.key(k).present) > 0 }

// clearAfter makes k absent as of a failure of a job issued at tick t:
// only stores issued after t (and after the last clear) may have made it
// present again. elsewhere: a copy elsewhere survives the failure (the remote
// tier, or a persistent arena's recovery that may still file a copy from
// before the restart).
func (s *keyState) clearAfter(t int, elsewhere bool) {
	if elsewhere {
		// The remote tier may hold every generation not invalidated,
		// and a recovery still running may file one: a local failure
		// drops the local copy only.
		s.must = false
		return
	}
	keep := s.lastStore > t && s.lastStore > s.lastClear
	for _, g := range s.present {
		s.freed = addGen(s.freed, g)
	}
	s.present = s.present[:0]
	if keep {
		s.present = append(s.present, s.gen)
	} else {
		s.corrupt = false
	}
	s.must = false
}

// storeAccepted records a store of k accepted at tick t; it reports whether
// no other store of k was in flight (so its OK means k is ready) and, if k
// was a must, the base its claim failure would contradict.
func (m *Model) storeAccepted(k KeyRef, t int) (alone bool, mustBase float64, must bool) {
	s := m.key(k)
	alone = s.inflight == 0
	must, mustBase = s.must, s.mustBase
	s.inflight++
	s.lastStore = t
	s.present = addGen(s.present, s.gen)
	m.trace(k, "store accepted (alone %v)", alone)
	return alone, mustBase, must
}

// storeSettled records a store block's outcome once its result is seen
// (ok) or known lost (lost: the result will never come).
func (m *Model) storeSettled(k KeyRef, b *blockRec, ok, lost bool, incarnation int, curIncarnation int) {
	s := m.key(k)
	if s.inflight > 0 {
		s.inflight--
	}
	switch {
	case lost:
	case ok:
		if b.alone && b.issued > s.lastClear && incarnation == curIncarnation {
			if !s.must || b.base > s.mustBase {
				s.mustBase = b.base
			}
			s.must = true
		}
	default:
		// The job claimed k (only a claim can fail), so k was absent
		// when it was accepted, and its claim is gone now.
		s.clearAfter(b.issued, m.sh.HasRemote() || m.arenaRecovering)
	}
	m.trace(k, "store of tick %d settled ok=%v lost=%v", b.issued, ok, lost)
}

// invalidated records an Invalidate of k at tick t.
func (m *Model) invalidated(k KeyRef, t int) {
	s := m.key(k)
	for _, g := range append(s.present, s.freed...) {
		s.ghosts = addGen(s.ghosts, g)
	}
	s.present, s.freed = s.present[:0], nil
	s.gen++
	s.lastClear = t
	s.must = false
	s.corrupt = false
	m.trace(k, "invalidated")
}

// loadFailed records a load block that failed in a way that drops it.
// diskRead: it failed reading its disk copy (IO_ERROR, CORRUPT), which
// drops only that copy; issued is the failing load's tick.
func (m *Model) loadFailed(k KeyRef, clearFrom, issued int, diskRead bool) {
	s := m.key(k)
	if diskRead && (s.loading > 0 || s.okLoad >= issued) {
		// Another load of k ran alongside: its good read may have
		// promoted k to the CPU tier before this one failed.
		s.must = false
		m.trace(k, "load of tick %d failed reading disk; another load may have kept a CPU copy", issued)
		return
	}
	s.clearAfter(clearFrom, m.sh.HasRemote() || m.arenaRecovering)
	m.trace(k, "load of tick %d failed", issued)
}

// loadSettled records a load block of k whose result was read (or will never
// be) in this incarnation (cur) or an earlier one.
func (m *Model) loadSettled(k KeyRef, cur, ok bool) {
	s := m.key(k)
	if cur && s.loading > 0 {
		s.loading--
	}
	if cur && ok {
		s.okLoad = m.tick
	}
}

// restarted records a new daemon incarnation.
func (m *Model) restarted(killed, empty bool, readFaults bool) {
	m.readFaults = readFaults
	defer func() {
		for k := range m.keys {
			m.trace(k, "restarted (killed %v, empty %v)", killed, empty)
		}
	}()
	for _, s := range m.keys {
		s.must = false
		s.inflight = 0
		s.loading = 0
		if empty && !m.sh.HasRemote() {
			s.present, s.freed, s.ghosts = s.present[:0], nil, nil
			s.corrupt = false
			continue
		}
		for _, g := range s.freed {
			s.present = addGen(s.present, g)
		}
		if m.tol["ghost-after-restart"] {
			for _, g := range s.ghosts {
				s.present = addGen(s.present, g)
			}
			continue
		}
		// The invalidation marks erase every copy at recovery, after a
		// clean stop or a SIGKILL alike.
		s.ghosts = nil
	}
}

// corrupted records external damage to disk slots of keys of (ns, group).
func (m *Model) corrupted(ns, group int) {
	for k, s := range m.keys {
		if k.NS == ns && k.Group == group && len(s.present) > 0 {
			s.corrupt = true
		}
	}
}

// blockRec is one block of an accepted job.
type blockRec struct {
	key    KeyRef
	block  uint32 // engine block
	issued int
	// Store: alone (no other store of the key in flight) and the loss
	// count before it was accepted.
	alone bool
	base  float64
	// Load: the generations it may read, and whether a live lease holds
	// it (then MISSING is wrong).
	allowed []uint32
	leased  bool
	// staleLease: its lease holds a generation invalidated since.
	staleLease bool
	// clearFrom: a failure of the load clears the key as of this tick, not
	// its own: a store of the key sent in the same burst (finished, and
	// ticked, first) may have come after the load dropped the key.
	clearFrom int
	// corrupt: external damage may have hit its disk copy when the load
	// was issued or, for a block its lease holds, when the lease pinned it
	// (a failed load that clears the key later does not unpin the copy).
	corrupt bool
	// Both: the key was a must when the job was accepted, with this base.
	must     bool
	mustBase float64
}

// jobRec is an accepted (or maybe accepted) job of a registration.
type jobRec struct {
	id          uint64
	op          Kind // Store or Load
	group       int
	blocks      []blockRec
	issued      int
	step        int
	incarnation int
	// maybe: the call that carried it failed in a way that leaves open
	// whether the daemon accepted it; returned is when it did.
	maybe    bool
	returned time.Time
	// lossy: a maybe-job of a wait without ack_seq, whose results a reply
	// sent as the caller gave up takes with it (documented).
	lossy bool
	// dma: a region fault may hit it (DMA_ERROR allowed).
	dma bool
}

// lease is a Lookup's lease as the runner saw it.
type lease struct {
	id       uint64
	set      []int // namespace specs
	group    int
	keys     map[KeyRef][]uint32 // generations each leased key may hold
	sent     time.Time           // before the Lookup was sent: the deadline is at least sent+ms
	ms       uint32
	consumed map[int]bool    // namespace spec -> a load of it named the lease
	corrupt  map[KeyRef]bool // keys whose disk copy may have been damaged when pinned
	anyUsed  bool
	step     int
	// The connection that took it: only its Loads use it.
	client, gen int
}

// live reports whether the lease was surely still alive at a moment no
// later than at.
func (l *lease) live(at time.Time) bool {
	return at.Before(l.sent.Add(time.Duration(l.ms) * time.Millisecond))
}

// Finding is a check that failed.
type Finding struct {
	Step     int
	Op       Op
	Category string
	Detail   string
}

func (f Finding) String() string {
	return fmt.Sprintf("step %d (%s): %s: %s", f.Step, f.Op, f.Category, f.Detail)
}

// ErrFinding wraps the first finding of a run.
type ErrFinding struct{ Finding }

func (e *ErrFinding) Error() string { return e.Finding.String() }
