package offload

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
)

// Status is the outcome of one block of a job, numbered as the wire's.
type Status uint8

// Per-block statuses; see docs/api.md for what each means to the engine.
const (
	OK Status = iota
	Missing
	IOError
	Corrupt
	NoSpace
	DMAError
	Rejected
	Cancelled
)

var statusNames = [...]string{"ok", "missing", "io_error", "corrupt", "no_space", "dma_error", "rejected", "cancelled"}

func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("status(%d)", s)
}

// Op is a job's direction.
type Op uint8

// Ops, numbered as the wire's.
const (
	OpStore Op = 1
	OpLoad  Op = 2
)

func (o Op) String() string {
	if o == OpStore {
		return "store"
	}
	return "load"
}

// Job is one request's blocks of one group.
type Job struct {
	ID        uint64
	RequestID string
	Keys      Keys
	BlockIDs  []uint32
	LeaseID   uint64
}

// Failure is a block of a job that did not succeed.
type Failure struct {
	Index   uint32
	BlockID uint32
	Hash    []byte
	Status  Status
}

// Result is a finished job.
type Result struct {
	JobID     uint64
	RequestID string
	Op        Op
	OK        bool
	Failures  []Failure
	Blocks    uint32
	Bytes     uint64
	// Seq numbers the results of a registration's queue, from 1, in the
	// order they joined it; 0 on a result returned to a Transfer that
	// waited without an acknowledgement (it never joins the queue).
	Seq uint64
}

// Registration is one client's mapping of engine memory into a namespace.
type Registration struct {
	ID   uint64
	s    *Service
	ns   *Namespace
	reg  *layout.Regions
	peer dma.Peer
	name string
	key  string // the registration key peers find it by (FindRegistrations); guarded by Service.mu
	jobs sync.WaitGroup

	mu struct {
		sync.Mutex
		pending map[uint64]struct{}
		// done holds finished results not yet acknowledged (or, for a
		// client without a cursor, not yet read), in Seq order.
		done      []Result
		seq       uint64 // the last Seq given
		doneBytes int    // wire bytes of done
		// sent is the last Seq a reply carried (Completions, or a Store
		// or Load that acknowledges): the results after it were never
		// sent (WaitDelivered).
		sent uint64
		// reserved is the wire bytes the results of unfinished jobs may
		// take: with doneBytes, bounded by Limits.MaxUnreadBytes.
		reserved int
		notify   chan struct{} // closed and replaced when done grows
		closed   bool
	}
}

func newRegistration(s *Service, id uint64, ns *Namespace, reg *layout.Regions, peer dma.Peer, name string) *Registration {
	r := &Registration{ID: id, s: s, ns: ns, reg: reg, peer: peer, name: name}
	r.mu.pending = map[uint64]struct{}{}
	r.mu.notify = make(chan struct{})
	return r
}

// Namespace is the registration's namespace.
func (r *Registration) Namespace() *Namespace { return r.ns }

// closing reports whether the registration is being unregistered: its
// connection closed (the engine may be gone) or its client asked.
func (r *Registration) closing() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.mu.closed
}

// close refuses new jobs, waits for the registration's jobs to drain and
// unmaps its regions. It reports false if the registration was already
// closing.
func (r *Registration) close() bool {
	r.mu.Lock()
	if r.mu.closed {
		r.mu.Unlock()
		return false
	}
	r.mu.closed = true
	r.mu.Unlock()
	r.jobs.Wait()
	for _, o := range r.reg.Opened {
		if err := o.Close(); err != nil {
			r.s.log.Warn("unmapping a region", "registration", r.ID, "err", err)
		}
	}
	r.mu.Lock()
	r.mu.done = nil
	r.mu.doneBytes = 0
	close(r.mu.notify)
	r.mu.notify = make(chan struct{})
	r.mu.Unlock()
	r.s.signalRead()
	return true
}

// undelivered reports whether the registration, still open, holds a
// finished result that no reply has carried.
func (r *Registration) undelivered() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return !r.mu.closed && len(r.mu.done) > 0 && r.mu.done[len(r.mu.done)-1].Seq > r.mu.sent
}

// blockRef is one block of a job on its way through the copy engine.
type blockRef struct {
	key  index.Key
	slot cpu.SlotID
	i    int // position in the job
	// release: the slot was staged for this load only; it goes when the
	// copy has drained.
	release bool
}

