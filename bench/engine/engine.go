// Package engine owns kvbench's synthetic inference engine: it drives a
// kvoffloadd the way vLLM's connector does, one scheduler step at a time
// (one Lookup per request, one Load of the hits with a job per request,
// one Store of the blocks the engine computed, Completions until the
// step's jobs are done), checks every loaded block byte for byte, and
// checks that a block reported failed is not offered again until it is
// stored again.
package engine

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/workload"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// Config is one run.
type Config struct {
	Client      *client.Client
	Region      *model.Region
	Fingerprint []byte
	Steps       [][]workload.Request
	// LeaseMs pins each Lookup's ready prefix until its Load (0: no lease).
	LeaseMs uint32
	// StepTimeout bounds one step's RPCs and waits.
	StepTimeout time.Duration
	// BetweenSteps, if set, runs after every step (external corruption).
	BetweenSteps func(step int) error
	// DiskLoads, after the steps, loads every block of the run that is
	// only on disk: the disk read path measured alone.
	DiskLoads bool
	// IdleLookups, if > 0, times that many Lookups of the last step's
	// requests after the run, one at a time with nothing else in flight:
	// the Lookup cost alone, measured as the empty gRPC baseline is.
	IdleLookups int
	// Progress, if set, is called after every step.
	Progress func(done, total int)
	// Keep leaves the run's blocks cached at the end instead of
	// invalidating them: a daemon of kvbench's own whose blocks another
	// node then reads from the remote tier (an Invalidate would delete
	// them from it).
	Keep bool
}

// Op is what one kind of call did over a run.
type Op struct {
	Calls  int
	Blocks int    // blocks asked for
	Bytes  uint64 // bytes the daemon reports it moved
	// Busy is the wall time the op's phases took (RPC sent to last
	// completion), summed over steps.
	Busy time.Duration
	// Latencies are per call (lookup) or per job (load, store: from the
	// RPC being sent to its completion being read).
	Latencies []time.Duration
	// Completions counts the Completions round trips the op's calls
	// needed until all their jobs were reported.
	Completions int
}

// GBps is bytes over busy time, in 10^9 bytes per second.
func (o *Op) GBps() float64 {
	if o.Busy <= 0 {
		return 0
	}
	return float64(o.Bytes) / o.Busy.Seconds() / 1e9
}

// Result is what a run measured and found.
type Result struct {
	Steps  int
	Lookup Op
	// IdleLookup is Config.IdleLookups' measurement.
	IdleLookup Op
	Load       Op
	// DiskLoad is Config.DiskLoads' measurement.
	DiskLoad       Op
	DiskLoadFailed map[string]int
	Store          Op
	// CheckLookups counts the Lookups made right after a failed load to
	// see that the failed keys are gone (not timed).
	CheckLookups int

	// Blocks looked up, and how many of them were ready, by tier (a block
	// in both tiers counts as cpu: that is where it loads from).
	LookedUp         int
	HitCPU, HitDisk  int
	HitRemote        int // remote tier only
	KindLookedUp     [workload.NumKinds]int
	KindHit          [workload.NumKinds]int
	LoadFailed       map[string]int // by status
	StoreFailed      map[string]int
	CorruptDelivered int // blocks loaded OK whose bytes were wrong
	FailedReoffered  int // offered by Lookup after a failed load, before being stored again
	// ReadFailures counts the blocks of load jobs reported IO_ERROR or
	// CORRUPT. A key in two jobs of one Load may be read twice, and fail
	// twice; a daemon that reads it once fails both jobs' blocks: either
	// way every failed disk read shows up here at least once.
	ReadFailures       int
	BlocksFailedLoaded int // every failed block of every load job
	FirstCorrupt       string
	FirstReoffer       string
	// FailedButDelivered counts keys that failed in one job of a Load and
	// were delivered intact to another job of the same Load; they are not
	// held against a later Lookup.
	FailedButDelivered int

	// RemoteLoad is RemoteLoads' measurement: blocks only the remote tier
	// held, loaded through the daemon.
	RemoteLoad       Op
	RemoteLoadFailed map[string]int
}

type job struct {
	req   *workload.Request
	base  int // engine block of the request's first block
	ready int
	lease uint64
	redo  int // first block the engine (re)computes
}

