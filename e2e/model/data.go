package model

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// The data path: lookups, stores, loads and their results, each checked
// against the model.

// keyRange returns the keys of job j of a store or load op.
func (r *runner) keyRange(op Op, ns, j int) []KeyRef {
	chain := (op.Chain + j) % r.sh.Chains
	end := min(op.From+op.N, r.sh.ChainLen)
	var ks []KeyRef
	for p := op.From; p < end; p++ {
		ks = append(ks, KeyRef{NS: ns, Group: op.Group, Chain: chain, Pos: p})
	}
	return ks
}

func packKeys(spec NSSpec, group int, ks []KeyRef) *pb.KeyList {
	h := make([]byte, 0, len(ks)*spec.HashBytes)
	for _, k := range ks {
		h = append(h, Hash(k.Chain, k.Pos, spec.HashBytes)...)
	}
	return &pb.KeyList{Group: uint32(group), Hashes: h}
}

// freeBlocks picks n engine blocks of group g not used by a job in flight,
// reading completions to free some when too few are.
func (r *runner) freeBlocks(g *reg, group, n int) ([]uint32, error) {
	for try := 0; ; try++ {
		var free []uint32
		for b := 0; b < g.blocks; b++ {
			if _, busy := g.busy[[2]int{group, b}]; !busy {
				free = append(free, uint32(b))
			}
		}
		if len(free) >= n {
			r.rng.Shuffle(len(free), func(i, j int) { free[i], free[j] = free[j], free[i] })
			return free[:n], nil
		}
		if try == 3 || len(g.jobs) == 0 {
			return nil, nil
		}
		if err := r.readCompletions(g, 50, 0); err != nil {
			return nil, err
		}
	}
}

// sentJob is a job as built for a request, before the daemon accepted it.
type sentJob struct {
	rec  *jobRec
	wire *pb.Job
}

func (r *runner) store(op Op) error {
	c, err := r.prepareStore(op)
	if c == nil || err != nil {
		return err
	}
	return r.runCalls([]call{c})
}

// prepareStore picks engine blocks, fills them with the keys' bytes and
// builds the request; nil when the operation does not apply.
func (r *runner) prepareStore(op Op) (*transferCall, error) {
	g := r.conns[op.Client].regs[op.Slot]
	if g == nil {
		return nil, r.skip()
	}
	spec := r.sh.NS[g.ns]
	if op.Group >= spec.Groups() {
		return nil, r.skip()
	}
	var jobs []sentJob
	var all []uint32
	for j := 0; j < op.Jobs; j++ {
		ks := r.keyRange(op, g.ns, j)
		blocks, err := r.freeBlocks(g, op.Group, len(ks))
		if err != nil {
			return nil, err
		}
		if blocks == nil || overlaps(all, blocks) {
			break
		}
		all = append(all, blocks...)
		for b := range blocks {
			// Reserve now so the next job of the request picks others.
			g.busy[[2]int{op.Group, int(blocks[b])}] = 0
		}
		rec := &jobRec{id: g.nextJob, op: Store, group: op.Group, step: r.step, incarnation: r.p.Incarnation}
		g.nextJob++
		for i, k := range ks {
			gen := r.m.key(k).gen
			for s, sg := range spec.Segments {
				if sg.Group == op.Group {
					FillSegment(g.segment(spec, s, int(blocks[i])), k, gen, s)
				}
			}
			rec.blocks = append(rec.blocks, blockRec{key: k, block: blocks[i]})
		}
		jobs = append(jobs, sentJob{rec: rec, wire: &pb.Job{JobId: rec.id, RequestId: fmt.Sprintf("s%d", r.step), Keys: packKeys(spec, op.Group, ks), BlockIds: blocks}})
	}
	if len(jobs) == 0 {
		return nil, r.skip()
	}
	return r.newTransfer(op, g, jobs, Store, nil)
}

func overlaps(a, b []uint32) bool {
	for _, x := range b {
		if slices.Contains(a, x) {
			return true
		}
	}
	return false
}

func (r *runner) load(op Op) error {
	c, err := r.prepareLoad(op)
	if c == nil || err != nil {
		return err
	}
	return r.runCalls([]call{c})
}

