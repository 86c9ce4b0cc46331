package offload

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
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
}

// Registration is one client's mapping of engine memory into a namespace.
type Registration struct {
	ID   uint64
	s    *Service
	ns   *Namespace
	reg  *layout.Regions
	peer dma.Peer
	name string
	jobs sync.WaitGroup

	mu struct {
		sync.Mutex
		pending map[uint64]struct{}
		done    []Result
		notify  chan struct{} // closed and replaced when done grows
		closed  bool
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
	close(r.mu.notify)
	r.mu.notify = make(chan struct{})
	r.mu.Unlock()
	return true
}

// Completions returns finished jobs not yet returned, waiting up to wait for
// one when there is none. It returns at most max (0: all).
func (r *Registration) Completions(ctx context.Context, wait time.Duration, max int) ([]Result, int, error) {
	var timer <-chan time.Time
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		timer = t.C
	}
	for {
		r.mu.Lock()
		if r.mu.closed && len(r.mu.pending) == 0 {
			r.mu.Unlock()
			return nil, 0, fmt.Errorf("%w: registration_id %d was unregistered", ErrUnknownRegistration, r.ID)
		}
		if n := len(r.mu.done); n > 0 || timer == nil {
			if max > 0 && n > max {
				n = max
			}
			out := make([]Result, n)
			copy(out, r.mu.done)
			rest := copy(r.mu.done, r.mu.done[n:])
			clear(r.mu.done[rest:])
			r.mu.done = r.mu.done[:rest]
			pending := len(r.mu.pending)
			r.mu.Unlock()
			return out, pending, nil
		}
		notify := r.mu.notify
		r.mu.Unlock()
		select {
		case <-notify:
		case <-timer:
			timer = nil
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		case <-r.s.closing:
			timer = nil
		}
	}
}

// waiter collects the results of a Transfer with wait set. If the caller
// gives up, results still to come go to Completions instead: no job's
// result is ever lost.
type waiter struct {
	mu        sync.Mutex
	results   []Result
	left      int
	done      chan struct{}
	abandoned bool
}

func (r *Registration) deliver(w *waiter, slot int, res Result) {
	if w != nil {
		w.mu.Lock()
		if !w.abandoned {
			w.results[slot] = res
			w.left--
			if w.left == 0 {
				close(w.done)
			}
			w.mu.Unlock()
			r.finish(res, false)
			return
		}
		w.mu.Unlock()
	}
	r.finish(res, true)
}

// finish retires a job: it leaves pending and, when queue is set, joins the
// completions.
func (r *Registration) finish(res Result, queue bool) {
	r.mu.Lock()
	delete(r.mu.pending, res.JobID)
	if queue {
		// Kept while the registration drains, so a client that lost its
		// connection can still read them; close drops what is left.
		r.mu.done = append(r.mu.done, res)
	}
	close(r.mu.notify)
	r.mu.notify = make(chan struct{})
	r.mu.Unlock()
}

// blockRef is one block of a job on its way through the copy engine.
type blockRef struct {
	key  index.Key
	slot cpu.SlotID
	i    int // position in the job
}

