package model

import (
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/kvoffloadd/kvoffloadd/bench/corrupt"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// Operations around the data path: invalidation, restarts, damage from
// outside, refused requests, Stats.

func (r *runner) invalidate(op Op) error {
	set := r.sh.Sets[op.NS]
	spec := r.sh.NS[set[0]]
	ids, ok, err := r.ids(set, op.Client)
	if err != nil || !ok {
		if err == nil {
			return r.skip()
		}
		return err
	}
	if r.arenaRecovering() {
		r.c.InvalInRecovery++
	}
	var keys []KeyRef // of set[0]; the others are the same hashes
	req := &pb.InvalidateRequest{NamespaceIds: ids}
	if op.Kind == InvalidateKeys {
		if op.Group >= spec.Groups() {
			return r.skip()
		}
		for p := op.From; p < min(op.From+op.N, r.sh.ChainLen); p++ {
			keys = append(keys, KeyRef{NS: set[0], Group: op.Group, Chain: op.Chain, Pos: p})
		}
		req.Keys = packKeys(spec, op.Group, keys)
	}
	// Every key the call may drop, in every namespace of the set.
	var affected []KeyRef
	if op.Kind == InvalidateKeys {
		for _, ns := range set {
			for _, k := range keys {
				k.NS = ns
				affected = append(affected, k)
			}
		}
	} else {
		for k := range r.m.keys {
			for _, ns := range set {
				if k.NS == ns {
					affected = append(affected, k)
				}
			}
		}
	}
	mayHold := 0
	for _, k := range affected {
		if r.m.maybePresent(k) {
			mayHold++
		}
	}
	cl, err := r.client(op.Client)
	if err != nil {
		return err
	}
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	resp, err := cl.API.Invalidate(ctx, req)
	if err != nil {
		if r.namespaceGone(set, err) {
			return r.skip()
		}
		return r.rpcErr("Invalidate", err)
	}
	t := r.m.next()
	if int(resp.GetRemoved()) > mayHold {
		return r.fail("accounting", "Invalidate over %v removed %d blocks; at most %d of its keys may be there", set, resp.GetRemoved(), mayHold)
	}
	for _, k := range affected {
		r.m.invalidated(k, t)
	}
	return nil
}

// readFaultKinds are the fault kinds that can fail a read.
var readFaultKinds = []string{"read-eio", "short-read", "bitflip"}

func (r *runner) restart(op Op) error {
	killed := op.Kind == Kill
	if r.arenaRecovering() {
		r.c.StopsInRecovery++
	}
	if m, err := r.p.Metrics(); err == nil {
		r.faultsInc = max(r.faultsInc, m.Sum("kvoffload_faults_injected_total"))
	}
	r.c.Faults += r.faultsInc
	if !killed && op.Seed&2 != 0 {
		// Clients leave first: their registrations drain and go
		// before the daemon is told to stop.
		for c := range r.conns {
			if err := r.disconnect(c); err != nil {
				return err
			}
		}
	}
	if killed {
		r.p.Kill()
		r.c.Kills++
	} else {
		if err := r.p.Stop(); err != nil {
			return r.fail("daemon", "%v", err)
		}
		r.c.Restarts++
	}
	for c, cn := range r.conns {
		r.closeConn(c)
		for _, g := range cn.regs {
			if g != nil {
				r.dropReg(g, false)
			}
		}
	}
	for _, j := range r.orphans {
		r.settleLost(j)
	}
	r.orphans, r.orphanRegs, r.leases, r.leaseEnds = nil, nil, nil, nil
	r.raced, r.racedPaths, r.leaked = nil, nil, 0
	faults, reset := "", false
	if r.sh.Disk() {
		faults, reset = op.Faults, op.Reset
	}
	if err := r.startDaemon(faults, reset); err != nil {
		return r.fail("daemon", "restart: %v", err)
	}
	// --disk-reset empties the disk tier, not a persistent arena.
	empty := (!r.sh.Disk() || reset) && !r.sh.CPUArena
	for i := range r.nsID {
		r.nsID[i] = 0
		if empty {
			r.inCat[i] = false
		}
	}
	readFaults := false
	for _, k := range readFaultKinds {
		readFaults = readFaults || strings.Contains(faults, k+"=")
	}
	r.m.restarted(killed, empty, readFaults)
	r.m.next()
	return nil
}

func (r *runner) corrupt(op Op) error {
	if !r.sh.Disk() {
		return r.skip()
	}
	payload := r.sh.NS[op.NS].Payload(op.Group)
	f, err := corrupt.New(r.p.DiskDirs[int(op.Seed>>8)%len(r.p.DiskDirs)], int64(r.sh.DiskChunk), int64(payload), op.Seed)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := f.Flip(op.Count)
	if err != nil {
		return err
	}
	r.m.next()
	if n > 0 {
		r.c.Corruptions += n
		// The flipper knows slots by payload size only.
		for ns, spec := range r.sh.NS {
			for g := 0; g < spec.Groups(); g++ {
				if spec.Payload(g) == payload {
					r.m.corrupted(ns, g)
				}
			}
		}
	}
	return nil
}

// regionFault cuts a registration's region file to nothing under a store
// and a load: every copy of theirs faults (SIGBUS in the daemon's copy
// worker) and must come back as DMA_ERROR, dropping what they touched, with
// the daemon alive. Then the file gets its size back (zeros).
func (r *runner) regionFault(op Op) error {
	g := r.conns[op.Client].regs[op.Slot]
	if g == nil {
		return r.skip()
	}
	spec := r.sh.NS[g.ns]
	if op.Group >= spec.Groups() {
		return r.skip()
	}
	// No job of the registration may be in flight across the cut: a
	// store reading zeros after it would store them as a good block.
	if err := r.drainResults(); err != nil {
		return err
	}
	st, err := os.Stat(g.path)
	if err != nil {
		return err
	}
	size := st.Size()
	storeOp := Op{Kind: Store, Group: op.Group, Chain: (op.Chain + 1) % r.sh.Chains, N: 2, Jobs: 1, Wait: true}
	loadOp := Op{Kind: Load, Group: op.Group, Chain: op.Chain, N: 2, Jobs: 1, Wait: true}
	var store, load []sentJob
	for _, o := range []Op{storeOp, loadOp} {
		ks := r.keyRange(o, g.ns, 0)
		blocks, err := r.freeBlocks(g, o.Group, len(ks))
		if err != nil || blocks == nil {
			return err
		}
		rec := &jobRec{id: g.nextJob, op: o.Kind, group: o.Group, step: r.step, incarnation: r.p.Incarnation, dma: true}
		g.nextJob++
		for i, k := range ks {
			g.busy[[2]int{o.Group, int(blocks[i])}] = rec.id
			s := r.m.key(k)
			for si, sg := range spec.Segments {
				if sg.Group != o.Group {
					continue
				}
				if o.Kind == Store {
					FillSegment(g.segment(spec, si, int(blocks[i])), k, s.gen, si)
				} else {
					Poison(g.segment(spec, si, int(blocks[i])), rec.id)
				}
			}
			b := blockRec{key: k, block: blocks[i]}
			if o.Kind == Load {
				b.allowed, b.must, b.mustBase = append([]uint32(nil), s.present...), s.must, s.mustBase
			}
			rec.blocks = append(rec.blocks, b)
		}
		sj := sentJob{rec: rec, wire: &pb.Job{JobId: rec.id, RequestId: fmt.Sprintf("fault%d", r.step), Keys: packKeys(spec, o.Group, ks), BlockIds: blocks}}
		if o.Kind == Store {
			store = append(store, sj)
		} else {
			load = append(load, sj)
		}
	}
	if err := os.Truncate(g.path, 0); err != nil {
		return err
	}
	r.cut = g
	var errS, errL error
	if c, err := r.newTransfer(storeOp, g, store, Store, nil); err != nil {
		errS = err
	} else {
		errS = r.runCalls([]call{c})
	}
	if errS == nil {
		if c, err := r.newTransfer(loadOp, g, load, Load, nil); err != nil {
			errL = err
		} else {
			errL = r.runCalls([]call{c})
		}
	}
	r.cut = nil
	if err := os.Truncate(g.path, size); err != nil {
		return err
	}
	// What the blocks held is gone: every engine block reads zeros now.
	clear(g.mem)
	if errS != nil {
		return errS
	}
	return errL
}

func (r *runner) badRequest(op Op) error {
	g := r.conns[op.Client].regs[op.Slot]
	if g == nil {
		return r.skip()
	}
	spec := r.sh.NS[g.ns]
	cl, err := r.client(g.client)
	if err != nil {
		return err
	}
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	// Keys past the chains: never stored by any other step, so a request
	// wrongly accepted cannot disturb the rest of the run.
	junk := func(i int) KeyRef { return KeyRef{NS: g.ns, Group: 0, Chain: 0, Pos: r.sh.ChainLen + i} }
	expect := func(call string, err error, want ...codes.Code) error {
		got := codeOf(err)
		for _, w := range want {
			if got == w {
				return nil
			}
		}
		if e := r.alive(); e != nil {
			return e
		}
		return r.fail("wrong-code", "%s (%s): got %v, want %v", call, badNames[op.Count], err, want)
	}
	free, err := r.freeBlocks(g, 0, 2)
	if err != nil || free == nil {
		return err
	}
	job := func(ks []KeyRef, blocks []uint32) *pb.Job {
		id := g.nextJob
		g.nextJob++
		return &pb.Job{JobId: id, Keys: packKeys(spec, 0, ks), BlockIds: blocks}
	}
	r.m.next()
	switch op.Count {
	case BadLayoutMismatch:
		if r.live[g.ns] == 0 {
			return r.skip()
		}
		bad := spec
		bad.Segments = append([]Segment{{Group: spec.Segments[0].Group, Bytes: spec.Segments[0].Bytes * 2}}, spec.Segments[1:]...)
		b, err := r.newRegion(bad, 4, false)
		if err != nil {
			return err
		}
		defer func() { unix.Munmap(b.mem); os.Remove(b.path) }()
		_, err = cl.Register(ctx, []byte(spec.Fingerprint), bad.Layout(), b.wire(), "bad layout")
		return expect("Register", err, codes.FailedPrecondition)
	case BadRegionPath:
		regions := g.wire()
		regions[0].Memory = &pb.Region_ShmPath{ShmPath: "/tmp/kvmodel-outside-shm"}
		_, err := cl.Register(ctx, []byte(spec.Fingerprint), spec.Layout(), regions, "bad path")
		return expect("Register", err, codes.InvalidArgument)
	case BadBlockRange:
		_, err := cl.Load(ctx, g.id, []*pb.Job{job([]KeyRef{junk(0)}, []uint32{uint32(g.blocks)})}, false)
		return expect("Load", err, codes.InvalidArgument)
	case BadDuplicateJob:
		j1 := job([]KeyRef{junk(0)}, free[:1])
		j2 := job([]KeyRef{junk(1)}, free[1:2])
		j2.JobId = j1.JobId
		_, err := cl.Store(ctx, g.id, []*pb.Job{j1, j2}, false)
		return expect("Store", err, codes.InvalidArgument)
	case BadUnknownReg:
		_, err := cl.Completions(ctx, 1<<40, 0)
		if e := expect("Completions", err, codes.NotFound); e != nil {
			return e
		}
		_, err = cl.Store(ctx, 1<<40, []*pb.Job{job([]KeyRef{junk(0)}, free[:1])}, false)
		return expect("Store", err, codes.NotFound)
	case BadUnknownNS:
		_, err := cl.API.Lookup(ctx, &pb.LookupRequest{NamespaceIds: []uint32{60000}, Keys: packKeys(spec, 0, []KeyRef{junk(0)})})
		return expect("Lookup", err, codes.InvalidArgument)
	case BadSameBlockInJob:
		_, err := cl.Load(ctx, g.id, []*pb.Job{job([]KeyRef{junk(0), junk(1)}, []uint32{free[0], free[0]})}, false)
		return expect("Load", err, codes.InvalidArgument)
	case BadSameBlockTwoJobs:
		j1 := job([]KeyRef{junk(0)}, free[:1])
		j2 := job([]KeyRef{junk(1)}, free[:1])
		res, err := cl.Load(ctx, g.id, []*pb.Job{j1, j2}, true)
		if codeOf(err) == codes.OK && r.o.Tol["two-jobs-one-block"] {
			// Accepted; both junk keys are MISSING, so nothing raced.
			for _, jr := range res {
				for _, f := range jr.GetFailures() {
					r.tally[tallyKey(Load, f.GetStatus())]++
				}
				r.tally[tallyKey(Load, statusOK)] += float64(int(jr.GetBlocks()) - len(jr.GetFailures()))
			}
			return nil
		}
		return expect("Load", err, codes.InvalidArgument)
	case BadForeignReg:
		if r.o.Tol["foreign-registration"] {
			return r.skip()
		}
		var other *reg
		for c, cn := range r.conns {
			for _, o := range cn.regs {
				if o != nil && c != g.client {
					other = o
				}
			}
		}
		if other == nil {
			return r.skip()
		}
		// Completions may come from another connection of the same
		// process (docs/api.md); a Store may not.
		_, err := cl.Store(ctx, other.id, []*pb.Job{job([]KeyRef{junk(0)}, []uint32{0})}, false)
		return expect("Store naming another connection's registration", err, codes.NotFound, codes.PermissionDenied)
	}
	return nil
}

// stats checks Stats against the model: tiers, and per namespace its
// registrations and an upper bound on its blocks.
func (r *runner) stats(c int) error {
	cl, err := r.client(c)
	if err != nil {
		return err
	}
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	st, err := cl.Stats(ctx)
	if err != nil {
		return r.rpcErr("Stats", err)
	}
	r.m.next()
	want := []string{"cpu"}
	if r.sh.Disk() {
		want = append(want, "disk")
	}
	if len(st.GetTiers()) != len(want) {
		return r.fail("accounting", "Stats has %d tiers, want %v", len(st.GetTiers()), want)
	}
	for i, t := range st.GetTiers() {
		if t.GetName() != want[i] || t.GetUsedBytes() > t.GetCapacityBytes() {
			return r.fail("accounting", "Stats tier %d: %s used %d of %d", i, t.GetName(), t.GetUsedBytes(), t.GetCapacityBytes())
		}
	}
	byPrint := map[string]int{}
	for i, s := range r.sh.NS {
		byPrint[s.Fingerprint] = i
	}
	for _, n := range st.GetNamespaces() {
		i, ok := byPrint[string(n.GetFingerprint())]
		if !ok {
			return r.fail("accounting", "Stats names namespace %d with a fingerprint nobody registered: %q", n.GetNamespaceId(), n.GetFingerprint())
		}
		draining := r.leaked
		for _, o := range append(append([]int{}, r.orphanRegs...), r.raced...) {
			if o == i {
				draining++
			}
		}
		if int(n.GetRegistrations()) < r.live[i] || int(n.GetRegistrations()) > r.live[i]+draining {
			return r.fail("accounting", "Stats: namespace %s has %d registrations, %d live (%d draining)", r.sh.NS[i].Fingerprint, n.GetRegistrations(), r.live[i], draining)
		}
		may := 0
		for k, s := range r.m.keys {
			if k.NS == i && len(s.present) > 0 {
				may++
			}
		}
		if int(n.GetBlocks()) > may {
			return r.fail("accounting", "Stats: namespace %s has %d blocks; at most %d of its keys may be there", r.sh.NS[i].Fingerprint, n.GetBlocks(), may)
		}
	}
	if st.GetVersion() == "" {
		return r.fail("accounting", "Stats has no version")
	}
	return nil
}