// prepareLoad picks engine blocks, poisons them, notes what each block may
// receive, and builds the request; nil when the operation does not apply.
func (r *runner) prepareLoad(op Op) (*transferCall, error) {
	g := r.conns[op.Client].regs[op.Slot]
	if g == nil {
		return nil, r.skip()
	}
	spec := r.sh.NS[g.ns]
	if op.Group >= spec.Groups() {
		return nil, r.skip()
	}
	var ls *lease
	var leased []KeyRef
	if op.UseLease {
		// The newest lease over this namespace and group: the scheduler
		// leased a request's prefix, the worker loads it.
		for i := len(r.leases) - 1; i >= 0 && ls == nil; i-- {
			l := r.leases[i]
			if l.group != op.Group || !slices.Contains(l.set, g.ns) {
				continue
			}
			for k := range l.keys {
				if k.NS == g.ns {
					leased = append(leased, k)
				}
			}
			if len(leased) > 0 {
				ls = l
			}
		}
		slices.SortFunc(leased, func(a, b KeyRef) int { return a.Pos - b.Pos })
	}
	var jobs []sentJob
	var all []uint32
	for j := 0; j < op.Jobs; j++ {
		ks := r.keyRange(op, g.ns, j)
		if ls != nil {
			if j > 0 {
				break // one request's prefix, one job
			}
			ks = leased
		}
		blocks, err := r.freeBlocks(g, op.Group, len(ks))
		if err != nil {
			return nil, err
		}
		if blocks == nil || overlaps(all, blocks) {
			break
		}
		all = append(all, blocks...)
		rec := &jobRec{id: g.nextJob, op: Load, group: op.Group, step: r.step, incarnation: r.p.Incarnation}
		g.nextJob++
		for b := range blocks {
			g.busy[[2]int{op.Group, int(blocks[b])}] = 0
		}
		for i, k := range ks {
			for s, sg := range spec.Segments {
				if sg.Group == op.Group {
					Poison(g.segment(spec, s, int(blocks[i])), rec.id)
				}
			}
			s := r.m.key(k)
			b := blockRec{key: k, block: blocks[i], allowed: slices.Clone(s.present), must: s.must, mustBase: s.mustBase, corrupt: s.corrupt}
			if ls != nil && ls.client == g.client && ls.gen == r.conns[g.client].gen {
				b.corrupt = b.corrupt || ls.corrupt[k]
				for _, gen := range ls.keys[k] {
					b.staleLease = b.staleLease || gen != s.gen
					if gen == s.gen || r.o.Tol["lease-after-invalidate"] {
						b.allowed = addGen(b.allowed, gen)
					}
				}
			}
			rec.blocks = append(rec.blocks, b)
		}
		w := &pb.Job{JobId: rec.id, RequestId: fmt.Sprintf("l%d", r.step), Keys: packKeys(spec, op.Group, ks), BlockIds: blocks}
		if ls != nil {
			w.LeaseId = ls.id
		}
		jobs = append(jobs, sentJob{rec: rec, wire: w})
	}
	if len(jobs) == 0 {
		return nil, r.skip()
	}
	var accepted func(time.Time)
	if ls != nil {
		// The first Load of a namespace naming the lease takes its pins
		// (the first prepared: two loads of a burst cannot both have
		// them). Whether it was still alive is known once the call
		// returns: the daemon took the lease inside it.
		owned := ls.client == g.client && ls.gen == r.conns[g.client].gen
		first := owned && !ls.consumed[g.ns] && (!ls.anyUsed || !r.o.Tol["lease-one-rank"])
		if owned {
			ls.consumed[g.ns] = true
			ls.anyUsed = true
		}
		accepted = func(returned time.Time) {
			j := jobs[0].rec
			live := first && ls.live(returned)
			for i := range j.blocks {
				if _, ok := ls.keys[j.blocks[i].key]; ok {
					// An Invalidate since the Lookup took the lease's
					// pin of the key with it: MISSING is right then.
					j.blocks[i].leased = live && (!j.blocks[i].staleLease || r.o.Tol["lease-after-invalidate"])
				}
			}
		}
	}
	return r.newTransfer(op, g, jobs, Load, accepted)
}

// call is one request: prepared from the model as it stands, sent (maybe
// at once with others: a burst), then finished, in order, against the
// model.
type call interface {
	send()
	finish(contested map[KeyRef]bool) error
	kind() Kind
}

// runCalls sends calls at once and finishes them: transfers first (so
// their jobs are filed before any Completions can report them), stores
// before loads, then lookups and completions.
func (r *runner) runCalls(calls []call) error {
	if len(calls) == 1 {
		calls[0].send()
	} else {
		for _, c := range calls {
			switch cc := c.(type) {
			case *completionsCall:
				cc.concurrent = true
				cc.ackMax = cc.g.acked
			case *transferCall:
				cc.concurrent = true
				cc.ackMax = cc.g.acked
			}
		}
		var wg sync.WaitGroup
		for _, c := range calls {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c.send()
			}()
		}
		wg.Wait()
	}
	// Keys two stores of one burst wrote: which of them claimed is
	// unknown, so neither one's OK proves its key ready.
	seen := map[KeyRef]int{}
	for _, c := range calls {
		if t, ok := c.(*transferCall); ok && t.kindOf == Store {
			for _, j := range t.jobs {
				for _, b := range j.rec.blocks {
					seen[b.key]++
				}
			}
		}
	}
	contested := map[KeyRef]bool{}
	for k, n := range seen {
		if n > 1 {
			contested[k] = true
		}
	}
	slices.SortStableFunc(calls, func(a, b call) int { return callOrder(a.kind()) - callOrder(b.kind()) })
	// The burst's first tick: its stores finish (and tick) before its loads.
	start := r.m.tick
	var first error
	for _, c := range calls {
		if t, ok := c.(*transferCall); ok && t.kindOf == Load && len(seen) > 0 {
			// A store of the burst may have made a key ready before
			// the load pinned it: the load may read what it wrote.
			for _, j := range t.jobs {
				for i := range j.rec.blocks {
					b := &j.rec.blocks[i]
					if seen[b.key] > 0 {
						b.allowed = addGen(b.allowed, r.m.key(b.key).gen)
						// And it may have claimed the key after
						// the load failed and dropped it.
						b.clearFrom = start
					}
				}
			}
		}
		if err := c.finish(contested); err != nil && first == nil {
			first = err
		}
	}
	// Results piggybacked on a transfer may be any job's of the burst:
	// checked once every transfer has filed its jobs.
	for _, c := range calls {
		if t, ok := c.(*transferCall); ok && first == nil {
			first = t.finishPiggyback()
		}
	}
	return first
}

