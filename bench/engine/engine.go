// Package engine owns kvbench's synthetic inference engine: it drives a
// kvoffloadd the way vLLM's connector does, one scheduler step at a time
// (one Lookup per request, one Load of the hits with a job per request,
// one Store of the blocks the engine computed, Completions until the
// step's jobs are done), checks every loaded block byte for byte, and
// checks that a block reported failed is not offered again until it is
// stored again.
package engine

import (
	"cmp"
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
	// Wait makes every Load and Store wait for its jobs and return their
	// results in its reply, one round trip instead of the call and its
	// Completions (what an engine that needs the results before going on
	// can do).
	Wait bool

	// Copier, if set, copies the same segments as every step's Load and
	// Store without the daemon, right before or right after it (the order
	// alternates by step), into LoadCopy and StoreCopy: the copy baseline
	// timed in the same window. kvbench's is a baseline.ProcessCopier, a
	// process of its own as the daemon is.
	Copier Copier
	// OwnCopier, if set, does the same beside Copier, into LoadCopyOwn
	// and StoreCopyOwn: kvbench's is a baseline.SegmentCopier in kvbench's
	// own process, the copy with no process boundary at all.
	OwnCopier Copier
	// Prober, if set, is a second connection (the scheduler's) that
	// issues Lookups of the next step's requests, each followed by an
	// empty call, one at a time, while every step's Load and Store is in
	// flight (BusyLookup, BusyEmpty). It runs during the Copier's copies
	// too, unrecorded, so both sides of the copy ratio carry the same load.
	Prober *client.Client
	// StepDisk, if set, is called after each step that loaded blocks only
	// on disk with their number; it returns how long raw O_DIRECT takes
	// to read that many slots at the daemon's queue depth (StepsDisk).
	StepDisk func(blocks int) (time.Duration, error)
	// DiskBaseline, if set, is called right before and right after the
	// disk-only loads (DiskLoads) with the keys they load.
	DiskBaseline func(when string, keys [][]byte) error
	// Phase, if set, is called as each phase of the run (steps, disk
	// loads, idle lookups) begins; the phase ends when the returned
	// function is called.
	Phase func(name string) (end func())

	// MirrorClient, if set, is a connection of its own on which the
	// engine follows the daemon's WatchEvents for its namespace (a
	// Mirror) and answers each new request's lookup from it while it is
	// live, as the Python connector does (issue 32): the daemon still gets
	// the same Lookup (no lease), timed, whose answer is used only when the
	// mirror cannot answer. Result.Mirror says what it did. LeaseMs must
	// be 0 (a lease is the daemon's to take).
	MirrorClient *client.Client
	// MirrorMaxBlocks bounds the mirror's entries (0: 2,000,000).
	MirrorMaxBlocks int

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
	// LoadCopy and StoreCopy are Config.Copier's copies of the same
	// blocks in the same steps; LoadCopyOwn and StoreCopyOwn
	// Config.OwnCopier's.
	LoadCopy, StoreCopy       Op
	LoadCopyOwn, StoreCopyOwn Op
	// BusyLookup and BusyEmpty are Config.Prober's calls while Loads and
	// Stores were in flight: Lookups, and the empty call after each.
	BusyLookup, BusyEmpty Op
	// StepsDisk holds, per step that loaded disk-only blocks, how many,
	// and Config.StepDisk's raw read time for as many.
	StepsDisk []StepDisk
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

	// Mirror is Config.MirrorClient's measurement (nil without).
	Mirror *MirrorResult
}

// StepDisk is one step's disk reads and the raw time for as many.
type StepDisk struct {
	Blocks int
	Raw    time.Duration
}

type job struct {
	req   *workload.Request
	base  int // engine block of the request's first block
	ready int
	lease uint64
	redo  int  // first block the engine (re)computes
	mirr  bool // ready came from the mirror
}

