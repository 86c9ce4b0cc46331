package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/workload"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// HybridConfig is one run of a hybrid model (several KV cache groups of
// different kinds) through the daemon, under two treatments of the same
// trace in the same run: windowed (each group's kind respected: the rule of
// window.go) and all full attention (every group's blocks needed from 0).
type HybridConfig struct {
	Client      *client.Client
	Region      *model.HybridRegion
	Fingerprint []byte
	Steps       [][]workload.Request
	// StepTimeout bounds one step's RPCs.
	StepTimeout time.Duration
	// MaxRounds bounds the windowed lookup's rounds (0: 4).
	MaxRounds int
	// Probes is how many candidates below the next one each round after
	// the first also looks up (peeks), for a model whose windows all fit
	// in one unit (the Python connector's window_probes; 0: none).
	Probes int
	// Progress, if set, is called after every step.
	Progress func(done, total int)
	// OneStore sends a step's stores of every group in one Store, as a
	// connector's one call per step would; without it each group's go in
	// a Store of their own. The daemon sizes a slot size's room for each
	// group's blocks of a Store apart: groups that share a slot size in
	// one Store make its policy evict while the tier still has free
	// chunks (docs/benchmarks.md, hybrid scenario).
	OneStore bool
	// BetweenSteps, if set, runs after every step with the run's
	// namespace (a test drops blocks there, as an eviction would).
	BetweenSteps func(ctx context.Context, step int, ns uint32) error
}

// Treatment is what one treatment of the trace looked up, found and moved.
type Treatment struct {
	Name string
	// Lookups are the Lookup RPCs; KeysLookedUp their keys, of every
	// group; WindowKeys those of windowed groups.
	Lookups, KeysLookedUp, WindowKeys int
	// OutsideWindow counts windowed-group keys looked up that are not in
	// the window ending at the request's final hit (a miss has no window):
	// keys a lookup from block 0 would ask for, or a retried round's.
	OutsideWindow int
	// Retries counts windowed lookup rounds after a request's first.
	Retries int
	// Requests, Hits: requests looked up and those with a hit; Units,
	// HitUnits: blocks of every group (units) asked for and hit.
	Requests, Hits, Units, HitUnits int
	// Load is the treatment's Loads: Bytes as the daemon reports them.
	Load Op
	// Expected is the bytes the rule says the hits need; Bound is (full
	// layers' bytes + window bytes) per hit summed over hits: the goal's
	// ceiling.
	Expected, Bound uint64
	// Store is the treatment's Stores (the all-full treatment stores only
	// what the windowed one did not).
	Store        Op
	StoreSkipped int // windowed-group blocks no hit can use, not stored
	StoreFailed  map[string]int
	LoadFailed   map[string]int
	// CorruptDelivered counts blocks loaded OK whose bytes were wrong.
	CorruptDelivered int
	FirstCorrupt     string
	// FailedReoffered counts keys offered after their load failed, before
	// being stored again.
	FailedReoffered int
	FirstReoffer    string
}

// HitRate is the share of units asked for that hit.
func (t *Treatment) HitRate() float64 {
	if t.Units == 0 {
		return 0
	}
	return float64(t.HitUnits) / float64(t.Units)
}

// HybridResult is a hybrid run's two treatments.
type HybridResult struct {
	Steps             int
	Windowed, AllFull Treatment
}

// hybridTreatment is one treatment's view of the model: each group's
// blocks per unit and window (0: full attention).
type hybridTreatment struct {
	res  *Treatment
	bpu  []int
	w    []int
	peek bool
}

type hybridDriver struct {
	cfg     HybridConfig
	c       *client.Client
	reg     *model.HybridRegion
	id      uint64
	ns      uint32
	nextJob uint64
	tr      [2]*hybridTreatment
	// failed holds keys (group, hash) whose load failed, in either
	// treatment, and that were not stored since: no Lookup may offer them.
	failed map[string]bool
}

