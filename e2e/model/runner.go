package model

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// Options configure a run.
type Options struct {
	Binary string // the kvoffloadd binary
	Seed   uint64
	Shape  Shape
	Off    map[Kind]bool // kinds never generated
	// Steps to generate; with Keep, only those indices run (a reduced
	// sequence). Duration > 0 instead runs the stream until it passes.
	Steps int
	Keep  []int
	// Ops, when set, is the sequence itself (a regression case written
	// out) instead of one generated from Seed.
	Ops      []Op
	Duration time.Duration
	Tol      Tolerances
	// MetricsEvery: the light accounting check runs after every this
	// many steps (0: every step).
	MetricsEvery int
	// Dir holds the run's socket, logs and disk tier; "" makes one under
	// the temporary directory, removed after a passing run.
	Dir  string
	Logf func(format string, args ...any)
	// Trace logs every operation as it runs.
	Trace bool
	// SkipFinal skips the end-of-run checks (the reducer chasing a
	// finding made before the end).
	SkipFinal bool
	// DropDir removes the run's directory even when it fails.
	DropDir bool
}

// Counts are what a run did.
type Counts struct {
	Ops, Skipped     int
	Lookups, Offered int
	StoreJobs        int
	LoadJobs         int
	// Piggybacked: results first read on the reply of a transfer without
	// wait (issue 11 item 4).
	Piggybacked     int
	BlocksVerified  int // loaded blocks compared byte for byte
	Faults          float64
	Corruptions     int
	Restarts, Kills int
	// Invalidates, and restarts or kills, while a persistent arena's
	// recovery still ran (HoldCPU).
	InvalInRecovery, StopsInRecovery int
	WrongBytes                       int
	RSSStart, RSSEnd                 uint64
	RSSMax                           uint64 // the most any incarnation held, seen at the light checks
	GorStart, GorEnd                 float64
	Elapsed                          time.Duration
	// ByKind is the time spent in each kind of operation; Checking in
	// the light checks after them.
	ByKind   [numKinds]time.Duration
	Checking time.Duration
}

// Slowest names the kinds that took the most time.
func (c Counts) Slowest() string {
	type kt struct {
		k Kind
		d time.Duration
	}
	var all []kt
	for k, d := range c.ByKind {
		all = append(all, kt{Kind(k), d})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].d > all[j].d })
	var b []string
	for _, x := range all[:5] {
		b = append(b, fmt.Sprintf("%s %s", x.k, x.d.Round(time.Millisecond)))
	}
	return strings.Join(b, ", ") + fmt.Sprintf("; light checks %s", c.Checking.Round(time.Millisecond))
}

func (c Counts) String() string {
	return fmt.Sprintf("%d operations (%d skipped) in %s (%.0f ops/s): %d lookups offering %d blocks, %d store jobs, %d load jobs, %d results piggybacked, %d blocks verified byte for byte, %d wrong bytes, %.0f faults injected, %d slots corrupted, %d restarts, %d kills (%d invalidates and %d stops during the arena's recovery); daemon RSS %s -> %s (at most %s), goroutines %.0f -> %.0f",
		c.Ops, c.Skipped, c.Elapsed.Round(time.Millisecond), float64(c.Ops)/max(c.Elapsed.Seconds(), 1e-9), c.Lookups, c.Offered, c.StoreJobs, c.LoadJobs, c.Piggybacked,
		c.BlocksVerified, c.WrongBytes, c.Faults, c.Corruptions, c.Restarts, c.Kills, c.InvalInRecovery, c.StopsInRecovery, mib(c.RSSStart), mib(c.RSSEnd), mib(c.RSSMax), c.GorStart, c.GorEnd)
}

func mib(n uint64) string { return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20)) }

// conn is one client connection and the registrations made over it.
type conn struct {
	c    *client.Client
	gen  int // dials so far: a lease belongs to one connection
	regs []*reg
}