// Transfer validates every job of a Store or Load request, accepts them all
// or none, and starts them. With wait it returns their results (one per
// job, in request order); otherwise they arrive through Completions. owner
// is the caller: a Load uses only the leases it owns. ack, when set,
// acknowledges the results up to it as Completions does, and keeps this
// request's results queued until a later acknowledgement even when they
// are returned here (see waiter). Without wait, an ack also makes Transfer
// answer as Completions would with that ack and no wait, once the jobs are
// started: the registration's finished results after it, those of this
// request that already finished among them.
func (r *Registration) Transfer(ctx context.Context, owner Owner, op Op, jobs []Job, wait bool, readyEvent []byte, ack *uint64) (Completed, error) {
	s := r.s
	if err := r.validate(op, jobs, readyEvent); err != nil {
		s.m.refused.WithLabelValues("invalid").Inc()
		return Completed{}, err
	}
	s.mu.Lock()
	closing := s.mu.closing
	if !closing {
		s.jobs.Add(len(jobs))
		s.inflight.Add(int64(len(jobs)))
	}
	s.mu.Unlock()
	if closing {
		s.m.refused.WithLabelValues("shutting_down").Inc()
		return Completed{}, ErrShuttingDown
	}
	r.mu.Lock()
	if ack != nil {
		r.ackLocked(*ack)
	}
	err := r.admitLocked(jobs)
	if err == nil {
		r.jobs.Add(len(jobs))
	}
	r.mu.Unlock()
	if err != nil {
		s.jobs.Add(-len(jobs))
		s.inflight.Add(-int64(len(jobs)))
		s.m.refused.WithLabelValues("backlog").Inc()
		return Completed{}, err
	}
	s.m.pendingJobs.Add(float64(len(jobs)))
	var w *waiter
	if wait {
		w = &waiter{results: make([]Result, len(jobs)), left: len(jobs), done: make(chan struct{}), acks: ack != nil}
	}
	if op == OpStore {
		r.startStores(jobs, w, readyEvent)
	} else {
		for i := range jobs {
			r.startLoad(&jobs[i], owner, w, i, readyEvent)
		}
	}
	if w != nil {
		res, err := r.waitResults(ctx, w, jobs)
		return Completed{Results: res}, err
	}
	if ack == nil {
		return Completed{}, nil
	}
	// Piggybacked: what is queued now, kept until acknowledged, so a reply
	// lost on its way costs nothing. The acknowledgement was applied above,
	// before admission: a backlog refusal still lets go of what the client
	// has processed.
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.finishedLocked(0, true), nil
}

func (r *Registration) admitLocked(jobs []Job) error {
	if r.mu.closed {
		return fmt.Errorf("%w: registration_id %d is being unregistered", ErrUnknownRegistration, r.ID)
	}
	if n := len(r.mu.pending) + len(r.mu.done) + len(jobs); n > r.s.lim.MaxPending {
		return fmt.Errorf("%w: %d jobs would be unfinished or unread, at most %d per registration", ErrBacklog, n, r.s.lim.MaxPending)
	}
	worst := 0
	for i := range jobs {
		worst += jobs[i].worstBytes()
	}
	if n := r.mu.doneBytes + r.mu.reserved + worst; n > r.s.lim.MaxUnreadBytes {
		return fmt.Errorf("%w: the results of unfinished and unread jobs could take %d bytes, at most %d per registration", ErrBacklog, n, r.s.lim.MaxUnreadBytes)
	}
	for i := range jobs {
		if _, dup := r.mu.pending[jobs[i].ID]; dup {
			for j := 0; j < i; j++ {
				delete(r.mu.pending, jobs[j].ID)
			}
			return fmt.Errorf("%w: jobs[%d].job_id %d is already pending", ErrInvalid, i, jobs[i].ID)
		}
		r.mu.pending[jobs[i].ID] = struct{}{}
	}
	r.mu.reserved += worst
	return nil
}