// RunHybrid drives the daemon through every step. Both treatments use one
// registration (one namespace): per step each looks up and loads the same
// cache state, the windowed treatment's lookups count for the admission
// policy and the all-full one's are peeks, and then the windowed
// treatment's stores go in, and the all-full one's of blocks they left out.
func RunHybrid(ctx context.Context, cfg HybridConfig) (*HybridResult, error) {
	if cfg.StepTimeout <= 0 {
		cfg.StepTimeout = time.Minute
	}
	if cfg.MaxRounds <= 0 {
		cfg.MaxRounds = 4
	}
	m := cfg.Region.Model
	rctx, cancel := context.WithTimeout(ctx, cfg.StepTimeout)
	r, err := cfg.Client.Register(rctx, cfg.Fingerprint, m.Layout(), cfg.Region.Wire(), "kvbench-hybrid")
	cancel()
	if err != nil {
		return nil, fmt.Errorf("register: %w", err)
	}
	res := &HybridResult{}
	d := &hybridDriver{cfg: cfg, c: cfg.Client, reg: cfg.Region, id: r.RegistrationId, ns: r.NamespaceId, failed: map[string]bool{}}
	for i, t := range []*Treatment{&res.Windowed, &res.AllFull} {
		t.Name = [...]string{"windowed", "all-full"}[i]
		t.LoadFailed, t.StoreFailed = map[string]int{}, map[string]int{}
		ht := &hybridTreatment{res: t, peek: i == 1}
		for _, g := range m.Groups {
			ht.bpu = append(ht.bpu, 1) // one block size: a unit is a block
			w := g.WindowBlocks()
			if i == 1 {
				w = 0
			}
			ht.w = append(ht.w, w)
		}
		d.tr[i] = ht
	}
	var runErr error
	for i, step := range cfg.Steps {
		if runErr = ctx.Err(); runErr != nil {
			break
		}
		sctx, cancel := context.WithTimeout(ctx, cfg.StepTimeout)
		runErr = d.step(sctx, step, i)
		cancel()
		if runErr != nil {
			runErr = fmt.Errorf("step %d: %w", i, runErr)
			break
		}
		res.Steps++
		if cfg.BetweenSteps != nil {
			if runErr = cfg.BetweenSteps(ctx, i, d.ns); runErr != nil {
				runErr = fmt.Errorf("after step %d: %w", i, runErr)
				break
			}
		}
		if cfg.Progress != nil {
			cfg.Progress(i+1, len(cfg.Steps))
		}
	}
	uctx, cancel := context.WithTimeout(context.Background(), cfg.StepTimeout)
	defer cancel()
	_, ierr := d.c.Invalidate(uctx, []uint32{d.ns}, nil)
	uerr := d.c.Unregister(uctx, d.id)
	return res, errors.Join(runErr, ierr, uerr)
}

// hreq is one request in one treatment.
type hreq struct {
	req  *workload.Request
	base int // engine block of the request's first block, in every group
	hit  int // units
	redo int // first unit the engine computes (0 after a failed load)
}

func (d *hybridDriver) step(ctx context.Context, reqs []workload.Request, n int) error {
	var per [2][]*hreq
	for t := range d.tr {
		base := 0
		for i := range reqs {
			per[t] = append(per[t], &hreq{req: &reqs[i], base: base})
			base += len(reqs[i].Keys)
		}
		for _, r := range per[t] {
			if err := d.lookup(ctx, d.tr[t], r); err != nil {
				return err
			}
		}
	}
	// Loads in alternating order, so neither treatment always finds the
	// caches the other left.
	order := []int{0, 1}
	if n%2 == 1 {
		order = []int{1, 0}
	}
	for _, t := range order {
		if err := d.load(ctx, d.tr[t], per[t]); err != nil {
			return err
		}
	}
	stored := map[string]bool{}
	for _, t := range []int{0, 1} {
		if err := d.store(ctx, d.tr[t], per[t], stored); err != nil {
			return err
		}
	}
	return nil
}

func hkey(g int, hash []byte) string { return string(rune('A'+g)) + string(hash) }