// reg is a live registration and the engine memory behind it.
type reg struct {
	id          uint64
	ns          int
	nsID        uint32
	client      int
	slot        int
	incarnation int
	path        string
	mem         []byte
	blocks      int
	segOff      []int // offset of engine block 0 of each segment
	stride      []int
	busy        map[[2]int]uint64 // (group, engine block) -> job using it
	jobs        map[uint64]*jobRec
	nextJob     uint64
	cutoff      int // tick of the last Completions call cut off by its deadline
	// legacy: Completions without the cursor (results leave as sent, so a
	// reply cut off loses them, as documented); else acked is the seq below
	// which every result was processed, sent as ack_seq, and ahead the seqs
	// above it processed already (from wait replies, which need not come
	// in seq order).
	legacy bool
	acked  uint64
	ahead  map[uint64]bool
	// notTaken: maybe-jobs settled as never accepted; a result for one
	// later is a finding of its own.
	notTaken map[uint64]bool
}

var regionSeq atomic.Uint64

type runner struct {
	o   Options
	sh  Shape
	m   *Model
	p   *Proc
	dir string

	conns  []*conn
	nsID   []uint32 // per spec, in the current incarnation; 0 unknown
	live   []int    // per spec: live registrations
	inCat  []bool   // per spec: in the disk tier's catalog (registered since the last reset)
	leases []*lease
	// leaseEnds: when each lease taken this incarnation is surely gone.
	leaseEnds []time.Time
	// cut: the registration whose region file is cut (regionFault).
	cut *reg
	// orphans: jobs of registrations whose connection closed; the daemon
	// still runs them. They settle when pending_jobs reaches 0.
	orphans    []*jobRec
	orphanRegs []int // specs of registrations still draining after a disconnect
	// raced: specs of registrations a register-race may have made, which
	// must be gone when the daemon is next quiet (issue 9 item 6); their
	// namespaces may exist. racedPaths are their region files.
	raced      []int
	racedNS    map[int]bool // in this incarnation
	racedPaths []string
	leaked     int // raced registrations still there when quiet (register-race-leak)

	lastLoss float64 // loss counter at the last scrape of this incarnation
	// maybesSettled: maybe-jobs of this incarnation settled as not taken;
	// the daemon's block counters may count them (lost-wait-results).
	maybesSettled int
	// lossySettled: those of them whose call had no ack_seq: a reply the
	// daemon sent as the caller gave up took their results (documented),
	// so the counters may exceed the results read.
	lossySettled int
	tally        map[string]float64
	unobserved   int // jobs of this incarnation whose results will never be seen
	faultsInc    float64
	baseGor      float64
	baseGorDmp   string

	step  int
	op    Op
	rng   *rand.Rand
	c     Counts
	first *Finding
}

// Run runs one sequence against a fresh daemon and returns what it did. The
// error is an *ErrFinding when a check failed.
func Run(o Options) (Counts, error) {
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	if o.Tol == nil {
		o.Tol = Tolerances{}
	}
	r := &runner{o: o, sh: o.Shape, m: newModel(o.Shape, o.Tol, o.Logf)}
	dir := o.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "kvm")
		if err != nil {
			return r.c, err
		}
		dir = d
	}
	r.dir = dir
	p, err := NewProc(o.Binary, dir, r.sh.DiskDirs())
	if err != nil {
		return r.c, err
	}
	r.p = p
	if r.sh.CPUArena {
		// On tmpfs, as --cpu-arena-dir must be; kept across restarts.
		if p.ArenaDir, err = os.MkdirTemp("/dev/shm", "kvm-arena-"); err != nil {
			return r.c, err
		}
		defer os.RemoveAll(p.ArenaDir)
	}
	r.nsID = make([]uint32, len(r.sh.NS))
	r.live = make([]int, len(r.sh.NS))
	r.inCat = make([]bool, len(r.sh.NS))
	r.conns = make([]*conn, r.sh.Clients)
	for i := range r.conns {
		r.conns[i] = &conn{regs: make([]*reg, r.sh.Slots)}
	}
	start := time.Now()
	err = r.run()
	r.c.Elapsed = time.Since(start)
	r.teardown()
	switch {
	case o.Dir != "":
	case err == nil || o.DropDir:
		os.RemoveAll(dir)
	default:
		// The logs are what a failure needs; the slot files are large.
		if p.DiskDir != "" {
			os.RemoveAll(p.DiskDir)
		}
		o.Logf("daemon logs kept: %s/kvoffloadd-N.log", dir)
	}
	return r.c, err
}