func (r *Registration) validate(op Op, jobs []Job, readyEvent []byte) error {
	lim := r.s.lim
	if len(jobs) == 0 {
		return fmt.Errorf("%w: jobs is empty", ErrInvalid)
	}
	if len(jobs) > lim.MaxJobsPerRequest {
		return fmt.Errorf("%w: %d jobs, at most %d per request", ErrInvalid, len(jobs), lim.MaxJobsPerRequest)
	}
	if len(readyEvent) > lim.MaxReadyEvent {
		return fmt.Errorf("%w: ready_event is %d bytes, at most %d", ErrInvalid, len(readyEvent), lim.MaxReadyEvent)
	}
	hb := r.ns.Layout.HashBytes
	total := 0
	ids := make(map[uint64]struct{}, len(jobs))
	// A load's engine blocks, over every job of the request: two copies
	// into one block would race.
	type target struct{ job, pos int }
	var loadInto map[uint64]target
	if op == OpLoad {
		loadInto = map[uint64]target{}
	}
	for j := range jobs {
		job := &jobs[j]
		f := fmt.Sprintf("jobs[%d]", j)
		if _, dup := ids[job.ID]; dup {
			return fmt.Errorf("%w: %s.job_id %d appears twice in the request", ErrInvalid, f, job.ID)
		}
		ids[job.ID] = struct{}{}
		if len(job.RequestID) > lim.MaxRequestID {
			return fmt.Errorf("%w: %s.request_id is %d bytes, at most %d", ErrInvalid, f, len(job.RequestID), lim.MaxRequestID)
		}
		if job.Keys.Group >= r.ns.Layout.NumGroups() {
			return fmt.Errorf("%w: %s.keys.group is %d, the namespace has %d groups", ErrInvalid, f, job.Keys.Group, r.ns.Layout.NumGroups())
		}
		n, err := job.Keys.count(hb, lim.MaxBlocksPerRequest, f+".keys")
		if err != nil {
			return err
		}
		if n == 0 {
			return fmt.Errorf("%w: %s has no keys", ErrInvalid, f)
		}
		if len(job.BlockIDs) != n {
			return fmt.Errorf("%w: %s has %d keys and %d block_ids", ErrInvalid, f, n, len(job.BlockIDs))
		}
		total += n
		if total > lim.MaxBlocksPerRequest {
			return fmt.Errorf("%w: request has more than %d blocks", ErrInvalid, lim.MaxBlocksPerRequest)
		}
		nb := r.reg.NumBlocks(job.Keys.Group)
		seenKey := make(map[string]int, n)
		for i, b := range job.BlockIDs {
			if b >= nb {
				return fmt.Errorf("%w: %s.block_ids[%d] = %d is out of range (the registered regions hold %d blocks)", ErrInvalid, f, i, b, nb)
			}
			h := string(job.Keys.Hashes[i*hb : (i+1)*hb])
			if p, dup := seenKey[h]; dup {
				return fmt.Errorf("%w: %s has the same key at positions %d and %d", ErrInvalid, f, p, i)
			}
			seenKey[h] = i
			if loadInto != nil {
				t := uint64(job.Keys.Group)<<32 | uint64(b)
				if p, dup := loadInto[t]; dup {
					if p.job == j {
						return fmt.Errorf("%w: %s loads into block_id %d twice (positions %d and %d)", ErrInvalid, f, b, p.pos, i)
					}
					return fmt.Errorf("%w: %s.block_ids[%d] and jobs[%d].block_ids[%d] both load into block_id %d of group %d", ErrInvalid, f, i, p.job, p.pos, b, job.Keys.Group)
				}
				loadInto[t] = target{j, i}
			}
		}
	}
	return nil
}

func (r *Registration) failure(job *Job, i int, st Status) Failure {
	hb := r.ns.Layout.HashBytes
	return Failure{Index: uint32(i), BlockID: job.BlockIDs[i], Hash: bytes.Clone(job.Keys.Hashes[i*hb : (i+1)*hb]), Status: st}
}