func callOrder(k Kind) int {
	switch k {
	case Store:
		return 0
	case Load:
		return 1
	case Lookup:
		return 2
	}
	return 3
}

// transferCall is a Store or Load request.
type transferCall struct {
	r        *runner
	op       Op
	g        *reg
	jobs     []sentJob
	kindOf   Kind
	accepted func(returned time.Time)
	// concurrent, ackMax: as completionsCall's, for the results a reply
	// without wait carries.
	concurrent bool
	ackMax     uint64
	cl         *client.Client
	req        *pb.TransferRequest
	timeout    time.Duration
	resp       *pb.TransferResponse
	err        error
	returned   time.Time
}

func (r *runner) newTransfer(op Op, g *reg, jobs []sentJob, kind Kind, accepted func(time.Time)) (*transferCall, error) {
	cl, err := r.client(g.client)
	if err != nil {
		return nil, err
	}
	c := &transferCall{r: r, op: op, g: g, jobs: jobs, kindOf: kind, accepted: accepted, cl: cl, timeout: callTimeout}
	c.req = &pb.TransferRequest{RegistrationId: g.id, Wait: op.Wait}
	if op.Ack && !g.legacy {
		// The cursor: this request acknowledges what the runner has
		// processed, and its results stay queued until a later call
		// acknowledges them, so a reply that never arrived costs nothing.
		// Without wait the reply carries the finished results after it.
		ack := g.acked
		c.req.AckSeq = &ack
	}
	for _, j := range jobs {
		c.req.Jobs = append(c.req.Jobs, j.wire)
	}
	if op.Abandon {
		c.timeout = time.Duration(1+r.rng.IntN(3)) * time.Millisecond
	}
	return c, nil
}

func (c *transferCall) kind() Kind { return c.kindOf }

func (c *transferCall) send() {
	ctx, cancel := ctxFor(c.timeout)
	defer cancel()
	if c.kindOf == Store {
		c.resp, c.err = c.cl.API.Store(ctx, c.req)
	} else {
		c.resp, c.err = c.cl.API.Load(ctx, c.req)
	}
	c.returned = time.Now()
}