func (r *runner) run() error {
	if err := r.startDaemon("", false); err != nil {
		return err
	}
	r.c.RSSStart = r.p.RSS()
	if _, _, err := r.waitMetrics(60*time.Second, func(m Metrics) bool { return r.takeBaseline(m) }); err != nil {
		return err
	}
	r.c.GorStart = r.baseGor
	var next func() (Op, int, bool)
	switch {
	case r.o.Duration > 0:
		g := NewGenerator(r.o.Seed, r.sh, r.o.Off)
		deadline := time.Now().Add(r.o.Duration)
		i := -1
		next = func() (Op, int, bool) {
			i++
			return g.Next(), i, time.Now().Before(deadline)
		}
	default:
		ops := r.o.Ops
		if ops == nil {
			ops = Generate(r.o.Seed, r.sh, r.o.Steps, r.o.Off)
		}
		idx := r.o.Keep
		if idx == nil {
			idx = make([]int, len(ops))
			for i := range idx {
				idx[i] = i
			}
		}
		j := -1
		next = func() (Op, int, bool) {
			j++
			if j >= len(idx) || idx[j] >= len(ops) {
				return Op{}, 0, false
			}
			return ops[idx[j]], idx[j], true
		}
	}
	every := max(1, r.o.MetricsEvery)
	n := 0
	for {
		op, i, ok := next()
		if !ok {
			break
		}
		r.step, r.op = i, op
		r.rng = rand.New(rand.NewPCG(op.Seed, uint64(i)))
		if r.o.Trace {
			r.o.Logf("%5d %s", i, op)
		}
		t0 := time.Now()
		err := r.do(op)
		r.c.ByKind[op.Kind] += time.Since(t0)
		if err != nil {
			return err
		}
		r.c.Ops++
		if err := r.alive(); err != nil {
			return err
		}
		// A held arena recovery goes on by a chunk after one operation
		// in three: the next ones (Invalidates, restarts, kills) may
		// meet blocks it has not filed yet.
		if r.m.arenaRecovering && r.rng.IntN(3) == 0 {
			if err := r.p.LetRecovery("1"); err != nil {
				return r.fail("daemon", "%v", err)
			}
			r.m.arenaRecovering = r.arenaRecovering()
		}
		if n++; n%every == 0 {
			t0 := time.Now()
			err := r.lightCheck()
			r.c.Checking += time.Since(t0)
			if err != nil {
				return err
			}
		}
	}
	r.op = Op{Kind: Check}
	r.step++
	if r.o.SkipFinal {
		return nil
	}
	return r.finalChecks()
}

// arenaRecovering reports whether a held arena recovery (HoldCPU) still
// runs.
func (r *runner) arenaRecovering() bool {
	if r.p.ArenaDir == "" || !r.p.HoldCPU {
		return false
	}
	m, err := r.p.Metrics()
	return err == nil && m.Sum("kvoffload_cpu_recovery_state") == 1
}

// fail records a finding; the run stops at the first one.
func (r *runner) fail(category, format string, a ...any) error {
	f := Finding{Step: r.step, Op: r.op, Category: category, Detail: fmt.Sprintf(format, a...)}
	if r.first == nil {
		r.first = &f
	}
	return &ErrFinding{f}
}

// alive turns a daemon that exited on its own into a finding.
func (r *runner) alive() error {
	if err := r.p.Exited(); err != nil {
		return r.fail("daemon", "%v", err)
	}
	return nil
}

// rpcErr turns an unexpected RPC error into a finding, naming a daemon
// that died under it.
func (r *runner) rpcErr(call string, err error) error {
	if e := r.alive(); e != nil {
		return e
	}
	return r.fail("wrong-code", "%s: unexpected error %v", call, err)
}