// startLoad pins the job's ready blocks and copies them into engine
// memory. Blocks only on disk are first read into CPU slots and verified.
// A lease the job names serves only if owner holds it, and only with its
// pins in this registration's namespace.
func (r *Registration) startLoad(job *Job, owner Owner, w *waiter, slot int, readyEvent []byte) {
	s := r.s
	lj := &loadJob{r: r, job: *job, w: w, wslot: slot, start: time.Now(), readyEvent: readyEvent}
	hb := r.ns.Layout.HashBytes
	g := job.Keys.Group
	n := len(job.BlockIDs)
	lj.res = Result{JobID: job.ID, RequestID: job.RequestID, Op: OpLoad, Blocks: uint32(n)}
	lj.refs = make([]blockRef, 0, n)
	var ls *lease
	if job.LeaseID != 0 {
		ls = s.takeLease(job.LeaseID, owner, r.ns.ID)
	}
	touched := make([]uint64, 0, n)
	var reads []diskRead
	var remotes []remoteRead
	for i := 0; i < n; i++ {
		k := makeKey(r.ns.ID, g, job.Keys.Hashes[i*hb:(i+1)*hb])
		touched = append(touched, index.HashKey(&k))
		cslot, dslot := index.NoSlot, index.NoSlot
		s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
			if !found || e.State != index.Ready {
				return found
			}
			// A slot at its pin ceiling serves as missing.
			if e.CPU != index.NoSlot {
				if s.cpu.Pin(e.CPU) {
					cslot = e.CPU
				}
			} else if e.Disk != index.NoSlot {
				if s.disk.Pin(e.Disk) {
					dslot = e.Disk
				}
			}
			return true
		})
		if lp, ok := ls.take(k); ok {
			// The lease's pin holds the block even if the index has
			// dropped it since; a CPU copy is the faster of the two.
			switch {
			case !lp.disk:
				s.unpinSlots(cslot, dslot)
				cslot, dslot = lp.slot, index.NoSlot
			case cslot == index.NoSlot:
				s.unpinSlots(index.NoSlot, dslot)
				dslot = lp.slot
			default:
				s.unpin(lp)
			}
		}
		switch {
		case cslot != index.NoSlot:
			lj.refs = append(lj.refs, blockRef{key: k, slot: cslot, i: i})
		case dslot != index.NoSlot:
			reads = append(reads, diskRead{key: k, dslot: dslot, i: i})
		case s.rem != nil:
			remotes = append(remotes, remoteRead{key: k, i: i})
		default:
			lj.res.Failures = append(lj.res.Failures, r.failure(job, i, Missing))
		}
	}
	if ls != nil {
		s.unpinLease(ls) // pins of this namespace's keys the job did not name
	}
	r.ns.classes[g].Touch(touched)
	if len(reads) == 0 && len(remotes) == 0 {
		lj.copy()
		return
	}
	lj.left = len(reads) + len(remotes)
	if len(remotes) > 0 {
		s.rem.fetch(lj, remotes)
	}
	if len(reads) > 0 {
		lj.promote(reads)
	}
}

// unpinSlots drops pins taken on a block's CPU or disk slot.
func (s *Service) unpinSlots(cslot, dslot cpu.SlotID) {
	if cslot != index.NoSlot {
		s.cpu.Unpin(cslot)
	}
	if dslot != index.NoSlot {
		s.disk.Unpin(dslot)
	}
}

// loadJob is a load in flight: its disk reads, then its copies.
type loadJob struct {
	r     *Registration
	job   Job
	w     *waiter
	wslot int
	start time.Time

	// readyEvent orders the copies after the engine's work still reading
	// the destination blocks (CUDA: an IPC event; see dma.Batch).
	readyEvent []byte

	mu   sync.Mutex
	res  Result
	refs []blockRef
	left int // disk reads and remote fetches not yet done
}

// diskRead is a block of a load that is only on disk.
type diskRead struct {
	key     index.Key
	dslot   cpu.SlotID
	i       int
	offered bool // offered to the CPU policy: kept in the CPU tier if admitted
}

func (lj *loadJob) copy() {
	lj.r.runCopies(&lj.job, lj.refs, false, lj.readyEvent, lj.res, lj.start, lj.w, lj.wslot, nil)
}

// promote reads disk-only blocks into CPU slots. Each block is offered to
// the CPU policy first; an admitted one stays in the CPU tier, the others
// use their slot for this load only.
func (lj *loadJob) promote(reads []diskRead) {
	r, s := lj.r, lj.r.s
	g := lj.job.Keys.Group
	c := r.ns.classes[g]
	var offer []index.Key
	for i := range reads {
		rd := &reads[i]
		s.ix.Mutate(&rd.key, func(e *index.Entry, found bool) bool {
			if found && e.State == index.Ready && e.CPU == index.NoSlot && e.Flags&index.Promoting == 0 {
				e.Flags |= index.Promoting
				rd.offered = true
			}
			return found
		})
		if rd.offered {
			offer = append(offer, rd.key)
		}
	}
	c.Admit(offer)
	deadline := time.Now().Add(stageWait)
	src := slotSource{s: s, staging: true}
	for _, rd := range reads {
		staging, ok := src.alloc(c)
		if !ok {
			// Slots free up as evicted blocks reach the disk; the
			// stager waits for one (briefly) instead of failing now.
			s.stageLater(stageReq{lj: lj, rd: rd, c: c, deadline: deadline})
			continue
		}
		lj.read(rd, staging)
	}
}