// finish files the jobs the daemon took and checks any results.
func (c *transferCall) finish(contested map[KeyRef]bool) error {
	r, op, g, jobs, kind, resp, err := c.r, c.op, c.g, c.jobs, c.kindOf, c.resp, c.err
	maybe := false
	switch codeOf(err) {
	case codes.OK:
	case codes.DeadlineExceeded, codes.Canceled:
		if !op.Abandon {
			return r.rpcErr(kind.String(), err)
		}
		// The daemon may or may not have accepted the jobs; if it did,
		// their results come through Completions.
		maybe = true
	default:
		for _, j := range jobs {
			for _, b := range j.rec.blocks {
				delete(g.busy, [2]int{j.rec.group, int(b.block)})
			}
		}
		return r.rpcErr(kind.String(), err)
	}
	t := r.m.next()
	for _, j := range jobs {
		rec := j.rec
		rec.issued, rec.maybe, rec.returned = t, maybe, c.returned
		// Without ack_seq a reply sent as its caller gave up takes its
		// results with it, as documented (docs/api.md "Results of a Store
		// or Load with wait").
		rec.lossy = maybe && c.req.AckSeq == nil
		rec.dma = rec.dma || r.cut == g
		for i := range rec.blocks {
			b := &rec.blocks[i]
			b.issued = t
			if b.clearFrom == 0 {
				b.clearFrom = t
			}
			g.busy[[2]int{rec.group, int(b.block)}] = rec.id
			if kind == Load {
				r.m.key(b.key).loading++
			}
			if kind == Store {
				b.alone, b.mustBase, b.must = r.m.storeAccepted(b.key, t)
				b.alone = b.alone && !contested[b.key]
				b.base = r.lastLoss
			}
		}
		g.jobs[rec.id] = rec
		if kind == Store {
			r.c.StoreJobs++
		} else {
			r.c.LoadJobs++
		}
	}
	if c.accepted != nil {
		c.accepted(c.returned)
	}
	if resp != nil && op.Wait {
		if len(resp.GetResults()) != len(jobs) {
			return r.fail("lost-result", "%s with wait returned %d results for %d jobs", kind, len(resp.GetResults()), len(jobs))
		}
		for i, res := range resp.GetResults() {
			if res.GetJobId() != jobs[i].rec.id {
				return r.fail("wrong-result", "%s with wait: result %d is job %d, want job %d (request order)", kind, i, res.GetJobId(), jobs[i].rec.id)
			}
			if ack := c.req.AckSeq; ack != nil {
				// Queued with its seq like any other result, and still
				// queued: Completions sends it again until acknowledged.
				if res.GetSeq() <= *ack {
					return r.fail("wrong-result", "%s with wait and ack_seq %d: job %d has seq %d", kind, *ack, res.GetJobId(), res.GetSeq())
				}
				if !g.process(res.GetSeq()) {
					continue // a Completions of the burst had it first
				}
			} else if res.GetSeq() != 0 {
				return r.fail("wrong-result", "%s with wait and no ack_seq: job %d has seq %d, want 0 (it never joins the queue)", kind, res.GetJobId(), res.GetSeq())
			}
			if err := r.result(g, res); err != nil {
				return err
			}
		}
	} else if resp != nil && c.req.AckSeq == nil && (len(resp.GetResults()) > 0 || resp.GetMore() || resp.GetPending() > 0) {
		return r.fail("wrong-result", "%s without wait and without ack_seq returned %d results (more %v, pending %d)", kind, len(resp.GetResults()), resp.GetMore(), resp.GetPending())
	}
	return nil
}

// finishPiggyback checks the results a transfer without wait and with
// ack_seq carried, as a Completions reply with that ack_seq: run once
// every transfer of the call's burst has filed its jobs, since the reply
// may carry another one's.
func (c *transferCall) finishPiggyback() error {
	r, g, resp := c.r, c.g, c.resp
	if resp == nil || c.err != nil || c.op.Wait || c.req.AckSeq == nil {
		return nil
	}
	if r.conns[g.client].regs[g.slot] != g {
		return nil // dropped (an earlier finish of a burst failed)
	}
	what := fmt.Sprintf("%s without wait", c.kindOf)
	if err := r.cursorResults(g, what, c.req.GetAckSeq(), c.concurrent, c.ackMax, resp.GetResults()); err != nil {
		return err
	}
	if p := int(resp.GetPending()); p > len(g.jobs) && !c.concurrent {
		return r.fail("accounting", "%s says %d jobs pending, the registration has %d unfinished", what, p, len(g.jobs))
	}
	return nil
}

func (r *runner) completions(op Op) error {
	c, err := r.prepareCompletions(op)
	if c == nil || err != nil {
		return err
	}
	return r.runCalls([]call{c})
}

// completionsCall is a Completions request; cut ones have a deadline too
// short for their wait.
type completionsCall struct {
	r       *runner
	g       *reg
	cl      *client.Client
	req     *pb.CompletionsRequest
	timeout time.Duration
	cut     bool
	// concurrent: sent in a burst, so its pending count may predate
	// results another call of the burst already reported, and another
	// call of the burst may have acknowledged up to ackMax (preparing a
	// later call can read completions first): the daemon may have let go
	// of the results up to it before this reply was made.
	concurrent bool
	ackMax     uint64
	resp       *pb.CompletionsResponse
	err        error
}

func (c *completionsCall) kind() Kind { return Completions }

func (c *completionsCall) send() {
	ctx, cancel := ctxFor(c.timeout)
	defer cancel()
	c.resp, c.err = c.cl.API.Completions(ctx, c.req)
}

func (r *runner) prepareCompletions(op Op) (*completionsCall, error) {
	g := r.conns[op.Client].regs[op.Slot]
	if g == nil {
		return nil, r.skip()
	}
	c, err := r.newCompletions(g, op.WaitMs, op.MaxJobs)
	if err != nil {
		return nil, err
	}
	if op.Seed%7 == 0 {
		// A reply cut off by the caller's deadline must not take results
		// with it (issue 9 item 2, DESIGN §3.8).
		c.cut = true
		c.req.WaitMs = 20
		c.timeout = time.Duration(1+r.rng.IntN(2)) * time.Millisecond
	}
	return c, nil
}

func (r *runner) newCompletions(g *reg, waitMs, maxJobs uint32) (*completionsCall, error) {
	cl, err := r.client(g.client)
	if err != nil {
		return nil, err
	}
	c := &completionsCall{r: r, g: g, cl: cl, timeout: callTimeout,
		req: &pb.CompletionsRequest{RegistrationId: g.id, WaitMs: waitMs, MaxJobs: maxJobs}}
	if !g.legacy {
		ack := g.acked
		c.req.AckSeq = &ack
	}
	return c, nil
}