func (r *runner) do(op Op) error {
	switch op.Kind {
	case Register:
		return r.register(op)
	case Unregister:
		return r.unregister(op)
	case Resolve:
		return r.resolve(op.Client)
	case Lookup:
		return r.lookup(op)
	case Store:
		return r.store(op)
	case Load:
		return r.load(op)
	case Completions:
		return r.completions(op)
	case InvalidateKeys, InvalidateNS:
		return r.invalidate(op)
	case Disconnect:
		return r.disconnect(op.Client)
	case Restart, Kill:
		return r.restart(op)
	case Corrupt:
		return r.corrupt(op)
	case RegionFault:
		return r.regionFault(op)
	case BadRequest:
		return r.badRequest(op)
	case Stats:
		return r.stats(op.Client)
	case Burst:
		return r.burst(op)
	case RegisterRace:
		return r.registerRace(op)
	case Check:
		return r.quiesce()
	}
	return fmt.Errorf("unknown operation %v", op.Kind)
}

func (r *runner) skip() error {
	r.c.Skipped++
	return nil
}

// client returns connection c, dialling it if needed.
func (r *runner) client(c int) (*client.Client, error) {
	cn := r.conns[c]
	if cn.c == nil {
		cl, err := client.Dial(r.p.Socket)
		if err != nil {
			return nil, err
		}
		cn.c = cl
		cn.gen++
	}
	return cn.c, nil
}

func ctxFor(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), d)
}

const callTimeout = 60 * time.Second

// ---- daemon incarnations ----

func (r *runner) startDaemon(faults string, reset bool) error {
	if err := r.p.Start(r.sh, faults, reset); err != nil {
		return err
	}
	m, err := r.p.Metrics()
	if err != nil {
		return err
	}
	r.lastLoss = m.Losses()
	// Held until the runner lets it go (LetRecovery).
	r.m.arenaRecovering = r.p.ArenaDir != "" && r.p.HoldCPU
	r.tally = map[string]float64{}
	r.racedNS = map[int]bool{}
	r.unobserved, r.maybesSettled, r.lossySettled = 0, 0, 0
	r.faultsInc = 0
	r.baseGor, r.baseGorDmp = -1, ""
	r.takeBaseline(m)
	return nil
}

// settleLost gives up on a job whose result will never come.
func (r *runner) settleLost(j *jobRec) {
	for i := range j.blocks {
		if j.op == Load {
			r.m.loadSettled(j.blocks[i].key, j.incarnation == r.p.Incarnation, false)
		}
	}
	if j.op == Store {
		for i := range j.blocks {
			r.m.storeSettled(j.blocks[i].key, &j.blocks[i], false, true, j.incarnation, r.p.Incarnation)
		}
	}
	// Counted even for a job the daemon may not have taken: if it did, its
	// blocks are in the daemon's counters and its result is gone.
	r.unobserved++
}

// dropReg forgets a registration: its jobs are orphans while the daemon may
// still run them (orphan), else settled as lost; its region goes.
func (r *runner) dropReg(g *reg, orphan bool) {
	for _, j := range g.jobs {
		if orphan {
			r.orphans = append(r.orphans, j)
		} else {
			r.settleLost(j)
		}
	}
	if orphan {
		r.orphanRegs = append(r.orphanRegs, g.ns)
	}
	g.jobs = nil
	r.live[g.ns]--
	r.conns[g.client].regs[g.slot] = nil
	// Our view of the region goes; the daemon keeps its own mapping until
	// the registration has drained, and the file's pages with it.
	unix.Munmap(g.mem)
	os.Remove(g.path)
}

// settleOrphans settles orphaned jobs once the daemon has none pending.
func (r *runner) settleOrphans(pending float64) {
	if pending != 0 {
		return
	}
	for _, j := range r.orphans {
		r.settleLost(j)
	}
	r.orphans = nil
}