// read starts the disk read of rd into the CPU slot staging.
func (lj *loadJob) read(rd diskRead, staging cpu.SlotID) {
	s := lj.r.s
	payload := lj.r.ns.Layout.PayloadBytes(lj.job.Keys.Group)
	m := s.diskMeta(&rd.key)
	s.disk.Read(rd.dslot, m, s.cpu.Slot(staging, layout.AlignUp(payload)), func(err error) {
		lj.readDone(rd, staging, err)
	})
}

// readDone settles one disk read: a failed block's disk copy is dropped
// from the index (and its slot quarantined after an I/O error) before the
// job can complete; a good one joins the copies, kept in the CPU tier if
// the policy admitted it.
func (lj *loadJob) readDone(rd diskRead, staging cpu.SlotID, err error) {
	r, s := lj.r, lj.r.s
	st := OK
	switch {
	case staging == index.NoSlot:
		st = NoSpace
	case errors.Is(err, disk.ErrCorrupt):
		st = Corrupt
	case err != nil:
		st = IOError
	}
	attached, forgetCPU, forgetDisk := false, false, false
	s.ix.Mutate(&rd.key, func(e *index.Entry, found bool) bool {
		if !found {
			return false
		}
		admitted := rd.offered && e.Flags&index.Promoting != 0
		if rd.offered {
			e.Flags &^= index.Promoting
		}
		if st == IOError || st == Corrupt {
			if e.Disk == rd.dslot {
				if disk.ShouldQuarantine(err) {
					s.disk.Quarantine(e.Disk)
				} else {
					s.disk.Release(e.Disk)
				}
				e.Disk = index.NoSlot
				forgetDisk = true
			}
			forgetCPU = admitted
			return e.Holds()
		}
		if st == OK && admitted && e.CPU == index.NoSlot && e.State == index.Ready {
			e.CPU = staging
			attached = true
		} else {
			forgetCPU = admitted
		}
		return true
	})
	s.disk.Unpin(rd.dslot)
	g := lj.job.Keys.Group
	if forgetCPU {
		s.forgetCPU(r.ns.classes[g], &rd.key)
	}
	if forgetDisk {
		s.forgetDisk(r.ns.diskClasses[g], &rd.key)
	}
	if attached {
		s.dm.promoted.Inc()
		s.noteClean(r.ns.classes[g], rd.key) // it is on disk too
	}
	if st != OK && staging != index.NoSlot {
		s.cpu.Release(staging)
		s.cpu.Unpin(staging)
	}
	if st == IOError || st == Corrupt {
		s.log.Warn("disk read failed; the block is dropped and reported failed", "status", st, "registration", r.ID, "job", lj.job.ID, "block_id", lj.job.BlockIDs[rd.i], "err", err)
	}
	lj.mu.Lock()
	if st == OK {
		lj.refs = append(lj.refs, blockRef{key: rd.key, slot: staging, i: rd.i, release: !attached})
	} else {
		lj.res.Failures = append(lj.res.Failures, r.failure(&lj.job, rd.i, st))
	}
	lj.left--
	last := lj.left == 0
	lj.mu.Unlock()
	if last {
		lj.copy()
	}
}