// readCompletions reads one Completions reply of g and checks each result.
func (r *runner) readCompletions(g *reg, waitMs, maxJobs uint32) error {
	c, err := r.newCompletions(g, waitMs, maxJobs)
	if err != nil {
		return err
	}
	c.send()
	return c.finish(nil)
}

func (c *completionsCall) finish(map[KeyRef]bool) error {
	r, g, resp, err := c.r, c.g, c.resp, c.err
	if c.cut && (codeOf(err) == codes.DeadlineExceeded || codeOf(err) == codes.Canceled) {
		g.cutoff = r.m.next()
		return nil
	}
	if err != nil {
		return r.rpcErr("Completions", err)
	}
	if r.conns[g.client].regs[g.slot] != g {
		return nil // dropped (an earlier finish of a burst failed)
	}
	if mj := c.req.GetMaxJobs(); mj > 0 && len(resp.GetResults()) > int(mj) {
		return r.fail("wrong-result", "Completions with max_jobs %d returned %d", mj, len(resp.GetResults()))
	}
	if g.legacy {
		// Without the cursor two calls of a burst split the queue
		// between them in any order; a result sent twice is caught
		// by its job.
		for _, res := range resp.GetResults() {
			if err := r.result(g, res); err != nil {
				return err
			}
		}
	} else if err := r.cursorResults(g, "Completions", c.req.GetAckSeq(), c.concurrent, c.ackMax, resp.GetResults()); err != nil {
		return err
	}
	if p := int(resp.GetPending()); p > len(g.jobs) && !c.concurrent {
		return r.fail("accounting", "Completions says %d jobs pending, the registration has %d unfinished", p, len(g.jobs))
	}
	return nil
}

// cursorResults checks the results of a reply of g's queue read with
// acknowledgement ack (Completions', or a transfer's without wait): every
// queued result, in seq order from the acknowledged one on, with no gap,
// until acknowledged. A wait reply with ack_seq or another call of a burst
// may have processed some already: each seq is processed once.
func (r *runner) cursorResults(g *reg, what string, ack uint64, concurrent bool, ackMax uint64, results []*pb.JobResult) error {
	piggy := what != "Completions"
	prev := ack
	for i, res := range results {
		seq := res.GetSeq()
		switch {
		case seq <= ack:
			return r.fail("wrong-result", "%s acknowledging %d returned job %d with seq %d again", what, ack, res.GetJobId(), seq)
		case i == 0 && concurrent && seq <= ackMax+1:
		case seq != prev+1:
			return r.fail("lost-result", "%s of registration %d acknowledging %d jumped from seq %d to %d (job %d): results in between were lost", what, g.id, ack, prev, seq, res.GetJobId())
		}
		prev = seq
		if !g.process(seq) {
			continue
		}
		if piggy {
			r.c.Piggybacked++
		}
		if err := r.result(g, res); err != nil {
			return err
		}
	}
	return nil
}

var statusOK = pb.BlockStatus_BLOCK_STATUS_OK