// Run drives the daemon through every step.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	c, reg := cfg.Client, cfg.Region
	if cfg.StepTimeout <= 0 {
		cfg.StepTimeout = time.Minute
	}
	if cfg.MirrorClient != nil && cfg.LeaseMs != 0 {
		return nil, errors.New("a lookup mirror takes no leases: LeaseMs must be 0")
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
	if cfg.MirrorClient != nil {
		d.mirror = NewMirror(cfg.MirrorClient, []uint32{d.ns}, cmp.Or(cfg.MirrorMaxBlocks, 2_000_000))
		d.res.Mirror = &MirrorResult{}
		d.dict, d.recent = map[string]struct{}{}, map[string]time.Time{}
	}
	runErr := d.warm(ctx)
	if runErr == nil {
		runErr = d.run(ctx)
	}
	if d.mirror != nil {
		mr := d.res.Mirror
		mr.Blocks, mr.Streams, mr.Resets, mr.Overflow, _ = d.mirror.Counts()
		d.mirror.Close()
	}
	if runErr == nil && cfg.DiskLoads {
		runErr = d.diskLoads(ctx)
	}
	if runErr == nil && cfg.IdleLookups > 0 && len(cfg.Steps) > 0 {
		runErr = d.idleLookups(ctx)
	}
	return d.finish(runErr)
}

// finish drops the run's blocks (unless Config.Keep), so that a shared
// daemon (--socket) is left as found, unregisters, and returns the result
// with every error on the way.
func (d *driver) finish(runErr error) (*Result, error) {
	uctx, cancel := context.WithTimeout(context.Background(), d.cfg.StepTimeout)
	defer cancel()
	var ierr error
	if !d.cfg.Keep {
		_, ierr = d.c.Invalidate(uctx, []uint32{d.ns}, nil)
	}
	uerr := d.c.Unregister(uctx, d.id)
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
	// probeKeys are what the prober looks up during this step's
	// transfers: the next step's requests, as a scheduler would.
	probeKeys []*pb.KeyList
	// diskBlocks counts the step's ready blocks only on disk.
	diskBlocks int
	// probing: the transfer under way is a step's; the prober runs.
	probing bool

	// With Config.MirrorClient: the mirror; every key this engine sent
	// to a Store (the plain map the mirror is timed against, and what a
	// mirror may offer); and when each was last sent, for a second.
	mirror *Mirror
	dict   map[string]struct{}
	recent map[string]time.Time
	// remoteSeen: a Lookup answered a block from the remote tier.
	remoteSeen bool
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
	for i, send := range []func(*pb.TransferRequest) (*pb.TransferResponse, error){
		func(r *pb.TransferRequest) (*pb.TransferResponse, error) { return d.c.API.Store(ctx, r) },
		func(r *pb.TransferRequest) (*pb.TransferResponse, error) { return d.c.API.Load(ctx, r) },
	} {
		d.nextJob++
		results, err := d.transfer(ctx, &scratch, []*pb.Job{{JobId: d.nextJob, RequestId: "warm-up", Keys: keys, BlockIds: ids}}, send)
		if err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
		if i == 0 {
			continue
		}
		// A warm-up block may already have gone to disk (a small CPU
		// tier), and its read may meet an injected fault: it counts
		// like any failed read, though not in the steps' figures.
		for _, jr := range results {
			for _, f := range jr.GetFailures() {
				d.res.BlocksFailedLoaded++
				if st := f.GetStatus(); st == pb.BlockStatus_BLOCK_STATUS_IO_ERROR || st == pb.BlockStatus_BLOCK_STATUS_CORRUPT {
					d.res.ReadFailures++
				}
			}
		}
	}
	if _, err := d.c.Invalidate(ctx, []uint32{d.ns}, keys); err != nil {
		return fmt.Errorf("warm-up: invalidate: %w", err)
	}
	return nil
}

// phase starts a named phase of the run (Config.Phase).
func (d *driver) phase(name string) func() {
	if d.cfg.Phase == nil {
		return func() {}
	}
	return d.cfg.Phase(name)
}