// startStores claims the keys of every job, asks the policy to admit the
// new ones, takes slots and copies engine memory into them.
func (r *Registration) startStores(jobs []Job, w *waiter, readyEvent []byte) {
	s := r.s
	start := time.Now()
	hb := r.ns.Layout.HashBytes
	type claim struct {
		refs []blockRef
		res  Result
	}
	claims := make([]claim, len(jobs))
	admit := make([][]index.Key, r.ns.Layout.NumGroups())
	for j := range jobs {
		job := &jobs[j]
		g := job.Keys.Group
		cl := &claims[j]
		cl.res = Result{JobID: job.ID, RequestID: job.RequestID, Op: OpStore, Blocks: uint32(len(job.BlockIDs))}
		for i := range job.BlockIDs {
			k := makeKey(r.ns.ID, g, job.Keys.Hashes[i*hb:(i+1)*hb])
			claimed := false
			s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
				// Ready or being written by another job: nothing to do.
				claimed = !found
				return true
			})
			if claimed {
				cl.refs = append(cl.refs, blockRef{key: k, slot: index.NoSlot, i: i})
				admit[g] = append(admit[g], k)
			}
		}
	}
	// One admission per CPU class: groups of one slot size share a class,
	// and an admission grows its class for its own keys only, so admitting
	// group by group judged each group's keys against room for one group
	// (refusing blocks while the tier had free chunks).
	claimed := 0
	for g, keys := range admit {
		c := r.ns.classes[g]
		if slices.Index(r.ns.classes, c) < g {
			continue // admitted with its class's first group
		}
		for h := g + 1; h < len(admit); h++ {
			if r.ns.classes[h] == c && len(admit[h]) > 0 {
				keys = append(slices.Clip(keys), admit[h]...)
			}
		}
		c.Admit(keys)
		claimed += len(keys)
	}
	s.noteStore(claimed)
	// The generation records the blocks are published with, read while
	// their copies run; the jobs complete once both are done (remote.go,
	// storeStamps). Nil without remote publishing.
	stamps := s.rem.readStamps(r.ns, admit)
	src := slotSource{s: s}
	for j := range jobs {
		job := &jobs[j]
		cl := &claims[j]
		c := r.ns.classes[job.Keys.Group]
		var forget []index.Key
		kept := cl.refs[:0]
		for _, ref := range cl.refs {
			st := OK
			// The slot is taken outside the entry's lock: a clean copy
			// that gives its slot up (allocCPU) is another entry, maybe
			// of the same index shard.
			var slotID cpu.SlotID
			have := false
			if e, found := s.ix.Get(&ref.key); found && e.State == index.Writing && e.CPU == index.NoSlot {
				slotID, have = src.alloc(c)
			}
			s.ix.Mutate(&ref.key, func(e *index.Entry, found bool) bool {
				if !found || e.State != index.Writing || e.CPU != index.NoSlot {
					st = Rejected
					return found
				}
				if !have {
					st = NoSpace
					return false
				}
				e.CPU = slotID
				ref.slot = slotID
				have = false
				return true
			})
			if have {
				// The entry changed in between: the slot goes back.
				s.cpu.Release(slotID)
				s.cpu.Unpin(slotID)
			}
			switch st {
			case OK:
				kept = append(kept, ref)
			case NoSpace:
				s.noSpace()
				forget = append(forget, ref.key)
				fallthrough
			default:
				cl.res.Failures = append(cl.res.Failures, r.failure(job, ref.i, st))
			}
		}
		cl.refs = kept
		for i := range forget {
			s.forgetCPU(c, &forget[i])
		}
		r.runCopies(job, cl.refs, true, readyEvent, cl.res, start, w, j, stamps)
	}
}

// runCopies submits a job's copies and finishes the job when they drain
// (a store's: and its blocks' stamps, if any, are read).
func (r *Registration) runCopies(job *Job, refs []blockRef, toArena bool, readyEvent []byte, res Result, start time.Time, w *waiter, slot int, stamps *storeStamps) {
	if len(refs) == 0 {
		r.complete(job, refs, nil, res, start, w, slot, nil)
		return
	}
	slotBytes := r.ns.Layout.PayloadBytes(job.Keys.Group)
	copies := make([]dma.Copy, 0, len(refs)*len(r.ns.Layout.Segments))
	for _, ref := range refs {
		copies = r.reg.AppendCopies(copies, job.Keys.Group, job.BlockIDs[ref.i], cpu.Offset(ref.slot))
	}
	res.Bytes = uint64(len(refs)) * slotBytes
	jobCopy := *job
	b := &dma.Batch{
		ToArena:    toArena,
		Copies:     copies,
		ReadyEvent: readyEvent,
		Done: func(err error) {
			stamps.after(func() { r.complete(&jobCopy, refs, err, res, start, w, slot, stamps) })
		},
	}
	if len(readyEvent) > 0 {
		b.Abandoned = r.closing
	}
	r.s.dma.Submit(b)
}