// result checks one job result against the job as sent and the model.
func (r *runner) result(g *reg, res *pb.JobResult) error {
	j := g.jobs[res.GetJobId()]
	if j == nil && g.notTaken[res.GetJobId()] {
		return r.fail("wrong-result", "a result for job %d of registration %d, whose call gave up more than %s before and which the daemon did not report when nothing was pending", res.GetJobId(), g.id, maybeGrace)
	}
	if j == nil {
		if res.GetJobId() < g.nextJob {
			return r.fail("wrong-result", "job %d of registration %d reported again (or a job the daemon refused reported)", res.GetJobId(), g.id)
		}
		return r.fail("wrong-result", "a result for job %d, never sent on registration %d", res.GetJobId(), g.id)
	}
	delete(g.jobs, j.id)
	for _, b := range j.blocks {
		delete(g.busy, [2]int{j.group, int(b.block)})
	}
	wantOp := pb.Op_OP_STORE
	if j.op == Load {
		wantOp = pb.Op_OP_LOAD
	}
	if res.GetOp() != wantOp || int(res.GetBlocks()) != len(j.blocks) {
		return r.fail("wrong-result", "job %d: op %v with %d blocks, sent %v with %d", j.id, res.GetOp(), res.GetBlocks(), wantOp, len(j.blocks))
	}
	spec := r.sh.NS[g.ns]
	st := make([]pb.BlockStatus, len(j.blocks))
	for _, f := range res.GetFailures() {
		i := int(f.GetIndex())
		if i >= len(j.blocks) || f.GetStatus() == statusOK {
			return r.fail("wrong-result", "job %d: failure %v is out of range or OK", j.id, f)
		}
		b := j.blocks[i]
		if f.GetBlockId() != b.block || !bytes.Equal(f.GetHash(), Hash(b.key.Chain, b.key.Pos, spec.HashBytes)) {
			return r.fail("wrong-result", "job %d: failure at index %d names block %d hash %x, the job has block %d key %s", j.id, i, f.GetBlockId(), f.GetHash(), b.block, b.key)
		}
		if st[i] != statusOK {
			return r.fail("wrong-result", "job %d: block %d fails twice", j.id, i)
		}
		st[i] = f.GetStatus()
	}
	if res.GetOk() != (len(res.GetFailures()) == 0) {
		return r.fail("wrong-result", "job %d: ok=%v with %d failures", j.id, res.GetOk(), len(res.GetFailures()))
	}
	for i := range j.blocks {
		r.tally[tallyKey(j.op, st[i])]++
		var err error
		if j.op == Store {
			err = r.storeBlock(j, &j.blocks[i], st[i])
		} else {
			err = r.loadBlock(g, j, &j.blocks[i], st[i])
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func tallyKey(op Kind, st pb.BlockStatus) string {
	return op.String() + "/" + statusName(st)
}

func statusName(st pb.BlockStatus) string {
	n := pb.BlockStatus_name[int32(st)]
	if len(n) > len("BLOCK_STATUS_") {
		n = n[len("BLOCK_STATUS_"):]
	}
	return lower(n)
}

func lower(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c >= 'A' && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}

func (r *runner) storeBlock(j *jobRec, b *blockRec, st pb.BlockStatus) error {
	switch st {
	case statusOK:
		r.m.storeSettled(b.key, b, true, false, j.incarnation, r.p.Incarnation)
		return nil
	case pb.BlockStatus_BLOCK_STATUS_NO_SPACE, pb.BlockStatus_BLOCK_STATUS_REJECTED:
	case pb.BlockStatus_BLOCK_STATUS_DMA_ERROR:
		if !j.dma {
			return r.fail("unexpected-status", "store job %d (step %d): %s DMA_ERROR with its region intact", j.id, j.step, b.key)
		}
	default:
		return r.fail("unexpected-status", "store job %d (step %d): %s %v", j.id, j.step, b.key, st)
	}
	// Only a claim can fail: the key was absent when the store came.
	if b.must && j.incarnation == r.p.Incarnation {
		if err := r.mustHold(b.key, b.mustBase, fmt.Sprintf("store job %d (step %d) claimed %s (it failed %v), so the key was absent", j.id, j.step, b.key, st)); err != nil {
			return err
		}
	}
	r.m.storeSettled(b.key, b, false, false, j.incarnation, r.p.Incarnation)
	return nil
}

func (r *runner) loadBlock(g *reg, j *jobRec, b *blockRec, st pb.BlockStatus) error {
	spec := r.sh.NS[g.ns]
	ks := r.m.key(b.key)
	r.m.loadSettled(b.key, j.incarnation == r.p.Incarnation, st == statusOK)
	switch st {
	case statusOK:
		if r.cut == g {
			return r.fail("wrong-result", "load job %d reported %s OK into block %d while its region file was cut to nothing", j.id, b.key, b.block)
		}
		if len(b.allowed) == 0 {
			return r.fail("loaded-absent", "load job %d (step %d) loaded %s into block %d, which was not there (invalidated, failed or never stored; generation %d)%s",
				j.id, j.step, b.key, b.block, ks.gen, r.describeBlock(g, spec, j.group, b.block))
		}
		for s, sg := range spec.Segments {
			if sg.Group != j.group {
				continue
			}
			got := g.segment(spec, s, int(b.block))
			ok := false
			for _, gen := range b.allowed {
				if m, _ := SegmentMatches(got, b.key, gen, s); m {
					ok = true
					break
				}
			}
			if !ok {
				r.c.WrongBytes++
				_, at := SegmentMatches(got, b.key, b.allowed[0], s)
				return r.fail("wrong-bytes", "load job %d (step %d) reported %s OK into block %d, but segment %d holds %s (want generation %v; first wrong byte %d)",
					j.id, j.step, b.key, b.block, s, Describe(got), b.allowed, at)
			}
		}
		r.c.BlocksVerified++
	case pb.BlockStatus_BLOCK_STATUS_MISSING:
		if b.leased {
			return r.fail("missing-leased", "load job %d (step %d): %s MISSING though a live lease held it", j.id, j.step, b.key)
		}
		if b.must && j.incarnation == r.p.Incarnation {
			return r.mustHold(b.key, b.mustBase, fmt.Sprintf("load job %d (step %d) found %s MISSING", j.id, j.step, b.key))
		}
	case pb.BlockStatus_BLOCK_STATUS_NO_SPACE:
		if !r.sh.Disk() && !r.sh.HasRemote() {
			return r.fail("unexpected-status", "load job %d (step %d): %s NO_SPACE without a disk tier to stage from", j.id, j.step, b.key)
		}
	case pb.BlockStatus_BLOCK_STATUS_IO_ERROR, pb.BlockStatus_BLOCK_STATUS_CORRUPT:
		underRead := ks.lastClear > b.issued && r.o.Tol["discard-under-read"]
		// A remote block's read may fail (IO_ERROR) on a busy machine
		// without a fault plan: a recompute, never a wrong block.
		if !r.m.readFaults && !ks.corrupt && !b.corrupt && !(b.staleLease && r.o.Tol["lease-after-invalidate"]) && !underRead && !(r.sh.HasRemote() && st == pb.BlockStatus_BLOCK_STATUS_IO_ERROR) {
			return r.fail("unexpected-status", "load job %d (step %d): %s %v with no fault plan and no corruption", j.id, j.step, b.key, st)
		}
		r.m.loadFailed(b.key, b.clearFrom, b.issued, true)
	case pb.BlockStatus_BLOCK_STATUS_DMA_ERROR:
		if !j.dma {
			return r.fail("unexpected-status", "load job %d (step %d): %s DMA_ERROR with its region intact", j.id, j.step, b.key)
		}
		r.m.loadFailed(b.key, b.clearFrom, b.issued, false)
	default:
		return r.fail("unexpected-status", "load job %d (step %d): %s %v", j.id, j.step, b.key, st)
	}
	return nil
}

func (r *runner) describeBlock(g *reg, spec NSSpec, group int, block uint32) string {
	for s, sg := range spec.Segments {
		if sg.Group == group {
			return "; it holds " + Describe(g.segment(spec, s, int(block)))
		}
	}
	return ""
}

// mustHold checks a key that was stored while the loss counter stood at
// base and is now found absent: some loss must have been counted since.
// Counters move just after the index does, so it looks again for a while
// before it calls the loss uncounted.
func (r *runner) mustHold(k KeyRef, base float64, what string) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		m, err := r.p.Metrics()
		if err != nil {
			return err
		}
		if l := m.Losses(); l > base {
			return nil
		}
		if time.Now().After(deadline) {
			return r.fail("not-offered", "%s: it was stored OK and not invalidated since, and no eviction, failed demotion or failed load was counted since (loss counter %.0f)", what, base)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *runner) lookup(op Op) error {
	c, err := r.prepareLookup(op)
	if c == nil || err != nil {
		return err
	}
	return r.runCalls([]call{c})
}

// lookupCall is a Lookup request.
type lookupCall struct {
	r   *runner
	op  Op
	set []int
	ks  [][]KeyRef // per namespace of the set
	cl  *client.Client
	req *pb.LookupRequest
	// must, base and was: each key's must state, and whether it may have
	// been there, when the call was prepared: the other calls of a burst
	// may change both after the lookup ran (a store makes a must, a
	// failed load clears a key the lookup saw).
	must [][]bool
	base [][]float64
	was  [][]bool
	sent time.Time
	resp *pb.LookupResponse
	err  error
}

func (c *lookupCall) kind() Kind { return Lookup }

func (c *lookupCall) send() {
	c.sent = time.Now()
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	c.resp, c.err = c.cl.API.Lookup(ctx, c.req)
}

func (r *runner) prepareLookup(op Op) (*lookupCall, error) {
	set := r.sh.Sets[op.NS]
	spec := r.sh.NS[set[0]]
	if op.Group >= spec.Groups() {
		return nil, r.skip()
	}
	ids, ok, err := r.ids(set, op.Client)
	if err != nil || !ok {
		if err == nil {
			return nil, r.skip()
		}
		return nil, err
	}
	cl, err := r.client(op.Client)
	if err != nil {
		return nil, err
	}
	ks := make([][]KeyRef, len(set))
	for i, ns := range set {
		for p := 0; p < op.N; p++ {
			ks[i] = append(ks[i], KeyRef{NS: ns, Group: op.Group, Chain: op.Chain, Pos: p})
		}
	}
	req := &pb.LookupRequest{NamespaceIds: ids, Keys: packKeys(spec, op.Group, ks[0]), LeaseMs: op.LeaseMs, Peek: op.Peek}
	c := &lookupCall{r: r, op: op, set: set, ks: ks, cl: cl, req: req}
	for _, row := range ks {
		must, base, was := make([]bool, len(row)), make([]float64, len(row)), make([]bool, len(row))
		for i, k := range row {
			st := r.m.key(k)
			must[i], base[i], was[i] = st.must, st.mustBase, len(st.present) > 0
		}
		c.must, c.base, c.was = append(c.must, must), append(c.base, base), append(c.was, was)
	}
	return c, nil
}

// finish checks the answer: every offered key may be there, a key that
// must be there is offered unless a loss was counted, a lease comes with
// what it holds.
func (c *lookupCall) finish(map[KeyRef]bool) error {
	r, op, set, ks, sent, resp, err := c.r, c.op, c.set, c.ks, c.sent, c.resp, c.err
	if err != nil {
		if r.namespaceGone(set, err) {
			return r.skip()
		}
		return r.rpcErr("Lookup", err)
	}
	r.m.next()
	r.c.Lookups++
	n := int(resp.GetReady())
	r.c.Offered += n
	if n > op.N || len(resp.GetTiers()) != n {
		return r.fail("wrong-result", "Lookup of %d keys: ready %d with %d tiers", op.N, n, len(resp.GetTiers()))
	}
	for i, tier := range resp.GetTiers() {
		if r.sh.HasRemote() && tier == pb.Tier_TIER_REMOTE {
			continue
		}
		if tier == pb.Tier_TIER_NONE || tier > pb.Tier_TIER_CPU_AND_DISK || (!r.sh.Disk() && tier != pb.Tier_TIER_CPU) {
			return r.fail("wrong-result", "Lookup: key %d offered in tier %v", i, tier)
		}
	}
	for i := 0; i < n; i++ {
		for s := range set {
			k := ks[s][i]
			if !r.m.maybePresent(k) && !c.was[s][i] {
				st := r.m.key(k)
				return r.fail("offered-absent", "Lookup over %v offered %s (position %d of %d ready), which is not there: generation %d, last cleared at tick %d, last stored at tick %d",
					set, k, i, n, st.gen, st.lastClear, st.lastStore)
			}
		}
	}
	if n < op.N {
		// The first key not offered: if every namespace must hold it,
		// a loss must have been counted since the earliest was stored.
		base, allMust := 0.0, true
		for s := range set {
			if !c.must[s][n] || !r.m.key(ks[s][n]).must {
				allMust = false
				break
			}
			if s == 0 || c.base[s][n] < base {
				base = c.base[s][n]
			}
		}
		if allMust {
			if err := r.mustHold(ks[0][n], base, fmt.Sprintf("Lookup over %v offered %d keys, not %s", set, n, ks[0][n])); err != nil {
				return err
			}
		}
	}
	if op.LeaseMs > 0 {
		// A lease pins the local prefix only: the keys only the remote
		// tier holds come after it and are never pinned.
		for i, tier := range resp.GetTiers() {
			if tier == pb.Tier_TIER_REMOTE {
				n = i
				break
			}
		}
		switch {
		case n > 0 && resp.GetLeaseId() == 0:
			return r.fail("wrong-result", "Lookup with a lease offered %d keys and no lease", n)
		case n == 0 && resp.GetLeaseId() != 0 && !r.o.Tol["lease-beyond-prefix"]:
			return r.fail("wrong-result", "Lookup with a lease offered nothing and lease %d", resp.GetLeaseId())
		case resp.GetLeaseId() != 0:
			l := &lease{id: resp.GetLeaseId(), set: set, group: op.Group, keys: map[KeyRef][]uint32{}, sent: sent, ms: op.LeaseMs, consumed: map[int]bool{}, corrupt: map[KeyRef]bool{}, step: r.step,
				client: op.Client, gen: r.conns[op.Client].gen}
			for s := range set {
				for i := 0; i < n; i++ {
					l.keys[ks[s][i]] = slices.Clone(r.m.key(ks[s][i]).present)
					l.corrupt[ks[s][i]] = r.m.key(ks[s][i]).corrupt
				}
			}
			r.leases = append(r.leases, l)
			r.leaseEnds = append(r.leaseEnds, time.Now().Add(time.Duration(op.LeaseMs)*time.Millisecond+time.Second))
			if len(r.leases) > 64 {
				r.leases = r.leases[1:]
			}
		}
	} else if resp.GetLeaseId() != 0 {
		return r.fail("wrong-result", "Lookup without a lease returned lease %d", resp.GetLeaseId())
	}
	return nil
}

// burst sends its operations at once, over their own connections (several
// may share one), and checks them against the model as it stood before:
// the daemon's handlers run concurrently, as an engine's worker, scheduler
// and other ranks make them.
func (r *runner) burst(op Op) error {
	var calls []call
	for i, sub := range op.Sub {
		r.rng = rand.New(rand.NewPCG(sub.Seed, uint64(r.step)<<8|uint64(i)))
		var c call
		var err error
		switch sub.Kind {
		case Store:
			var t *transferCall
			if t, err = r.prepareStore(sub); t != nil {
				c = t
			}
		case Load:
			var t *transferCall
			if t, err = r.prepareLoad(sub); t != nil {
				c = t
			}
		case Lookup:
			var l *lookupCall
			if l, err = r.prepareLookup(sub); l != nil {
				c = l
			}
		case Completions:
			var cc *completionsCall
			if cc, err = r.prepareCompletions(sub); cc != nil {
				c = cc
			}
		}
		if err != nil {
			return err
		}
		if c != nil {
			calls = append(calls, c)
		}
	}
	if len(calls) == 0 {
		return nil
	}
	return r.runCalls(calls)
}