// Transfer validates every job of a Store or Load request, accepts them all
// or none, and starts them. With wait it returns their results; otherwise
// they arrive through Completions.
func (r *Registration) Transfer(ctx context.Context, op Op, jobs []Job, wait bool, readyEvent []byte) ([]Result, error) {
	s := r.s
	if err := r.validate(op, jobs); err != nil {
		s.m.refused.WithLabelValues("invalid").Inc()
		return nil, err
	}
	s.mu.Lock()
	closing := s.mu.closing
	if !closing {
		s.jobs.Add(len(jobs))
	}
	s.mu.Unlock()
	if closing {
		s.m.refused.WithLabelValues("shutting_down").Inc()
		return nil, ErrShuttingDown
	}
	r.mu.Lock()
	err := r.admitLocked(jobs)
	if err == nil {
		r.jobs.Add(len(jobs))
	}
	r.mu.Unlock()
	if err != nil {
		s.jobs.Add(-len(jobs))
		s.m.refused.WithLabelValues("backlog").Inc()
		return nil, err
	}
	s.m.pendingJobs.Add(float64(len(jobs)))
	var w *waiter
	if wait {
		w = &waiter{results: make([]Result, len(jobs)), left: len(jobs), done: make(chan struct{})}
	}
	if op == OpStore {
		r.startStores(jobs, w, readyEvent)
	} else {
		for i := range jobs {
			r.startLoad(&jobs[i], w, i)
		}
	}
	if w == nil {
		return nil, nil
	}
	select {
	case <-w.done:
		return w.results, nil
	case <-ctx.Done():
		w.mu.Lock()
		if w.left == 0 {
			w.mu.Unlock()
			return w.results, nil
		}
		// Results already in w go to Completions too.
		w.abandoned = true
		var got []Result
		for _, res := range w.results {
			if res.Op != 0 {
				got = append(got, res)
			}
		}
		w.mu.Unlock()
		r.mu.Lock()
		if !r.mu.closed {
			r.mu.done = append(r.mu.done, got...)
		}
		r.mu.Unlock()
		return nil, ctx.Err()
	}
}

func (r *Registration) admitLocked(jobs []Job) error {
	if r.mu.closed {
		return fmt.Errorf("%w: registration_id %d is being unregistered", ErrUnknownRegistration, r.ID)
	}
	if n := len(r.mu.pending) + len(r.mu.done) + len(jobs); n > r.s.lim.MaxPending {
		return fmt.Errorf("%w: %d jobs would be unfinished or unread, at most %d per registration", ErrBacklog, n, r.s.lim.MaxPending)
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
	return nil
}

func (r *Registration) validate(op Op, jobs []Job) error {
	lim := r.s.lim
	if len(jobs) == 0 {
		return fmt.Errorf("%w: jobs is empty", ErrInvalid)
	}
	if len(jobs) > lim.MaxJobsPerRequest {
		return fmt.Errorf("%w: %d jobs, at most %d per request", ErrInvalid, len(jobs), lim.MaxJobsPerRequest)
	}
	hb := r.ns.Layout.HashBytes
	total := 0
	ids := make(map[uint64]struct{}, len(jobs))
	for j := range jobs {
		job := &jobs[j]
		f := fmt.Sprintf("jobs[%d]", j)
		if _, dup := ids[job.ID]; dup {
			return fmt.Errorf("%w: %s.job_id %d appears twice in the request", ErrInvalid, f, job.ID)
		}
		ids[job.ID] = struct{}{}
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
		var seenBlock map[uint32]int
		if op == OpLoad {
			seenBlock = make(map[uint32]int, n)
		}
		for i, b := range job.BlockIDs {
			if b >= nb {
				return fmt.Errorf("%w: %s.block_ids[%d] = %d is out of range (the registered regions hold %d blocks)", ErrInvalid, f, i, b, nb)
			}
			h := string(job.Keys.Hashes[i*hb : (i+1)*hb])
			if p, dup := seenKey[h]; dup {
				return fmt.Errorf("%w: %s has the same key at positions %d and %d", ErrInvalid, f, p, i)
			}
			seenKey[h] = i
			if seenBlock != nil {
				if p, dup := seenBlock[b]; dup {
					return fmt.Errorf("%w: %s loads into block_id %d twice (positions %d and %d)", ErrInvalid, f, b, p, i)
				}
				seenBlock[b] = i
			}
		}
	}
	return nil
}

func (r *Registration) failure(job *Job, i int, st Status) Failure {
	hb := r.ns.Layout.HashBytes
	return Failure{Index: uint32(i), BlockID: job.BlockIDs[i], Hash: bytes.Clone(job.Keys.Hashes[i*hb : (i+1)*hb]), Status: st}
}

// startLoad pins the job's ready blocks and copies them into engine memory.
func (r *Registration) startLoad(job *Job, w *waiter, slot int) {
	s := r.s
	start := time.Now()
	hb := r.ns.Layout.HashBytes
	g := job.Keys.Group
	n := len(job.BlockIDs)
	res := Result{JobID: job.ID, RequestID: job.RequestID, Op: OpLoad, Blocks: uint32(n)}
	refs := make([]blockRef, 0, n)
	touched := make([]uint64, 0, n)
	for i := 0; i < n; i++ {
		k := makeKey(r.ns.ID, g, job.Keys.Hashes[i*hb:(i+1)*hb])
		touched = append(touched, index.HashKey(&k))
		slotID := index.NoSlot
		s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
			if found && e.State == index.Ready && e.CPU != index.NoSlot {
				s.cpu.Pin(e.CPU)
				slotID = e.CPU
			}
			return found
		})
		if slotID == index.NoSlot {
			res.Failures = append(res.Failures, r.failure(job, i, Missing))
			continue
		}
		refs = append(refs, blockRef{key: k, slot: slotID, i: i})
	}
	r.ns.classes[g].Touch(touched)
	if job.LeaseID != 0 {
		s.releaseLease(job.LeaseID)
	}
	r.runCopies(job, refs, false, nil, res, start, w, slot)
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
	for g, keys := range admit {
		r.ns.classes[g].Admit(keys)
	}
	for j := range jobs {
		job := &jobs[j]
		cl := &claims[j]
		c := r.ns.classes[job.Keys.Group]
		var forget []index.Key
		kept := cl.refs[:0]
		for _, ref := range cl.refs {
			st := OK
			s.ix.Mutate(&ref.key, func(e *index.Entry, found bool) bool {
				if !found || e.State != index.Writing || e.CPU != index.NoSlot {
					st = Rejected
					return found
				}
				slotID, ok := c.Alloc()
				if !ok {
					st = NoSpace
					return false
				}
				e.CPU = slotID
				ref.slot = slotID
				return true
			})
			switch st {
			case OK:
				kept = append(kept, ref)
			case NoSpace:
				forget = append(forget, ref.key)
				fallthrough
			default:
				cl.res.Failures = append(cl.res.Failures, r.failure(job, ref.i, st))
			}
		}
		cl.refs = kept
		for i := range forget {
			c.Forget(&forget[i])
		}
		r.runCopies(job, cl.refs, true, readyEvent, cl.res, start, w, j)
	}
}