func (r *runner) closeConn(c int) {
	cn := r.conns[c]
	if cn.c != nil {
		cn.c.Close()
		cn.c = nil
	}
}

func (r *runner) teardown() {
	for c := range r.conns {
		r.closeConn(c)
		for _, g := range r.conns[c].regs {
			if g != nil {
				unix.Munmap(g.mem)
				os.Remove(g.path)
			}
		}
	}
	if r.p.Running() {
		r.p.Kill()
	}
}

// process notes that the result with seq was processed; false if it was
// already.
func (g *reg) process(seq uint64) bool {
	if seq <= g.acked || g.ahead[seq] {
		return false
	}
	g.ahead[seq] = true
	for g.ahead[g.acked+1] {
		delete(g.ahead, g.acked+1)
		g.acked++
	}
	return true
}

// ---- registrations ----

func (r *runner) newRegion(spec NSSpec, blocks int, blockMajor bool) (*reg, error) {
	g := &reg{blocks: blocks, busy: map[[2]int]uint64{}, jobs: map[uint64]*jobRec{}, notTaken: map[uint64]bool{}, ahead: map[uint64]bool{}}
	total := 0
	for _, s := range spec.Segments {
		total += s.Bytes
	}
	off := 0
	for _, s := range spec.Segments {
		if blockMajor {
			// Engine block b holds every segment back to back.
			g.segOff = append(g.segOff, off)
			g.stride = append(g.stride, total)
			off += s.Bytes
		} else {
			// Each segment's blocks are contiguous, as vLLM's per-layer tensors.
			g.segOff = append(g.segOff, off)
			g.stride = append(g.stride, s.Bytes)
			off += s.Bytes * blocks
		}
	}
	size := total * blocks
	g.path = fmt.Sprintf("/dev/shm/kvmodel-%d-%d", os.Getpid(), regionSeq.Add(1))
	f, err := os.OpenFile(g.path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := f.Truncate(int64(size)); err != nil {
		os.Remove(g.path)
		return nil, err
	}
	g.mem, err = unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		os.Remove(g.path)
		return nil, err
	}
	return g, nil
}

func (g *reg) wire() []*pb.Region {
	out := make([]*pb.Region, len(g.segOff))
	for i := range out {
		out[i] = &pb.Region{Memory: &pb.Region_ShmPath{ShmPath: g.path}, Offset: uint64(g.segOff[i]), BlockStride: uint64(g.stride[i]), NumBlocks: uint32(g.blocks)}
	}
	return out
}

// segment is engine block b's bytes of segment i.
func (g *reg) segment(spec NSSpec, i, b int) []byte {
	off := g.segOff[i] + b*g.stride[i]
	return g.mem[off : off+spec.Segments[i].Bytes]
}

func (r *runner) register(op Op) error {
	cn := r.conns[op.Client]
	if cn.regs[op.Slot] != nil {
		return r.skip()
	}
	spec := r.sh.NS[op.NS]
	g, err := r.newRegion(spec, r.sh.EngineBlocks, op.Seed&1 == 1)
	if err != nil {
		return err
	}
	cl, err := r.client(op.Client)
	if err != nil {
		return err
	}
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	knownBefore := r.nsID[op.NS] != 0
	resp, err := cl.Register(ctx, []byte(spec.Fingerprint), spec.Layout(), g.wire(), fmt.Sprintf("model c%d/r%d", op.Client, op.Slot))
	if err != nil {
		unix.Munmap(g.mem)
		os.Remove(g.path)
		return r.rpcErr("Register", err)
	}
	r.m.next()
	switch {
	case resp.GetJoinedExisting() && !knownBefore && !r.inCat[op.NS] && !r.racedNS[op.NS]:
		return r.fail("namespace", "Register of %s joined an existing namespace %d that nobody registered", spec.Fingerprint, resp.GetNamespaceId())
	case !resp.GetJoinedExisting() && r.live[op.NS] > 0:
		return r.fail("namespace", "Register of %s made a new namespace %d while registration(s) of it are live in namespace %d", spec.Fingerprint, resp.GetNamespaceId(), r.nsID[op.NS])
	case knownBefore && r.live[op.NS] > 0 && resp.GetNamespaceId() != r.nsID[op.NS]:
		return r.fail("namespace", "Register of %s got namespace %d, its live registrations are in %d", spec.Fingerprint, resp.GetNamespaceId(), r.nsID[op.NS])
	}
	for i, id := range r.nsID {
		if i != op.NS && id == resp.GetNamespaceId() && r.live[i] > 0 {
			return r.fail("namespace", "Register of %s got namespace %d, which is %s's", spec.Fingerprint, id, r.sh.NS[i].Fingerprint)
		}
	}
	g.id, g.ns, g.nsID, g.client, g.slot, g.incarnation = resp.GetRegistrationId(), op.NS, resp.GetNamespaceId(), op.Client, op.Slot, r.p.Incarnation
	g.nextJob = 1
	g.legacy = (op.Seed>>1)&3 == 0
	cn.regs[op.Slot] = g
	r.nsID[op.NS] = g.nsID
	r.live[op.NS]++
	r.inCat[op.NS] = r.sh.Durable()
	return nil
}