// idleLookups times Lookups of the last step's requests one at a time on
// an idle daemon: peeks, as the prober's are, so the two differ only in
// what else the daemon is doing.
func (d *driver) idleLookups(ctx context.Context) error {
	defer d.phase("idle lookups")()
	reqs := d.cfg.Steps[len(d.cfg.Steps)-1]
	op := &d.res.IdleLookup
	for i := range d.cfg.IdleLookups {
		r := reqs[i%len(reqs)]
		keys, _ := client.Keys(0, model.HashBytes, r.Keys...)
		t0 := time.Now()
		if _, err := d.c.API.Lookup(ctx, &pb.LookupRequest{NamespaceIds: []uint32{d.ns}, Keys: keys, Peek: true}); err != nil {
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
	defer d.phase("steps")()
	for i, step := range d.cfg.Steps {
		if err := ctx.Err(); err != nil {
			return err
		}
		d.probeKeys = d.probeKeys[:0]
		for _, r := range d.cfg.Steps[min(i+1, len(d.cfg.Steps)-1)] {
			keys, _ := client.Keys(0, model.HashBytes, r.Keys...)
			d.probeKeys = append(d.probeKeys, keys)
		}
		d.diskBlocks = 0
		sctx, cancel := context.WithTimeout(ctx, d.cfg.StepTimeout)
		err := d.step(sctx, step)
		cancel()
		if err != nil {
			return fmt.Errorf("step %d: %w", i, err)
		}
		if d.cfg.StepDisk != nil && d.diskBlocks > 0 {
			raw, err := d.cfg.StepDisk(d.diskBlocks)
			if err != nil {
				return fmt.Errorf("after step %d: raw disk reads: %w", i, err)
			}
			d.res.StepsDisk = append(d.res.StepsDisk, StepDisk{Blocks: d.diskBlocks, Raw: raw})
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
	if d.mirror != nil {
		for k, t := range d.recent {
			if time.Since(t) > RecentStore {
				delete(d.recent, k)
			}
		}
	}
	for _, j := range jobs {
		var mtiers []pb.Tier
		live, use := false, false
		if d.mirror != nil {
			mtiers, live, use = d.mirrorLookup(j)
		}
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
		tiers := lr.GetTiers()
		if d.mirror != nil {
			d.remoteSeen = d.remoteSeen || slices.Contains(tiers, pb.Tier_TIER_REMOTE)
			mr := res.Mirror
			if live {
				if n := len(mtiers); n > j.ready {
					mr.Ahead += n - j.ready
				} else {
					mr.Behind += j.ready - n
					if !use && j.ready > n {
						mr.RecentLonger++
					}
				}
			}
			if use {
				// The mirror's answer, in this step: the daemon's is
				// not waited for (a connector sends it for the policy).
				j.ready, j.redo, j.mirr, tiers = len(mtiers), len(mtiers), true, mtiers
				mr.Offered += len(mtiers)
				for _, t := range mtiers {
					if t == pb.Tier_TIER_DISK {
						mr.OfferedDisk++
					}
				}
			}
		}
		n := len(j.req.Keys)
		res.LookedUp += n
		res.KindLookedUp[j.req.Kind] += n
		res.KindHit[j.req.Kind] += j.ready
		for i, t := range tiers {
			switch t {
			case pb.Tier_TIER_DISK:
				res.HitDisk++
				d.diskBlocks++
			case pb.Tier_TIER_REMOTE:
				res.HitRemote++
			default:
				res.HitCPU++
			}
			if j.mirr {
				// As fresh as the stream: a block whose load failed may
				// be offered until its removal arrives (a stale answer,
				// counted at its load), never a block never stored.
				if _, ok := d.dict[string(j.req.Keys[i])]; !ok {
					res.Mirror.Unknown++
				}
				continue
			}
			d.reoffered(j.req.Keys[i], fmt.Sprintf("the Lookup of %s in step %d", j.req.ID, d.res.Steps))
		}
	}
	return nil
}

// load loads the step's ready prefixes and, with copiers, copies the
// same segments without the daemon right before or right after (by step
// parity, so neither side always finds the caches the other left).
func (d *driver) load(ctx context.Context, jobs []*job) error {
	d.probing = true
	defer func() { d.probing = false }()
	var blocks []int
	for _, j := range jobs {
		for i := range j.ready {
			blocks = append(blocks, j.base+i)
		}
	}
	first := d.res.Steps%2 == 1
	if first {
		if err := d.copyBaselines(blocks, false); err != nil {
			return err
		}
	}
	if err := d.loadJobs(ctx, jobs, &d.res.Load, d.res.LoadFailed); err != nil {
		return err
	}
	if !first {
		return d.copyBaselines(blocks, false)
	}
	return nil
}

// Copier copies the segments of engine blocks to or from an arena-like
// buffer without the daemon (package baseline).
type Copier interface {
	Copy(blocks []int, toArena bool) (time.Duration, uint64, error)
}

// copyBaselines times Config.Copier's and Config.OwnCopier's copies of
// blocks (a load's, or a store's if toArena), the first in the
// order of the step's parity.
func (d *driver) copyBaselines(blocks []int, toArena bool) error {
	other, own := &d.res.LoadCopy, &d.res.LoadCopyOwn
	if toArena {
		other, own = &d.res.StoreCopy, &d.res.StoreCopyOwn
	}
	type run struct {
		c  Copier
		op *Op
	}
	runs := []run{{d.cfg.Copier, other}, {d.cfg.OwnCopier, own}}
	if d.res.Steps%2 == 1 {
		runs[0], runs[1] = runs[1], runs[0]
	}
	for _, r := range runs {
		if err := d.copyBaseline(r.c, blocks, toArena, r.op); err != nil {
			return err
		}
	}
	return nil
}

// copyBaseline times c's copy of blocks; a load's destination is zeroed
// first, as loadJobs zeroes it before a Load.
func (d *driver) copyBaseline(c Copier, blocks []int, toArena bool, op *Op) error {
	if c == nil || len(blocks) == 0 {
		return nil
	}
	if !toArena {
		for _, b := range blocks {
			d.reg.Poison(b)
		}
	}
	p := d.startProbe(nil, nil)
	el, n, err := c.Copy(blocks, toArena)
	p.stop()
	if err != nil {
		return fmt.Errorf("copy baseline: %w", err)
	}
	op.Calls++
	op.Blocks += len(blocks)
	op.Bytes += n
	op.Busy += el
	op.Latencies = append(op.Latencies, el)
	return nil
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
	results, err := d.transfer(ctx, op, wire, func(r *pb.TransferRequest) (*pb.TransferResponse, error) {
		return d.c.API.Load(ctx, r)
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
			if j.mirr {
				if st == pb.BlockStatus_BLOCK_STATUS_MISSING {
					d.res.Mirror.Stale++
				} else {
					d.res.Mirror.FailedOther++
				}
			}
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

// DiskLoadBlocks is how many blocks each of the disk-only loads asks for:
// the burst of disk reads a tier-pattern baseline matches.
const DiskLoadBlocks = 16

// diskLoads finds every block of the run that is now only on disk and
// loads them all, DiskLoadBlocks per Load in jobs of diskJobBlocks: the
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
	const diskJobBlocks = 8
	all := onDisk
	if d.cfg.DiskBaseline != nil {
		if err := d.cfg.DiskBaseline("before", all); err != nil {
			return fmt.Errorf("disk loads: baseline before: %w", err)
		}
	}
	end := d.phase("disk loads")
	for len(onDisk) > 0 {
		n := min(len(onDisk), DiskLoadBlocks, d.reg.Blocks)
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
			end()
			return fmt.Errorf("disk loads: %w", err)
		}
	}
	end()
	if d.cfg.DiskBaseline != nil {
		if err := d.cfg.DiskBaseline("after", all); err != nil {
			return fmt.Errorf("disk loads: baseline after: %w", err)
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
			if d.mirror != nil {
				d.dict[string(j.req.Keys[i])] = struct{}{}
				d.recent[string(j.req.Keys[i])] = time.Now()
			}
		}
		keys, _ := client.Keys(0, model.HashBytes, j.req.Keys[j.redo:]...)
		d.nextJob++
		wire = append(wire, &pb.Job{JobId: d.nextJob, RequestId: j.req.ID, Keys: keys, BlockIds: ids})
	}
	if len(wire) == 0 {
		return nil
	}
	var blocks []int
	for _, w := range wire {
		for _, b := range w.BlockIds {
			blocks = append(blocks, int(b))
		}
	}
	first := d.res.Steps%2 == 1
	if first {
		if err := d.copyBaselines(blocks, true); err != nil {
			return err
		}
	}
	d.probing = true
	results, err := d.transfer(ctx, &d.res.Store, wire, func(r *pb.TransferRequest) (*pb.TransferResponse, error) {
		return d.c.API.Store(ctx, r)
	})
	d.probing = false
	if err != nil {
		return fmt.Errorf("store: %w", err)
	}
	if !first {
		if err := d.copyBaselines(blocks, true); err != nil {
			return err
		}
	}
	for _, jr := range results {
		for _, f := range jr.GetFailures() {
			d.res.StoreFailed[statusName(f.GetStatus())]++
		}
	}
	return nil
}

// transfer sends one Load or Store with every job of the step and reads
// Completions until each job has finished; with Config.Wait the call waits
// for its results and returns them (one round trip instead of two or more).
func (d *driver) transfer(ctx context.Context, op *Op, jobs []*pb.Job, send func(*pb.TransferRequest) (*pb.TransferResponse, error)) ([]*pb.JobResult, error) {
	want, blocks := inFlight(jobs)
	var p *probe
	if d.probing {
		p = d.startProbe(&d.res.BusyLookup, &d.res.BusyEmpty)
		defer p.stop()
	}
	t0 := time.Now()
	resp, err := send(&pb.TransferRequest{RegistrationId: d.id, Jobs: jobs, Wait: d.cfg.Wait})
	if err != nil {
		return nil, err
	}
	var out []*pb.JobResult
	var moved uint64
	err = awaitResults(ctx, d.c, d.id, op, want, resp.GetResults(), t0, func(jr *pb.JobResult, at time.Duration) {
		op.Latencies = append(op.Latencies, at)
		moved += jr.GetBytes()
		out = append(out, jr)
	})
	if err != nil {
		return nil, err
	}
	op.Busy += time.Since(t0)
	p.stop()
	op.Calls++
	op.Blocks += blocks
	op.Bytes += moved
	return out, nil
}

// inFlight is the ids of jobs, to wait for, and how many blocks they name.
func inFlight(jobs []*pb.Job) (map[uint64]bool, int) {
	want := make(map[uint64]bool, len(jobs))
	blocks := 0
	for _, j := range jobs {
		want[j.JobId] = true
		blocks += len(j.BlockIds)
	}
	return want, blocks
}

// awaitResults hands take the result of every job in want, with the time
// since t0 it came at: the reply's first, then Completions' until no job is
// unfinished. A result of a job not in want is an error.
func awaitResults(ctx context.Context, c *client.Client, id uint64, op *Op, want map[uint64]bool, reply []*pb.JobResult, t0 time.Time, take func(jr *pb.JobResult, at time.Duration)) error {
	put := func(jrs []*pb.JobResult) error {
		at := time.Since(t0)
		for _, jr := range jrs {
			if !want[jr.GetJobId()] {
				return fmt.Errorf("completion for job %d, which is not in flight", jr.GetJobId())
			}
			delete(want, jr.GetJobId())
			take(jr, at)
		}
		return nil
	}
	if err := put(reply); err != nil {
		return err
	}
	for len(want) > 0 {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("%d jobs still unfinished: %w", len(want), err)
		}
		cr, err := c.Completions(ctx, id, 1000)
		op.Completions++
		if err != nil {
			return fmt.Errorf("completions (%d jobs unfinished): %w", len(want), err)
		}
		if err := put(cr.GetResults()); err != nil {
			return err
		}
	}
	return nil
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