// Run drives the daemon through every step.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	c, reg := cfg.Client, cfg.Region
	if cfg.StepTimeout <= 0 {
		cfg.StepTimeout = time.Minute
	}
	rctx, cancel := context.WithTimeout(ctx, cfg.StepTimeout)
	r, err := c.Register(rctx, cfg.Fingerprint, reg.Shape.Layout(), reg.Wire(), "kvbench")
	cancel()
	if err != nil {
		return nil, fmt.Errorf("register: %w", err)
	}
	d := &driver{
		cfg: cfg, c: c, reg: reg, id: r.RegistrationId, ns: r.NamespaceId,
		failed: map[string]failure{},
		res:    newResult(),
	}
	runErr := d.warm(ctx)
	if runErr == nil {
		runErr = d.run(ctx)
	}
	if runErr == nil && cfg.DiskLoads {
		runErr = d.diskLoads(ctx)
	}
	if runErr == nil && cfg.IdleLookups > 0 && len(cfg.Steps) > 0 {
		runErr = d.idleLookups(ctx)
	}
	uctx, cancel := context.WithTimeout(context.Background(), cfg.StepTimeout)
	defer cancel()
	// Drop this run's blocks so a shared daemon (--socket) is left as found.
	var ierr error
	if !cfg.Keep {
		_, ierr = c.Invalidate(uctx, []uint32{d.ns}, nil)
	}
	uerr := c.Unregister(uctx, d.id)
	return d.res, errors.Join(runErr, ierr, uerr)
}

func newResult() *Result {
	return &Result{LoadFailed: map[string]int{}, StoreFailed: map[string]int{}, DiskLoadFailed: map[string]int{}, RemoteLoadFailed: map[string]int{}}
}

// failure is a key's failed load: its status and where it happened.
type failure struct {
	status pb.BlockStatus
	where  string
}

// reoffered counts a failed key found in a ready prefix.
func (d *driver) reoffered(key []byte, by string) {
	f, bad := d.failed[string(key)]
	if !bad {
		return
	}
	d.res.FailedReoffered++
	if d.res.FirstReoffer == "" {
		d.res.FirstReoffer = fmt.Sprintf("key %x failed %s in %s, offered again by %s", key[:8], statusName(f.status), f.where, by)
	}
}

type driver struct {
	cfg     Config
	c       *client.Client
	reg     *model.Region
	id      uint64
	ns      uint32
	nextJob uint64
	// failed holds keys whose load failed and that have not been stored
	// since: no Lookup may offer them.
	failed map[string]failure
	res    *Result
}

// warm stores every engine block under a throwaway key, loads it back and
// drops it, untimed. The daemon maps the engine's memory at Register; its
// first touch of each page is a page fault (12 µs per 4 KiB page on a
// nested-virtualization VM), a cost a real engine pays once at start and
// which would otherwise land in the first steps' numbers.
func (d *driver) warm(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.StepTimeout)
	defer cancel()
	hashes := make([][]byte, d.reg.Blocks)
	ids := make([]uint32, d.reg.Blocks)
	for i := range hashes {
		h := sha256.Sum256(fmt.Appendf(nil, "kvbench warm-up %d", i))
		hashes[i], ids[i] = h[:], uint32(i)
	}
	keys, _ := client.Keys(0, model.HashBytes, hashes...)
	var scratch Op
	for _, send := range []func(*pb.TransferRequest) error{
		func(r *pb.TransferRequest) error { _, err := d.c.API.Store(ctx, r); return err },
		func(r *pb.TransferRequest) error { _, err := d.c.API.Load(ctx, r); return err },
	} {
		d.nextJob++
		if _, err := d.transfer(ctx, &scratch, []*pb.Job{{JobId: d.nextJob, RequestId: "warm-up", Keys: keys, BlockIds: ids}}, send); err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
	}
	if _, err := d.c.Invalidate(ctx, []uint32{d.ns}, keys); err != nil {
		return fmt.Errorf("warm-up: invalidate: %w", err)
	}
	return nil
}

func (d *driver) idleLookups(ctx context.Context) error {
	reqs := d.cfg.Steps[len(d.cfg.Steps)-1]
	op := &d.res.IdleLookup
	for i := range d.cfg.IdleLookups {
		r := reqs[i%len(reqs)]
		keys, _ := client.Keys(0, model.HashBytes, r.Keys...)
		t0 := time.Now()
		if _, err := d.c.Lookup(ctx, []uint32{d.ns}, keys, 0); err != nil {
			return fmt.Errorf("idle lookup: %w", err)
		}
		el := time.Since(t0)
		op.Calls++
		op.Busy += el
		op.Latencies = append(op.Latencies, el)
	}
	return nil
}