// lookup finds r's hit under treatment t: the full-attention groups' ready
// prefix, then the windows (resolveHit).
func (d *hybridDriver) lookup(ctx context.Context, t *hybridTreatment, r *hreq) error {
	res := t.res
	maxUnits := len(r.req.Keys)
	// sent[g] holds the block index of every key of windowed group g
	// this request's Lookups asked for, read back from the hashes sent.
	at := make(map[string]int, maxUnits)
	for i, k := range r.req.Keys {
		at[string(k)] = i
	}
	sent := make([][]int, len(t.w))
	ask := func(g int, hashes [][]byte, probe bool) (int, error) {
		if t.w[g] != 0 {
			for _, h := range hashes {
				sent[g] = append(sent[g], at[string(h)])
			}
		}
		keys, err := client.Keys(uint32(g), model.HashBytes, hashes...)
		if err != nil {
			return 0, err
		}
		lr, err := d.c.API.Lookup(ctx, &pb.LookupRequest{NamespaceIds: []uint32{d.ns}, Keys: keys, Peek: t.peek || probe})
		if err != nil {
			return 0, fmt.Errorf("lookup %s group %d: %w", r.req.ID, g, err)
		}
		ready := int(lr.GetReady())
		if ready > len(hashes) {
			return 0, fmt.Errorf("lookup %s group %d: ready %d of %d keys", r.req.ID, g, ready, len(hashes))
		}
		res.Lookups++
		res.KeysLookedUp += len(hashes)
		for _, h := range hashes[:ready] {
			if d.failed[hkey(g, h)] {
				res.FailedReoffered++
				if res.FirstReoffer == "" {
					res.FirstReoffer = fmt.Sprintf("group %d key %x of %s: its load failed, offered again before a store", g, h[:8], r.req.ID)
				}
			}
		}
		return ready, nil
	}
	// A model with no full-attention group starts from the maximum.
	f, windowed := maxUnits, 0
	for g, w := range t.w {
		if w != 0 {
			windowed++
			continue
		}
		ready, err := ask(g, r.req.Keys[:maxUnits*t.bpu[g]], false)
		if err != nil {
			return err
		}
		f = min(f, ready/t.bpu[g])
	}
	hit, _, rounds, err := resolveHit(f, t.bpu, t.w, d.cfg.MaxRounds, d.cfg.Probes, func(g, start, end int, probe bool) (int, error) {
		rev := slices.Clone(r.req.Keys[start:end])
		slices.Reverse(rev)
		return ask(g, rev, probe)
	})
	if err != nil {
		return err
	}
	if windowed > 0 && f > 0 {
		res.Retries += rounds - 1
	}
	for g, idx := range sent {
		res.WindowKeys += len(idx)
		lo, hi := windowStart(hit, t.bpu[g], t.w[g]), hit*t.bpu[g]
		for _, i := range idx {
			if hit == 0 || i < lo || i >= hi {
				res.OutsideWindow++
			}
		}
	}
	r.hit, r.redo = hit, hit
	res.Requests++
	res.Units += maxUnits
	res.HitUnits += hit
	if hit > 0 {
		res.Hits++
	}
	return nil
}

// load moves every hit's blocks (the rule's: full-attention groups from 0,
// windowed ones their window) in one Load with a job per request and
// group, checks every block byte for byte, and fails a request with any
// failed block (it is computed again in full).
func (d *hybridDriver) load(ctx context.Context, t *hybridTreatment, reqs []*hreq) error {
	res := t.res
	m := d.reg.Model
	type ref struct {
		r   *hreq
		g   int
		idx []int
	}
	var jobs []*pb.Job
	refs := map[uint64]ref{}
	for _, r := range reqs {
		if r.hit == 0 {
			continue
		}
		bound := uint64(r.hit) * uint64(m.FullBytes())
		for g, gr := range m.Groups {
			start, end := windowStart(r.hit, t.bpu[g], t.w[g]), r.hit*t.bpu[g]
			if w := gr.WindowBlocks(); gr.Kind != model.FullAttention {
				bound += uint64(min(w, end)) * uint64(gr.BlockBytes())
			}
			var ids []uint32
			var idx []int
			var hashes [][]byte
			for i := start; i < end; i++ {
				d.reg.Poison(g, r.base+i)
				ids = append(ids, uint32(r.base+i))
				idx = append(idx, i)
				hashes = append(hashes, r.req.Keys[i])
			}
			res.Expected += uint64(len(ids)) * uint64(gr.BlockBytes())
			keys, _ := client.Keys(uint32(g), model.HashBytes, hashes...)
			d.nextJob++
			jobs = append(jobs, &pb.Job{JobId: d.nextJob, RequestId: r.req.ID, Keys: keys, BlockIds: ids})
			refs[d.nextJob] = ref{r, g, idx}
		}
		res.Bound += bound
	}
	if len(jobs) == 0 {
		return nil
	}
	results, err := d.transfer(ctx, &res.Load, jobs, func(req *pb.TransferRequest) (*pb.TransferResponse, error) { return d.c.API.Load(ctx, req) })
	if err != nil {
		return fmt.Errorf("load: %w", err)
	}
	for _, jr := range results {
		rf := refs[jr.GetJobId()]
		failed := map[int]bool{}
		for _, f := range jr.GetFailures() {
			i := int(f.GetIndex())
			if i >= len(rf.idx) || f.GetBlockId() != uint32(rf.r.base+rf.idx[i]) {
				return fmt.Errorf("load job %d: failure %v does not name a block of the job", jr.GetJobId(), f)
			}
			failed[i] = true
			res.LoadFailed[statusName(f.GetStatus())]++
			if mustDrop(f.GetStatus()) {
				d.failed[hkey(rf.g, rf.r.req.Keys[rf.idx[i]])] = true
			}
			rf.r.redo = 0
		}
		for i, bi := range rf.idx {
			if failed[i] {
				continue
			}
			if err := d.reg.Check(rf.g, rf.r.base+bi, rf.r.req.Keys[bi]); err != nil {
				res.CorruptDelivered++
				if res.FirstCorrupt == "" {
					res.FirstCorrupt = fmt.Sprintf("%s treatment, request %s block %d: %v", t.res.Name, rf.r.req.ID, bi, err)
				}
			}
		}
	}
	return nil
}