func (r *runner) unregister(op Op) error {
	g := r.conns[op.Client].regs[op.Slot]
	if g == nil {
		return r.skip()
	}
	cl, err := r.client(op.Client)
	if err != nil {
		return err
	}
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	if err := cl.Unregister(ctx, g.id); err != nil {
		return r.rpcErr("Unregister", err)
	}
	r.m.next()
	// Unregister returned after the registration's jobs drained: their
	// unread results are dropped with it, and its memory is ours again.
	r.dropReg(g, false)
	ctx2, cancel2 := ctxFor(callTimeout)
	defer cancel2()
	_, err = cl.Completions(ctx2, g.id, 0)
	if status.Code(err) != codes.NotFound {
		return r.fail("wrong-code", "Completions of unregistered registration %d: got %v, want NOT_FOUND", g.id, err)
	}
	return nil
}

func (r *runner) disconnect(c int) error {
	cn := r.conns[c]
	if cn.c == nil {
		return r.skip()
	}
	r.closeConn(c)
	r.m.next()
	for _, g := range cn.regs {
		if g != nil {
			r.dropReg(g, true)
		}
	}
	return nil
}

// resolve learns the namespace ids of every spec and checks them against
// what this incarnation made and what the catalog may have kept.
func (r *runner) resolve(c int) error {
	cl, err := r.client(c)
	if err != nil {
		return err
	}
	prints := make([][]byte, 0, len(r.sh.NS)+1)
	for _, s := range r.sh.NS {
		prints = append(prints, []byte(s.Fingerprint))
	}
	prints = append(prints, []byte("model=never-registered"))
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	ids, err := cl.Resolve(ctx, prints...)
	if err != nil {
		return r.rpcErr("Resolve", err)
	}
	if len(ids) != len(prints) {
		return r.fail("resolve", "Resolve of %d fingerprints returned %d ids", len(prints), len(ids))
	}
	if ids[len(ids)-1] != 0 {
		return r.fail("resolve", "a fingerprint nobody registered resolves to namespace %d", ids[len(ids)-1])
	}
	seen := map[uint32]int{}
	for i, id := range ids[:len(r.sh.NS)] {
		switch {
		case id == 0 && r.live[i] > 0:
			return r.fail("resolve", "%s resolves to nothing with %d live registration(s) in namespace %d", r.sh.NS[i].Fingerprint, r.live[i], r.nsID[i])
		case id != 0 && r.nsID[i] == 0 && !r.inCat[i] && !r.racedNS[i]:
			return r.fail("resolve", "%s resolves to namespace %d, never registered since the disk tier last started empty", r.sh.NS[i].Fingerprint, id)
		case id != 0 && r.live[i] > 0 && id != r.nsID[i]:
			return r.fail("resolve", "%s resolves to namespace %d, its live registrations are in %d", r.sh.NS[i].Fingerprint, id, r.nsID[i])
		}
		if j, dup := seen[id]; dup && id != 0 {
			return r.fail("resolve", "%s and %s resolve to one namespace %d", r.sh.NS[j].Fingerprint, r.sh.NS[i].Fingerprint, id)
		}
		seen[id] = i
		r.nsID[i] = id
	}
	return nil
}