func (d *driver) run(ctx context.Context) error {
	for i, step := range d.cfg.Steps {
		if err := ctx.Err(); err != nil {
			return err
		}
		sctx, cancel := context.WithTimeout(ctx, d.cfg.StepTimeout)
		err := d.step(sctx, step)
		cancel()
		if err != nil {
			return fmt.Errorf("step %d: %w", i, err)
		}
		d.res.Steps++
		if d.cfg.BetweenSteps != nil {
			if err := d.cfg.BetweenSteps(i); err != nil {
				return fmt.Errorf("after step %d: %w", i, err)
			}
		}
		if d.cfg.Progress != nil {
			d.cfg.Progress(i+1, len(d.cfg.Steps))
		}
	}
	return nil
}

func (d *driver) step(ctx context.Context, reqs []workload.Request) error {
	jobs := make([]*job, len(reqs))
	base := 0
	for i := range reqs {
		jobs[i] = &job{req: &reqs[i], base: base}
		base += len(reqs[i].Keys)
	}
	if err := d.lookup(ctx, jobs); err != nil {
		return err
	}
	if err := d.load(ctx, jobs); err != nil {
		return err
	}
	return d.store(ctx, jobs)
}

func (d *driver) lookup(ctx context.Context, jobs []*job) error {
	res := d.res
	for _, j := range jobs {
		keys, _ := client.Keys(0, model.HashBytes, j.req.Keys...)
		t0 := time.Now()
		lr, err := d.c.Lookup(ctx, []uint32{d.ns}, keys, d.cfg.LeaseMs)
		el := time.Since(t0)
		if err != nil {
			return fmt.Errorf("lookup %s: %w", j.req.ID, err)
		}
		res.Lookup.Calls++
		res.Lookup.Latencies = append(res.Lookup.Latencies, el)
		res.Lookup.Busy += el
		j.ready, j.lease, j.redo = int(lr.GetReady()), lr.GetLeaseId(), int(lr.GetReady())
		if j.ready > len(j.req.Keys) || len(lr.GetTiers()) != j.ready {
			return fmt.Errorf("lookup %s: ready %d of %d keys with %d tiers", j.req.ID, j.ready, len(j.req.Keys), len(lr.GetTiers()))
		}
		n := len(j.req.Keys)
		res.LookedUp += n
		res.KindLookedUp[j.req.Kind] += n
		res.KindHit[j.req.Kind] += j.ready
		for i, t := range lr.GetTiers() {
			switch t {
			case pb.Tier_TIER_DISK:
				res.HitDisk++
			case pb.Tier_TIER_REMOTE:
				res.HitRemote++
			default:
				res.HitCPU++
			}
			d.reoffered(j.req.Keys[i], fmt.Sprintf("the Lookup of %s in step %d", j.req.ID, d.res.Steps))
		}
	}
	return nil
}

func (d *driver) load(ctx context.Context, jobs []*job) error {
	return d.loadJobs(ctx, jobs, &d.res.Load, d.res.LoadFailed)
}