// store saves what the engine computed under t: every block from the
// request's first computed unit, less windowed-group blocks no hit's
// window can contain, less blocks already stored this step (stored, keyed
// by group and hash); one Store per group unless Config.OneStore.
func (d *hybridDriver) store(ctx context.Context, t *hybridTreatment, reqs []*hreq, stored map[string]bool) error {
	res := t.res
	byGroup := make([][]*pb.Job, len(d.reg.Model.Groups))
	for _, r := range reqs {
		for g := range d.reg.Model.Groups {
			var ids []uint32
			var hashes [][]byte
			for i := r.redo * t.bpu[g]; i < len(r.req.Keys); i++ {
				k := hkey(g, r.req.Keys[i])
				if !storeNeeded(i, t.bpu[g], t.w[g]) {
					res.StoreSkipped++
					continue
				}
				if stored[k] {
					continue
				}
				stored[k] = true
				d.reg.Fill(g, r.base+i, r.req.Keys[i])
				ids = append(ids, uint32(r.base+i))
				hashes = append(hashes, r.req.Keys[i])
				delete(d.failed, k)
			}
			if len(ids) == 0 {
				continue
			}
			keys, _ := client.Keys(uint32(g), model.HashBytes, hashes...)
			d.nextJob++
			byGroup[g] = append(byGroup[g], &pb.Job{JobId: d.nextJob, RequestId: r.req.ID, Keys: keys, BlockIds: ids})
		}
	}
	calls := byGroup
	if d.cfg.OneStore {
		calls = [][]*pb.Job{slices.Concat(byGroup...)}
	}
	for _, jobs := range calls {
		if len(jobs) == 0 {
			continue
		}
		results, err := d.transfer(ctx, &res.Store, jobs, func(req *pb.TransferRequest) (*pb.TransferResponse, error) { return d.c.API.Store(ctx, req) })
		if err != nil {
			return fmt.Errorf("store: %w", err)
		}
		for _, jr := range results {
			for _, f := range jr.GetFailures() {
				res.StoreFailed[statusName(f.GetStatus())]++
			}
		}
	}
	return nil
}

// transfer sends one Load or Store that waits for its jobs, reads
// Completions for any the reply did not carry, and times the whole.
func (d *hybridDriver) transfer(ctx context.Context, op *Op, jobs []*pb.Job, send func(*pb.TransferRequest) (*pb.TransferResponse, error)) ([]*pb.JobResult, error) {
	want, blocks := inFlight(jobs)
	t0 := time.Now()
	resp, err := send(&pb.TransferRequest{RegistrationId: d.id, Jobs: jobs, Wait: true})
	if err != nil {
		return nil, err
	}
	var out []*pb.JobResult
	err = awaitResults(ctx, d.c, d.id, op, want, resp.GetResults(), t0, func(jr *pb.JobResult, _ time.Duration) {
		op.Bytes += jr.GetBytes()
		out = append(out, jr)
	})
	if err != nil {
		return nil, err
	}
	el := time.Since(t0)
	op.Busy += el
	op.Latencies = append(op.Latencies, el)
	op.Calls++
	op.Blocks += blocks
	return out, nil
}