// complete settles a job after its copies drained (or failed): a store's
// blocks become ready (or go), every pin is dropped, and the result is
// delivered.
func (r *Registration) complete(job *Job, refs []blockRef, copyErr error, res Result, start time.Time, w *waiter, slot int, stamps *storeStamps) {
	s := r.s
	op := res.Op
	var forget []index.Key
	for _, ref := range refs {
		if op == OpStore {
			dirty := false
			var sum uint64
			record := false
			if copyErr == nil {
				sum, record = s.storedSum(r.ns, job.Keys.Group, ref.slot)
			}
			s.ix.Mutate(&ref.key, func(e *index.Entry, found bool) bool {
				if !found || e.CPU != ref.slot || e.State != index.Writing {
					// Evicted or invalidated while written; whoever
					// removed it released the slot. Not stored.
					if copyErr == nil {
						res.Failures = append(res.Failures, r.failure(job, ref.i, Rejected))
					}
					return found
				}
				if copyErr != nil {
					s.dropEntryLocked(e)
					forget = append(forget, ref.key)
					return false
				}
				e.State = index.Ready
				if record && e.Flags&index.Spill == 0 {
					// Its bytes have drained into the slot: from now on
					// a restart on the same arena brings it back.
					s.recordStored(r.ns, &ref.key, ref.slot, sum)
				}
				switch spill := e.Flags&index.Spill != 0; {
				case spill:
					// Readable from its staging slot until the disk
					// write lands, like a block the policy evicted.
					e.Flags &^= index.Spill
					if s.cpu.Pin(e.CPU) {
						if s.demote(demotion{key: ref.key, cpuSlot: e.CPU}) {
							e.Flags |= index.DiskWriting
							return true
						}
						s.cpu.Unpin(e.CPU)
					}
					s.dropCopiesLocked(e)
					res.Failures = append(res.Failures, r.failure(job, ref.i, Rejected))
					return false
				case s.disk != nil && s.writeThrough:
					if s.cpu.Pin(e.CPU) {
						if s.demote(demotion{key: ref.key, cpuSlot: e.CPU, keepCPU: true}) {
							e.Flags |= index.DiskWriting
						} else {
							s.cpu.Unpin(e.CPU)
						}
					}
				default:
					dirty = s.disk != nil
				}
				return true
			})
			if dirty {
				s.noteDirty(r.ns.classes[job.Keys.Group], ref.key)
			}
			if s.rem != nil && copyErr == nil {
				s.rem.publishStored(r.ns, ref.key, ref.slot, stamps)
			}
		}
		if op == OpLoad && copyErr != nil {
			// DESIGN §3.4: a block whose load failed for any reason
			// leaves the index before the result goes out, and its disk
			// copy is erased: it does not come back after a restart either.
			s.ix.Mutate(&ref.key, func(e *index.Entry, found bool) bool {
				if found {
					s.dropEntryLocked(e)
					forget = append(forget, ref.key)
				}
				return false
			})
		}
		if ref.release {
			s.cpu.Release(ref.slot)
		}
		s.cpu.Unpin(ref.slot)
		if copyErr != nil {
			res.Failures = append(res.Failures, r.failure(job, ref.i, DMAError))
		}
	}
	if copyErr != nil {
		res.Bytes = 0
		s.log.Warn("copy failed", "op", op, "registration", r.ID, "job", job.ID, "blocks", len(refs), "err", copyErr)
	}
	s.forget(forget)
	res.OK = len(res.Failures) == 0
	opName := op.String()
	failed := 0
	for _, f := range res.Failures {
		s.m.blocks.WithLabelValues(opName, f.Status.String()).Inc()
		failed++
	}
	s.m.blocks.WithLabelValues(opName, "ok").Add(float64(int(res.Blocks) - failed))
	s.c.failed.Add(uint64(failed))
	if op == OpStore {
		s.c.stored.Add(uint64(int(res.Blocks) - failed))
	} else {
		s.c.loaded.Add(uint64(int(res.Blocks) - failed))
	}
	s.m.bytes.WithLabelValues(opName).Add(float64(res.Bytes))
	s.m.jobSeconds.WithLabelValues(opName).Observe(time.Since(start).Seconds())
	s.m.pendingJobs.Dec()
	if !res.OK && s.log.Enabled(context.Background(), slog.LevelDebug) {
		s.log.Debug("job finished with failures", "op", opName, "registration", r.ID, "job", job.ID, "request", job.RequestID, "failed", len(res.Failures), "blocks", res.Blocks)
	}
	// Nothing of the job is in flight any more: counted before the result
	// goes out, so a client that has every result finds the service idle.
	s.inflight.Add(-1)
	r.deliver(w, slot, res, job.worstBytes())
	r.jobs.Done()
	s.jobs.Done()
}