// loadJobs sends one Load with a job per request that has ready blocks,
// reads Completions until all are done, checks every block loaded OK byte
// for byte, records the failed ones, and looks the failed keys up again.
func (d *driver) loadJobs(ctx context.Context, jobs []*job, op *Op, failedBy map[string]int) error {
	var wire []*pb.Job
	byID := map[uint64]*job{}
	for _, j := range jobs {
		if j.ready == 0 {
			continue
		}
		ids := make([]uint32, j.ready)
		for i := range ids {
			ids[i] = uint32(j.base + i)
			d.reg.Poison(j.base + i)
		}
		keys, _ := client.Keys(0, model.HashBytes, j.req.Keys[:j.ready]...)
		d.nextJob++
		wire = append(wire, &pb.Job{JobId: d.nextJob, RequestId: j.req.ID, Keys: keys, BlockIds: ids, LeaseId: j.lease})
		byID[d.nextJob] = j
	}
	if len(wire) == 0 {
		return nil
	}
	results, err := d.transfer(ctx, op, wire, func(r *pb.TransferRequest) error {
		_, err := d.c.API.Load(ctx, r)
		return err
	})
	if err != nil {
		return fmt.Errorf("load: %w", err)
	}
	// Keys some job of this Load received intact: a daemon that read a
	// key twice (two jobs) may fail one read and keep the other's verified
	// copy, which it may then offer again. See failedKeys below.
	delivered := map[string]bool{}
	var failedKeys []string
	for _, jr := range results {
		j := byID[jr.GetJobId()]
		if j == nil {
			return fmt.Errorf("load: completion for unknown job %d", jr.GetJobId())
		}
		failed := make([]bool, j.ready)
		for _, f := range jr.GetFailures() {
			i := int(f.GetIndex())
			if i >= j.ready || f.GetBlockId() != uint32(j.base+i) || string(f.GetHash()) != string(j.req.Keys[i]) {
				return fmt.Errorf("load job %d: failure %v does not name a block of the job", jr.GetJobId(), f)
			}
			failed[i] = true
			key, st := string(j.req.Keys[i]), f.GetStatus()
			if mustDrop(st) {
				d.failed[key] = failure{st, fmt.Sprintf("job %s (step %d)", j.req.ID, d.res.Steps)}
				failedKeys = append(failedKeys, key)
			}
			failedBy[statusName(st)]++
			d.res.BlocksFailedLoaded++
			if st == pb.BlockStatus_BLOCK_STATUS_IO_ERROR || st == pb.BlockStatus_BLOCK_STATUS_CORRUPT {
				d.res.ReadFailures++
			}
			j.redo = min(j.redo, i)
		}
		if jr.GetOk() != (len(jr.GetFailures()) == 0) {
			return fmt.Errorf("load job %d: ok=%v with %d failures", jr.GetJobId(), jr.GetOk(), len(jr.GetFailures()))
		}
		for i := range j.ready {
			if failed[i] {
				continue
			}
			if err := d.reg.Check(j.base+i, j.req.Keys[i]); err != nil {
				d.res.CorruptDelivered++
				if d.res.FirstCorrupt == "" {
					d.res.FirstCorrupt = fmt.Sprintf("request %s block %d: %v", j.req.ID, i, err)
				}
			} else {
				delivered[string(j.req.Keys[i])] = true
			}
		}
	}
	// A key that failed in one job and was delivered intact, checked byte
	// for byte, in another of the same Load has a good copy the daemon may
	// keep (it read and verified it): as if stored again.
	for _, k := range failedKeys {
		if delivered[k] {
			delete(d.failed, k)
			d.res.FailedButDelivered++
		}
	}
	return d.recheck(ctx, jobs)
}

// mustDrop tells the statuses after which the daemon must have removed the
// block's index entry (DESIGN.md §3.4: a read that failed for any reason,
// or a key that was not there). NO_SPACE is not among them: the read never
// started, the cached copy is intact and may be offered again.
func mustDrop(s pb.BlockStatus) bool {
	switch s {
	case pb.BlockStatus_BLOCK_STATUS_MISSING, pb.BlockStatus_BLOCK_STATUS_IO_ERROR,
		pb.BlockStatus_BLOCK_STATUS_CORRUPT, pb.BlockStatus_BLOCK_STATUS_DMA_ERROR:
		return true
	}
	return false
}

// diskLoads finds every block of the run that is now only on disk and
// loads them all, diskLoadBlocks per Load in jobs of diskJobBlocks: the
// daemon's disk read path alone, which the steps mix with CPU hits. The
// lookups that find the blocks peek, so the policy is not told. A Load
// needs a free CPU slot per disk block (the read lands there); bigger
// Loads into a full CPU tier mostly come back NO_SPACE.
func (d *driver) diskLoads(ctx context.Context) error {
	var onDisk [][]byte
	chains, found := map[string]bool{}, map[string]bool{}
	lctx, cancel := context.WithTimeout(ctx, d.cfg.StepTimeout)
	defer cancel()
	for _, step := range d.cfg.Steps {
		for _, r := range step {
			last := string(r.Keys[len(r.Keys)-1])
			if chains[last] {
				continue
			}
			chains[last] = true
			keys, _ := client.Keys(0, model.HashBytes, r.Keys...)
			lr, err := d.c.API.Lookup(lctx, &pb.LookupRequest{NamespaceIds: []uint32{d.ns}, Keys: keys, Peek: true})
			if err != nil {
				return fmt.Errorf("disk loads: lookup: %w", err)
			}
			for i, t := range lr.GetTiers() {
				if k := r.Keys[i]; t == pb.Tier_TIER_DISK && !found[string(k)] {
					found[string(k)] = true
					onDisk = append(onDisk, k)
				}
			}
		}
	}
	const diskLoadBlocks, diskJobBlocks = 16, 8
	for len(onDisk) > 0 {
		n := min(len(onDisk), diskLoadBlocks, d.reg.Blocks)
		batch := onDisk[:n]
		onDisk = onDisk[n:]
		var jobs []*job
		for base := 0; base < n; base += diskJobBlocks {
			keys := batch[base:min(base+diskJobBlocks, n)]
			jobs = append(jobs, &job{req: &workload.Request{ID: fmt.Sprintf("disk-load-%d", base), Keys: keys}, base: base, ready: len(keys), redo: len(keys)})
		}
		bctx, cancel := context.WithTimeout(ctx, d.cfg.StepTimeout)
		err := d.loadJobs(bctx, jobs, &d.res.DiskLoad, d.res.DiskLoadFailed)
		cancel()
		if err != nil {
			return fmt.Errorf("disk loads: %w", err)
		}
	}
	return nil
}