// ids returns the namespace ids of a set, resolving them when unknown; ok
// false when some namespace does not exist in this incarnation.
func (r *runner) ids(set []int, c int) ([]uint32, bool, error) {
	out := make([]uint32, len(set))
	for i, ns := range set {
		if r.nsID[ns] == 0 {
			if err := r.resolve(c); err != nil {
				return nil, false, err
			}
		}
		if r.nsID[ns] == 0 {
			return nil, false, nil
		}
		out[i] = r.nsID[ns]
	}
	return out, true, nil
}

// ---- helpers ----

func codeOf(err error) codes.Code { return status.Code(err) }

func sortedKeys[M ~map[K]V, K comparable, V any](m M, less func(a, b K) bool) []K {
	out := make([]K, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return less(out[i], out[j]) })
	return out
}

// registerRace registers over a connection of its own and closes that
// connection while the Register may still be in the daemon: whatever the
// race's outcome, the registration must go with the connection (its count
// and mappings are checked when the daemon is next quiet, and at the end).
func (r *runner) registerRace(op Op) error {
	spec := r.sh.NS[op.NS]
	g, err := r.newRegion(spec, 4, false)
	if err != nil {
		return err
	}
	defer func() {
		unix.Munmap(g.mem)
		os.Remove(g.path)
	}()
	cl, err := client.Dial(r.p.Socket)
	if err != nil {
		return err
	}
	// Connect first, so the race is with the Register, not the dial.
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	if _, err := cl.Resolve(ctx, []byte(spec.Fingerprint)); err != nil {
		cl.Close()
		return r.rpcErr("Resolve", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := cl.Register(ctx, []byte(spec.Fingerprint), spec.Layout(), g.wire(), "register-race")
		done <- err
	}()
	time.Sleep(time.Duration(r.rng.IntN(1500)) * time.Microsecond)
	cl.Close()
	err = <-done
	r.m.next()
	if c := codeOf(err); err != nil && c != codes.Canceled && c != codes.Unavailable {
		return r.rpcErr("Register racing its connection's close", err)
	}
	// Taken, refused or cut, it may have been taken and made the
	// namespace; the registration must go with its connection.
	r.raced = append(r.raced, op.NS)
	r.racedNS[op.NS] = true
	r.racedPaths = append(r.racedPaths, g.path)
	r.inCat[op.NS] = r.inCat[op.NS] || r.sh.Durable()
	return nil
}

var nsIndex = regexp.MustCompile(`namespace_ids\[(\d+)\]`)

// namespaceGone reports whether err is an unknown-namespace refusal the
// daemon may give: a namespace with no registration and no block goes a
// minute after (docs/api.md), and its id with it. It forgets the ids.
func (r *runner) namespaceGone(set []int, err error) bool {
	if codeOf(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "unknown namespace") {
		return false
	}
	gone := set
	if m := nsIndex.FindStringSubmatch(err.Error()); m != nil {
		if i, _ := strconv.Atoi(m[1]); i < len(set) {
			gone = set[i : i+1]
		}
	}
	for _, ns := range gone {
		if r.live[ns] > 0 {
			return false
		}
	}
	for _, ns := range gone {
		r.nsID[ns] = 0
	}
	return true
}

// takeBaseline notes the goroutines of an incarnation once its disk tier
// has recovered (recovery runs in the background, on goroutines of its
// own); the end of the run must come back to them. It reports whether the
// baseline is taken.
func (r *runner) takeBaseline(m Metrics) bool {
	if r.baseGor >= 0 {
		return true
	}
	if m.Sum("kvoffload_disk_recovering") != 0 {
		return false
	}
	r.baseGor = m.Sum("go_goroutines")
	r.baseGorDmp = r.p.Goroutines()
	return true
}