// runCopies submits a job's copies and finishes the job when they drain.
func (r *Registration) runCopies(job *Job, refs []blockRef, toArena bool, readyEvent []byte, res Result, start time.Time, w *waiter, slot int) {
	if len(refs) == 0 {
		r.complete(job, refs, nil, res, start, w, slot)
		return
	}
	slotBytes := r.ns.Layout.PayloadBytes(job.Keys.Group)
	copies := make([]dma.Copy, 0, len(refs)*len(r.ns.Layout.Segments))
	for _, ref := range refs {
		copies = r.reg.AppendCopies(copies, job.Keys.Group, job.BlockIDs[ref.i], cpu.Offset(ref.slot))
	}
	res.Bytes = uint64(len(refs)) * slotBytes
	jobCopy := *job
	r.s.dma.Submit(&dma.Batch{
		ToArena:    toArena,
		Copies:     copies,
		ReadyEvent: readyEvent,
		Done: func(err error) {
			r.complete(&jobCopy, refs, err, res, start, w, slot)
		},
	})
}

// complete settles a job after its copies drained (or failed): a store's
// blocks become ready (or go), every pin is dropped, and the result is
// delivered.
func (r *Registration) complete(job *Job, refs []blockRef, copyErr error, res Result, start time.Time, w *waiter, slot int) {
	s := r.s
	op := res.Op
	var forget []index.Key
	for _, ref := range refs {
		if op == OpStore {
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
				return true
			})
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
	if len(forget) > 0 {
		c := r.ns.classes[job.Keys.Group]
		for i := range forget {
			c.Forget(&forget[i])
		}
	}
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
	r.deliver(w, slot, res)
	r.jobs.Done()
	s.jobs.Done()
}