// recheck looks up again, at once, every request with a failed block: the
// daemon must have dropped the failed keys before answering the load
// (design §3.4), so none may be in the ready prefix now. The engine stores
// them again in this step's Store, so without this check a re-offer
// could hide behind the re-store.
func (d *driver) recheck(ctx context.Context, jobs []*job) error {
	for _, j := range jobs {
		if j.redo >= j.ready {
			continue
		}
		keys, _ := client.Keys(0, model.HashBytes, j.req.Keys[:j.ready]...)
		// A peek: a verification, not an engine access the policy should count.
		lr, err := d.c.API.Lookup(ctx, &pb.LookupRequest{NamespaceIds: []uint32{d.ns}, Keys: keys, Peek: true})
		if err != nil {
			return fmt.Errorf("lookup after failed load of %s: %w", j.req.ID, err)
		}
		d.res.CheckLookups++
		for i := range min(int(lr.GetReady()), j.ready) {
			d.reoffered(j.req.Keys[i], fmt.Sprintf("the Lookup right after the failed load (step %d)", d.res.Steps))
		}
	}
	return nil
}

// store saves what the engine computed: every block after the ready prefix,
// and any loaded block that failed (and the rest after it, which the
// engine recomputes as vLLM does).
func (d *driver) store(ctx context.Context, jobs []*job) error {
	var wire []*pb.Job
	for _, j := range jobs {
		n := len(j.req.Keys)
		if j.redo >= n {
			continue
		}
		ids := make([]uint32, 0, n-j.redo)
		for i := j.redo; i < n; i++ {
			d.reg.Fill(j.base+i, j.req.Keys[i])
			ids = append(ids, uint32(j.base+i))
			delete(d.failed, string(j.req.Keys[i]))
		}
		keys, _ := client.Keys(0, model.HashBytes, j.req.Keys[j.redo:]...)
		d.nextJob++
		wire = append(wire, &pb.Job{JobId: d.nextJob, RequestId: j.req.ID, Keys: keys, BlockIds: ids})
	}
	if len(wire) == 0 {
		return nil
	}
	results, err := d.transfer(ctx, &d.res.Store, wire, func(r *pb.TransferRequest) error {
		_, err := d.c.API.Store(ctx, r)
		return err
	})
	if err != nil {
		return fmt.Errorf("store: %w", err)
	}
	for _, jr := range results {
		for _, f := range jr.GetFailures() {
			d.res.StoreFailed[statusName(f.GetStatus())]++
		}
	}
	return nil
}

// transfer sends one Load or Store with every job of the step and reads
// Completions until each job has finished.
func (d *driver) transfer(ctx context.Context, op *Op, jobs []*pb.Job, send func(*pb.TransferRequest) error) ([]*pb.JobResult, error) {
	want := map[uint64]bool{}
	blocks := 0
	for _, j := range jobs {
		want[j.JobId] = true
		blocks += len(j.BlockIds)
	}
	t0 := time.Now()
	if err := send(&pb.TransferRequest{RegistrationId: d.id, Jobs: jobs}); err != nil {
		return nil, err
	}
	var out []*pb.JobResult
	var moved uint64
	for len(want) > 0 {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("%d jobs still unfinished: %w", len(want), err)
		}
		cr, err := d.c.Completions(ctx, d.id, 1000)
		op.Completions++
		if err != nil {
			return nil, fmt.Errorf("completions: %w", err)
		}
		now := time.Since(t0)
		for _, jr := range cr.GetResults() {
			if !want[jr.GetJobId()] {
				return nil, fmt.Errorf("completion for job %d, which is not in flight", jr.GetJobId())
			}
			delete(want, jr.GetJobId())
			op.Latencies = append(op.Latencies, now)
			moved += jr.GetBytes()
			out = append(out, jr)
		}
	}
	op.Busy += time.Since(t0)
	op.Calls++
	op.Blocks += blocks
	op.Bytes += moved
	return out, nil
}

func statusName(s pb.BlockStatus) string {
	n := s.String()
	if len(n) > len("BLOCK_STATUS_") {
		n = n[len("BLOCK_STATUS_"):]
	}
	return n
}

// Percentile returns the p-th percentile (0..100) of ds, nearest rank.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(p/100*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}
