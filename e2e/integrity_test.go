package e2e

// Tests of issue 9's data-path items, each through the daemon over its
// socket: wrapped pin counts and leases, lost results, loads racing into one
// engine block, block sizes and namespaces that never went, unbounded
// fields, a slot size frozen by a pinned eviction, disk demotions that
// forgot their entry, invalidated blocks back after a restart, and
// evictions at shutdown.

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/offload"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

func codeOf(err error) codes.Code {
	st, _ := status.FromError(err)
	return st.Code()
}

func wantCode(t testing.TB, err error, want codes.Code, naming string) {
	t.Helper()
	st, _ := status.FromError(err)
	if st.Code() != want || !strings.Contains(st.Message(), naming) {
		t.Fatalf("got %v, want %v naming %q", err, want, naming)
	}
}

// leaseLookup takes a lease on hs in the engine's namespace.
func (e *engine) leaseLookup(t testing.TB, c *client.Client, hs [][]byte) (*pb.LookupResponse, error) {
	t.Helper()
	return c.Lookup(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(hs...), 10_000)
}

// TestLeasesAreBounded: leases and the blocks they pin are bounded per
// connection; past a bound a Lookup with a lease is RESOURCE_EXHAUSTED and
// pins nothing. Another connection has bounds of its own, and a connection
// that closes takes its leases with it.
func TestLeasesAreBounded(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Limits: offload.Limits{MaxLeasesPerOwner: 4, MaxLeasePinsPerOwner: 10}})
	e := register(t, d, small, "m")
	hs := e.hashes(1, 8)
	e.store(t, 1, hs, seq(0, 8))
	for i := 0; i < 4; i++ {
		if lr, err := e.leaseLookup(t, e.c, hs[:2]); err != nil || lr.LeaseId == 0 {
			t.Fatalf("lease %d: %v %v", i, lr, err)
		}
	}
	_, err := e.leaseLookup(t, e.c, hs[:2])
	wantCode(t, err, codes.ResourceExhausted, "leases")
	if n := d.Svc.CPU().Pinned(); n != 2 {
		t.Fatalf("%d slots pinned, want the 2 the 4 leases share", n)
	}
	// A scheduler's connection of its own: 8 blocks fit in 10 pins, 16 do not.
	sched := d.Client(t)
	if lr, err := e.leaseLookup(t, sched, hs); err != nil || lr.Ready != 8 {
		t.Fatalf("scheduler lease: %v %v", lr, err)
	}
	_, err = e.leaseLookup(t, sched, hs)
	wantCode(t, err, codes.ResourceExhausted, "pin")
	if n := d.Svc.CPU().Pinned(); n != 8 {
		t.Fatalf("%d slots pinned after a refused lease", n)
	}
	// Without a lease a Lookup is never refused.
	if lr := e.lookup(t, hs); lr.Ready != 8 {
		t.Fatalf("plain lookup: %d ready", lr.Ready)
	}
	sched.Close()
	e.c.Close()
	waitFor(t, "the closed connections' leases to go", func() bool { return d.Svc.CPU().Pinned() == 0 })
	waitFor(t, "the registration to go", func() bool { _, err := d.Svc.Registration(e.reg.RegistrationId); return err != nil })
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestReleaseLeasesEndsOnlyTheCallersLeases: ReleaseLeases ends the named
// leases of the calling connection (their pins go, the connection's bound
// has room again); another connection naming them, or ids that are not
// leases, changes nothing; too many ids is INVALID_ARGUMENT.
func TestReleaseLeasesEndsOnlyTheCallersLeases(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Limits: offload.Limits{MaxLeasesPerOwner: 2, MaxLeasePinsPerOwner: 100}})
	e := register(t, d, small, "m")
	hs := e.hashes(1, 8)
	e.store(t, 1, hs, seq(0, 8))
	var ids []uint64
	for i := 0; i < 2; i++ {
		lr, err := e.leaseLookup(t, e.c, hs[2*i:2*i+2])
		if err != nil || lr.LeaseId == 0 {
			t.Fatalf("lease %d: %v %v", i, lr, err)
		}
		ids = append(ids, lr.LeaseId)
	}
	_, err := e.leaseLookup(t, e.c, hs[4:6])
	wantCode(t, err, codes.ResourceExhausted, "leases")
	other := d.Client(t)
	if r, err := other.API.ReleaseLeases(ctx(t), &pb.ReleaseLeasesRequest{LeaseIds: ids}); err != nil || r.Released != 0 {
		t.Fatalf("another connection released %v (%v)", r, err)
	}
	if n := d.Svc.CPU().Pinned(); n != 4 {
		t.Fatalf("%d slots pinned after another connection's release, want 4", n)
	}
	r, err := e.c.API.ReleaseLeases(ctx(t), &pb.ReleaseLeasesRequest{LeaseIds: []uint64{ids[0], ids[0], 999_999}})
	if err != nil || r.Released != 1 {
		t.Fatalf("release: %v %v", r, err)
	}
	if n := d.Svc.CPU().Pinned(); n != 2 {
		t.Fatalf("%d slots pinned after the release, want the other lease's 2", n)
	}
	if lr, err := e.leaseLookup(t, e.c, hs[4:6]); err != nil || lr.LeaseId == 0 {
		t.Fatalf("a lease after the release: %v %v", lr, err)
	}
	_, err = e.c.API.ReleaseLeases(ctx(t), &pb.ReleaseLeasesRequest{LeaseIds: make([]uint64, offload.MaxReleaseIDs+1)})
	wantCode(t, err, codes.InvalidArgument, "lease ids")
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestManyLeasesNeverServeAnotherBlock: 65,536 leases on one block used to
// wrap its slot's pin count to 0; the slot went to another block, and a Load
// naming one of the leases copied that block's bytes and reported OK.
func TestManyLeasesNeverServeAnotherBlock(t *testing.T) {
	if raceEnabled {
		t.Skip("65,536 lookups take minutes under the race detector: make test-policy runs this without it")
	}
	const leases = 1 << 16
	lim := offload.Limits{MaxLeasesPerOwner: 2 * leases, MaxLeases: 2 * leases, MaxLeasePinsPerOwner: 2 * leases, MaxLeasePins: 2 * leases}
	// Two chunks of 16 slots: a fills the second alone.
	d := testenv.Start(t, testenv.Options{CPUBytes: 8 << 20, ChunkBytes: 4 << 20, Limits: lim, Quiet: true})
	e := register(t, d, small, "m")
	e.store(t, 1, e.hashes(3, 16), seq(0, 16))
	a := e.hashes(1, 1)
	e.store(t, 2, a, seq(16, 1))
	ids := make([]uint64, leases)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for w := 0; w < 16; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; i < leases; i += 16 {
				lr, err := e.c.Lookup(context.Background(), []uint32{e.reg.NamespaceId}, testenv.Keys(a...), 30_000)
				if err != nil || lr.LeaseId == 0 {
					errs <- fmt.Errorf("lease %d: %v %v", i, lr, err)
					return
				}
				ids[i] = lr.LeaseId
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// Another block size takes a's chunk: a leaves the index, its slot
	// stays pinned by the leases (and the chunk with it).
	other := register(t, d, testenv.Model{Layers: 2, SegBytes: 64 << 10, Blocks: 8}, "other")
	other.store(t, 3, other.hashes(9, 4), seq(0, 4))
	if e.lookup(t, a).Ready != 0 {
		t.Fatal("the chunk move did not evict the leased block")
	}
	if n := d.Svc.CPU().Pinned(); n != 1 {
		t.Fatalf("%d slots pinned, want the leased one", n)
	}
	e.store(t, 4, e.hashes(2, 4), seq(20, 4))
	job := testenv.Job(5, a, seq(40, 1))
	job.LeaseId = ids[leases/2]
	out, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{job}, true)
	if err != nil {
		t.Fatal(err)
	}
	if !out[0].Ok {
		t.Fatalf("load through a lease: %+v", out[0])
	}
	e.verify(t, out[0], a, seq(40, 1))
}

// TestLeaseOfAnotherConnection: a lease id is not a capability. A Load
// from another connection naming it loads without it and leaves it to its
// owner.
func TestLeaseOfAnotherConnection(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	owner := register(t, d, small, "m")
	other := register(t, d, small, "m") // the same namespace, another connection
	hs := owner.hashes(1, 4)
	owner.store(t, 1, hs, seq(0, 4))
	lr, err := owner.leaseLookup(t, owner.c, hs)
	if err != nil || lr.LeaseId == 0 {
		t.Fatal(lr, err)
	}
	job := testenv.Job(2, hs, seq(10, 4))
	job.LeaseId = lr.LeaseId
	out, err := other.c.Load(ctx(t), other.reg.RegistrationId, []*pb.Job{job}, true)
	if err != nil || !out[0].Ok {
		t.Fatalf("load naming another's lease: %+v %v", out, err)
	}
	other.verify(t, out[0], hs, seq(10, 4))
	if n := d.Svc.CPU().Pinned(); n != 4 {
		t.Fatalf("%d slots pinned: the other connection's load used up the lease", n)
	}
	// The owner's lease still holds its blocks.
	job = testenv.Job(3, hs, seq(20, 4))
	job.LeaseId = lr.LeaseId
	out, err = owner.c.Load(ctx(t), owner.reg.RegistrationId, []*pb.Job{job}, true)
	if err != nil || !out[0].Ok {
		t.Fatalf("the owner's load through its lease: %+v %v", out, err)
	}
	owner.verify(t, out[0], hs, seq(20, 4))
	if n := d.Svc.CPU().Pinned(); n != 0 {
		t.Fatalf("%d slots pinned after the lease was used", n)
	}
}

// TestLeaseOverRanks: a lease over two namespaces (two tensor-parallel
// ranks) used to be used up whole by the first rank's Load; each rank now
// takes its own namespace's pins.
func TestLeaseOverRanks(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	c := d.Client(t)
	ranks := make([]*engine, 2)
	for i := range ranks {
		r := testenv.NewRegion(t, small.RegionBytes())
		reg, err := c.Register(ctx(t), []byte(fmt.Sprintf("rank%d", i)), small.Layout(), small.Regions(r), t.Name())
		if err != nil {
			t.Fatal(err)
		}
		ranks[i] = &engine{d: d, m: small, r: r, c: c, reg: reg}
	}
	hs := ranks[0].hashes(1, 4)
	for i, e := range ranks {
		e.store(t, uint64(1+i), hs, seq(0, 4))
	}
	lr, err := c.Lookup(ctx(t), []uint32{ranks[0].reg.NamespaceId, ranks[1].reg.NamespaceId}, testenv.Keys(hs...), 10_000)
	if err != nil || lr.Ready != 4 || lr.LeaseId == 0 {
		t.Fatal(lr, err)
	}
	if n := d.Svc.CPU().Pinned(); n != 8 {
		t.Fatalf("the lease pins %d slots, want 4 per rank", n)
	}
	load := func(e *engine, id uint64) *pb.JobResult {
		job := testenv.Job(id, hs, seq(30, 4))
		job.LeaseId = lr.LeaseId
		out, err := c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{job}, true)
		if err != nil {
			t.Fatal(err)
		}
		return out[0]
	}
	if res := load(ranks[0], 10); !res.Ok {
		t.Fatalf("rank 0: %+v", res)
	}
	if n := d.Svc.CPU().Pinned(); n != 4 {
		t.Fatalf("after rank 0's load %d slots pinned, want rank 1's 4", n)
	}
	res := load(ranks[1], 11)
	if !res.Ok {
		t.Fatalf("rank 1 lost its lease to rank 0: %+v", res)
	}
	ranks[1].verify(t, res, hs, seq(30, 4))
	if n := d.Svc.CPU().Pinned(); n != 0 {
		t.Fatalf("%d slots pinned after both ranks loaded", n)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// wide is a registration of 65,536 engine blocks of one 4 KiB segment: the
// largest request a client may send.
var wide = testenv.Model{Layers: 1, SegBytes: 4096, Blocks: 1 << 16}

// TestCompletionsReplyIsBounded: results used to leave the queue before the
// reply was encoded, and a reply over the message limit (six loads of
// 65,536 missing blocks, each failure with its hash) failed: those jobs were
// never reported. Replies are cut to a bound and the rest waits.
func TestCompletionsReplyIsBounded(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true})
	e := register(t, d, wide, "wide")
	const jobs = 6
	for j := 0; j < jobs; j++ {
		hs := e.hashes(uint64(100+j), wide.Blocks)
		if _, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{testenv.Job(uint64(j), hs, seq(0, wide.Blocks))}, false); err != nil {
			t.Fatal(err)
		}
	}
	limit := d.Svc.Limits().MaxReplyBytes()
	got := map[uint64]bool{}
	calls := 0
	for len(got) < jobs {
		r, err := e.c.Completions(ctx(t), e.reg.RegistrationId, 1000)
		if err != nil {
			t.Fatalf("completions after %d of %d results: %v", len(got), jobs, err)
		}
		calls++
		if n := proto.Size(r); n > limit {
			t.Fatalf("a reply of %d bytes, the bound is %d", n, limit)
		}
		for _, jr := range r.Results {
			if got[jr.JobId] || len(jr.Failures) != wide.Blocks {
				t.Fatalf("job %d again or with %d failures", jr.JobId, len(jr.Failures))
			}
			got[jr.JobId] = true
		}
		if len(got) < jobs && len(r.Results) > 0 && !r.More {
			t.Fatal("results wait and the reply does not say so")
		}
	}
	if calls < 2 {
		t.Fatalf("%d results of 3 MB each came in %d reply", jobs, calls)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestTransferWaitReplyFits: the largest request (4,096 jobs, 65,536
// blocks, the longest request ids) failing every block still fits in the
// reply of a Load with wait.
func TestTransferWaitReplyFits(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true})
	e := register(t, d, wide, "wide")
	lim := d.Svc.Limits()
	per := lim.MaxBlocksPerRequest / lim.MaxJobsPerRequest
	jobs := make([]*pb.Job, lim.MaxJobsPerRequest)
	for j := range jobs {
		hs := e.hashes(uint64(1000+j), per)
		jobs[j] = testenv.Job(uint64(j), hs, seq(j*per, per))
		jobs[j].RequestId = strings.Repeat("r", lim.MaxRequestID)
	}
	r, err := e.c.API.Load(ctx(t), &pb.TransferRequest{RegistrationId: e.reg.RegistrationId, Jobs: jobs, Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Results) != len(jobs) || proto.Size(r) > lim.MaxReplyBytes() {
		t.Fatalf("%d results in %d bytes, bound %d", len(r.Results), proto.Size(r), lim.MaxReplyBytes())
	}
}

// TestCompletionsCursor: with ack_seq results stay queued until
// acknowledged, so a reply lost with its connection comes again; without
// it each result is returned once.
func TestCompletionsCursor(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	e := register(t, d, small, "m")
	var ids []uint64
	for j := 0; j < 3; j++ {
		hs := e.hashes(uint64(10+j), 2)
		for i, h := range hs {
			e.m.Fill(e.r, j*2+i, h)
		}
		if _, err := e.c.Store(ctx(t), e.reg.RegistrationId, []*pb.Job{testenv.Job(uint64(100+j), hs, seq(j*2, 2))}, false); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, uint64(100+j))
	}
	read := func(ack *uint64) *pb.CompletionsResponse {
		t.Helper()
		r, err := e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, WaitMs: 5000, AckSeq: ack})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	seqs := func(r *pb.CompletionsResponse) []uint64 {
		var out []uint64
		for _, jr := range r.Results {
			out = append(out, jr.Seq)
		}
		return out
	}
	zero := uint64(0)
	var first *pb.CompletionsResponse
	waitFor(t, "three results", func() bool { first = read(&zero); return len(first.Results) == 3 })
	if s := seqs(first); s[0] != 1 || s[1] != 2 || s[2] != 3 {
		t.Fatalf("seqs %v", s)
	}
	// The reply was lost: asking again with the same cursor sends it again.
	if again := read(&zero); len(again.Results) != 3 || again.Results[0].JobId != first.Results[0].JobId {
		t.Fatalf("resent: %v", seqs(again))
	}
	two := uint64(2)
	if r := read(&two); len(r.Results) != 1 || r.Results[0].Seq != 3 {
		t.Fatalf("after ack 2: %v", seqs(r))
	}
	three := uint64(3)
	r, err := e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &three})
	if err != nil || len(r.Results) != 0 {
		t.Fatalf("after ack 3: %v %v", r, err)
	}
	// Without a cursor: read once.
	hs := e.hashes(20, 1)
	e.m.Fill(e.r, 10, hs[0])
	if _, err := e.c.Store(ctx(t), e.reg.RegistrationId, []*pb.Job{testenv.Job(200, hs, seq(10, 1))}, false); err != nil {
		t.Fatal(err)
	}
	r = read(nil)
	if len(r.Results) != 1 || r.Results[0].JobId != 200 || r.Results[0].Seq != 4 {
		t.Fatalf("legacy read: %+v", r)
	}
	if r, err := e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId}); err != nil || len(r.Results) != 0 {
		t.Fatalf("legacy second read: %+v %v", r, err)
	}
	// The Go client acknowledges for its caller.
	hs = e.hashes(21, 1)
	e.m.Fill(e.r, 11, hs[0])
	if _, err := e.c.Store(ctx(t), e.reg.RegistrationId, []*pb.Job{testenv.Job(201, hs, seq(11, 1))}, false); err != nil {
		t.Fatal(err)
	}
	if got, err := e.c.WaitJobs(ctx(t), e.reg.RegistrationId, 201); err != nil || !got[201].Ok {
		t.Fatalf("WaitJobs: %v %v", got, err)
	}
	if r, err := e.c.Completions(ctx(t), e.reg.RegistrationId, 0); err != nil || len(r.Results) != 0 {
		t.Fatalf("after WaitJobs: %+v %v", r, err)
	}
}

// TestTwoJobsLoadIntoOneBlock: two jobs of one Load copying into the same
// engine block used to both report OK while their copies raced.
func TestTwoJobsLoadIntoOneBlock(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	e := register(t, d, small, "m")
	hs := e.hashes(1, 4)
	e.store(t, 1, hs, seq(0, 4))
	_, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{
		testenv.Job(2, hs[:2], []uint32{20, 21}),
		testenv.Job(3, hs[2:], []uint32{22, 21}),
	}, true)
	wantCode(t, err, codes.InvalidArgument, "both load into block_id 21")
	// Stores may name one engine block twice (both read it).
	if _, err := e.c.Store(ctx(t), e.reg.RegistrationId, []*pb.Job{
		testenv.Job(4, e.hashes(2, 1), []uint32{5}),
		testenv.Job(5, e.hashes(3, 1), []uint32{5}),
	}, true); err != nil {
		t.Fatal(err)
	}
}

// TestBlockSizesComeAndGo: namespaces of distinct block sizes used to leave
// their slot size classes, each with a policy and two goroutines, for good.
// They now go with their last namespace, and there are at most as many
// sizes as chunks.
func TestBlockSizesComeAndGo(t *testing.T) {
	d := testenv.Start(t, testenv.Options{CPUBytes: 64 << 20, ChunkBytes: 4 << 20, NamespaceLinger: -1, Quiet: true})
	c := d.Client(t)
	model := func(i int) testenv.Model { return testenv.Model{Layers: 1, SegBytes: (i + 1) << 12, Blocks: 2} }
	if _, err := c.Stats(ctx(t)); err != nil { // connected: its goroutines run
		t.Fatal(err)
	}
	base := runtime.NumGoroutine()
	for round := 0; round < 3; round++ {
		var regs []*pb.RegisterResponse
		for i := 0; i < 16; i++ {
			m := model(i)
			reg, err := c.Register(ctx(t), []byte(fmt.Sprintf("size-%d-%d", round, i)), m.Layout(), m.Regions(testenv.NewRegion(t, m.RegionBytes())), "")
			if err != nil {
				t.Fatalf("round %d, size %d: %v", round, i, err)
			}
			regs = append(regs, reg)
		}
		// A 17th size with the other 16 in use: no chunk could serve it.
		m := model(16)
		_, err := c.Register(ctx(t), []byte("one too many"), m.Layout(), m.Regions(testenv.NewRegion(t, m.RegionBytes())), "")
		wantCode(t, err, codes.ResourceExhausted, "block sizes")
		for _, reg := range regs {
			if err := c.Unregister(ctx(t), reg.RegistrationId); err != nil {
				t.Fatal(err)
			}
		}
		waitFor(t, "the empty namespaces and their sizes to go", func() bool {
			st, err := c.Stats(ctx(t))
			return err == nil && len(st.Namespaces) == 0
		})
	}
	waitFor(t, "the sizes' goroutines to stop", func() bool { return runtime.NumGoroutine() <= base })
	if n := d.Svc.CPU().Classes(); n != 0 {
		t.Fatalf("%d block sizes left", n)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestNamespacesAreBounded: past the bound a new namespace is
// RESOURCE_EXHAUSTED; an empty one makes room at once.
func TestNamespacesAreBounded(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Limits: offload.Limits{MaxNamespacesTotal: 2}, Quiet: true})
	a := register(t, d, small, "a")
	b := register(t, d, small, "b")
	hs := a.hashes(1, 2)
	a.store(t, 1, hs, seq(0, 2))
	c := d.Client(t)
	_, err := c.Register(ctx(t), []byte("c"), small.Layout(), small.Regions(testenv.NewRegion(t, small.RegionBytes())), "")
	wantCode(t, err, codes.ResourceExhausted, "namespaces")
	// a keeps its blocks without a registration; b, empty, makes room.
	if err := a.c.Unregister(ctx(t), a.reg.RegistrationId); err != nil {
		t.Fatal(err)
	}
	if err := b.c.Unregister(ctx(t), b.reg.RegistrationId); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Register(ctx(t), []byte("c"), small.Layout(), small.Regions(testenv.NewRegion(t, small.RegionBytes())), ""); err != nil {
		t.Fatal(err)
	}
	a2 := register(t, d, small, "a")
	if !a2.reg.JoinedExisting || a2.lookup(t, hs).Ready != 2 {
		t.Fatalf("the namespace holding blocks went: %+v", a2.reg)
	}
}

// TestRecoveredNamespaceStays: a namespace brought back from the disk with
// blocks and no registration stays while it has blocks, and goes once it
// has none.
func TestRecoveredNamespaceStays(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	o.WriteThrough = true
	o.NamespaceLinger = -1
	d := testenv.Start(t, o)
	e := register(t, d, small, "kept")
	stored := storeMany(t, e, 2, 8)
	flush(t, d)
	d.Stop(t)

	d2 := testenv.Start(t, o)
	c := d2.Client(t)
	ids, err := c.Resolve(ctx(t), []byte("kept"))
	if err != nil || ids[0] == 0 {
		t.Fatalf("recovered namespace: %v %v", ids, err)
	}
	// Sweeps come and go; the namespace keeps its blocks.
	st := func() *pb.StatsResponse {
		s, err := c.Stats(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	if s := st(); len(s.Namespaces) != 1 || int(s.Namespaces[0].Blocks) != len(stored) {
		t.Fatalf("stats: %+v", s.Namespaces)
	}
	if _, err := c.Invalidate(ctx(t), ids, nil); err != nil {
		t.Fatal(err)
	}
	flush(t, d2)
	waitFor(t, "the emptied namespace to go", func() bool { return len(st().Namespaces) == 0 })
	if ids, err := c.Resolve(ctx(t), []byte("kept")); err != nil || ids[0] != 0 {
		t.Fatalf("after it went: %v %v", ids, err)
	}
}

// TestFieldsAreBounded: strings and bytes from the wire have bounds
// (48 unread jobs with 10 MiB request ids used to hold 514 MB), and so do
// the bytes of a registration's unread results.
func TestFieldsAreBounded(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	e := register(t, d, small, "m")
	lim := d.Svc.Limits()
	hs := e.hashes(1, 1)
	job := testenv.Job(1, hs, seq(0, 1))
	// A request this large is refused from its header, before its body is
	// read (the request limit, computed from the field bounds).
	job.RequestId = strings.Repeat("x", 10<<20)
	_, err := e.c.Store(ctx(t), e.reg.RegistrationId, []*pb.Job{job}, false)
	wantCode(t, err, codes.ResourceExhausted, "larger than max")
	job.RequestId = strings.Repeat("x", lim.MaxRequestID+1)
	_, err = e.c.Store(ctx(t), e.reg.RegistrationId, []*pb.Job{job}, false)
	wantCode(t, err, codes.InvalidArgument, "request_id")
	_, err = e.c.API.Store(ctx(t), &pb.TransferRequest{RegistrationId: e.reg.RegistrationId, Jobs: []*pb.Job{testenv.Job(1, hs, seq(0, 1))}, ReadyEvent: make([]byte, lim.MaxReadyEvent+1)})
	wantCode(t, err, codes.InvalidArgument, "ready_event")
	_, err = e.c.Register(ctx(t), []byte("n"), small.Layout(), small.Regions(e.r), strings.Repeat("n", lim.MaxClientName+1))
	wantCode(t, err, codes.InvalidArgument, "client_name")
	_, err = e.c.Resolve(ctx(t), make([]byte, lim.MaxFingerprint+1))
	wantCode(t, err, codes.InvalidArgument, "fingerprints[0]")
	regions := small.Regions(e.r)
	regions[1].Memory = &pb.Region_ShmPath{ShmPath: "/dev/shm/" + strings.Repeat("p", lim.MaxRegionName)}
	_, err = e.c.Register(ctx(t), []byte("n"), small.Layout(), regions, "")
	wantCode(t, err, codes.InvalidArgument, "regions[1]")
}

// TestUnreadResultsAreBoundedByBytes: a registration's unread results and
// the most its unfinished jobs' results can take are bounded by bytes.
func TestUnreadResultsAreBoundedByBytes(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Limits: offload.Limits{MaxUnreadBytes: 64 << 10}})
	e := register(t, d, small, "m")
	rid := strings.Repeat("r", 500)
	n := 0
	for ; n < 1000; n++ {
		job := testenv.Job(uint64(n), e.hashes(uint64(n), 1), seq(0, 1))
		job.RequestId = rid
		_, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{job}, false)
		if codeOf(err) == codes.ResourceExhausted {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if n == 0 || n >= 1000 || n*(500+64+50) > 64<<10 {
		t.Fatalf("refused after %d jobs of ~614 bytes of result each, bound 64 KiB", n)
	}
	// Reading makes room again.
	ids := make([]uint64, n)
	for i := range ids {
		ids[i] = uint64(i)
	}
	if _, err := e.c.WaitJobs(ctx(t), e.reg.RegistrationId, ids...); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.Completions(ctx(t), e.reg.RegistrationId, 0); err != nil { // acknowledges
		t.Fatal(err)
	}
	if _, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{testenv.Job(5000, e.hashes(5000, 1), seq(0, 1))}, true); err != nil {
		t.Fatalf("after reading: %v", err)
	}
}

// TestPinnedEvictionKeepsStoring: the policy evicting a leased block used
// to count its still-pinned slot as free room; with every slot taken it
// then admitted without evicting and every store got NO_SPACE until the
// lease ended.
func TestPinnedEvictionKeepsStoring(t *testing.T) {
	// 4 MiB arena of 256 KiB blocks: 16 slots, half of them leased.
	d := testenv.Start(t, testenv.Options{CPUBytes: 4 << 20, ChunkBytes: 4 << 20, Quiet: true})
	e := register(t, d, small, "m")
	hs := e.hashes(1, 16)
	e.store(t, 1, hs, seq(0, 16))
	if lr, err := e.leaseLookup(t, e.c, hs[:8]); err != nil || lr.Ready != 8 {
		t.Fatal(lr, err)
	}
	noSpace := 0
	for step := 0; step < 50; step++ {
		more := e.hashes(uint64(100+step), 2)
		for round := 0; round < 4; round++ {
			e.lookup(t, more) // hot enough to be admitted
		}
		res := e.store(t, uint64(10+step), more, seq(20, 2))
		for _, f := range res.Failures {
			if f.Status == pb.BlockStatus_BLOCK_STATUS_NO_SPACE {
				noSpace++
			}
		}
	}
	// Each leased block the policy evicts may cost one store its slot.
	if noSpace > 8 {
		t.Fatalf("%d of 100 blocks got NO_SPACE with 8 of 16 slots leased", noSpace)
	}
}

// TestDemotionOfARemovedEntry: a block invalidated (or dropped after a
// failed load) while its disk write is in flight, then stored and demoted
// again, used to leave two demotions of one key in flight; the second to
// finish made the disk policy forget the block the first had attached, and
// every later demotion of that size failed. The first write's slot was also
// freed without erasing its header, so the invalidated block came back
// after a restart.
func TestDemotionOfARemovedEntry(t *testing.T) {
	for _, how := range []string{"invalidate", "failed load"} {
		t.Run(how, func(t *testing.T) {
			dir := t.TempDir()
			o := diskOpts(dir)
			o.DiskBytes = 8 << 20 // 2 chunks: 30 slots
			o.WriteThrough = true
			gate := testenv.NewDiskGate()
			o.DiskFS = gate
			copies := testenv.NewGate()
			o.Wrap = copies.Wrap
			d := testenv.Start(t, o)
			e := register(t, d, small, "m")
			k := e.hashes(1, 1)
			gate.Hold()
			e.store(t, 1, k, seq(0, 1)) // its write-through write waits
			gate.Waiting(1)
			switch how {
			case "invalidate":
				if n, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(k...)); err != nil || n != 1 {
					t.Fatalf("invalidate: %d %v", n, err)
				}
			case "failed load":
				copies.FailNext(1)
				if res := e.load(t, 2, k, seq(40, 1)); res.Ok {
					t.Fatal("the load did not fail")
				}
			}
			if lr := e.lookup(t, k); lr.Ready != 0 {
				t.Fatal("the removed block is offered")
			}
			// Stored again: a second write of the key.
			e.store(t, 3, k, seq(0, 1))
			gate.Release()
			flush(t, d)
			if err := d.Svc.CheckInvariants(); err != nil {
				t.Fatal(err)
			}
			// The disk tier keeps taking blocks: three times its size. In
			// a step of four, the policy may make room by evicting a block
			// of the same step whose write is still in flight: its slot is
			// free only once the write lands, so that demotion finds no
			// slot (no_space, transient, the block stays in the CPU tier).
			// A slot the policy counts that does not exist (the defect)
			// shows once the tier is full and nothing is in flight: then
			// every demotion that needs an eviction finds no slot.
			storeMany(t, e, 7, 90)
			flush(t, d)
			if err := d.Svc.CheckInvariants(); err != nil {
				t.Fatal(err)
			}
			before := demotions(t, d.Registry)
			for i := 0; i < 12; i++ {
				storeMany(t, e, 8+uint64(i), 1) // one block, flushed: nothing else in flight
			}
			after := demotions(t, d.Registry)
			if ns := after["no_space"] - before["no_space"]; ns > 0 {
				t.Fatalf("%v of 12 demotions into a full disk tier, one at a time, found no slot", ns)
			}
			if after["written"] == before["written"] {
				t.Fatalf("none of 12 demotions into a full disk tier was written: %v", after)
			}
			if err := d.Svc.CheckInvariants(); err != nil {
				t.Fatal(err)
			}
			// The second write's copy is the key's; invalidate it too, and
			// nothing of the key comes back after a restart.
			if _, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(k...)); err != nil {
				t.Fatal(err)
			}
			flush(t, d)
			d.Stop(t)
			o.DiskFS, o.Wrap = nil, nil
			d2 := testenv.Start(t, o)
			e2 := register(t, d2, small, "m")
			if lr := e2.lookup(t, k); lr.Ready != 0 {
				t.Fatal("the invalidated block came back after a restart")
			}
			if err := d2.Svc.CheckInvariants(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestInvalidatedDuringWriteStaysGone: a block invalidated while its only
// disk write was in flight used to come back after a restart (its slot
// was freed with a valid header).
func TestInvalidatedDuringWriteStaysGone(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	o.WriteThrough = true
	gate := testenv.NewDiskGate()
	o.DiskFS = gate
	d := testenv.Start(t, o)
	e := register(t, d, small, "m")
	k := e.hashes(1, 2)
	gate.Hold()
	e.store(t, 1, k, seq(0, 2))
	gate.Waiting(1)
	if _, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(k...)); err != nil {
		t.Fatal(err)
	}
	gate.Release()
	flush(t, d)
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	d.Stop(t)
	o.DiskFS = nil
	d2 := testenv.Start(t, o)
	e2 := register(t, d2, small, "m")
	if lr := e2.lookup(t, k); lr.Ready != 0 {
		t.Fatalf("%d invalidated blocks came back after a restart", lr.Ready)
	}
}

// TestFailedLoadStaysGoneAfterRestart: a block whose load failed leaves
// the index, and its disk copy with it: it is not offered again after a
// restart either.
func TestFailedLoadStaysGoneAfterRestart(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	o.WriteThrough = true
	copies := testenv.NewGate()
	o.Wrap = copies.Wrap
	d := testenv.Start(t, o)
	e := register(t, d, small, "m")
	k := e.hashes(1, 2)
	e.store(t, 1, k, seq(0, 2))
	flush(t, d)
	copies.FailNext(1)
	if res := e.load(t, 2, k, seq(40, 2)); res.Ok {
		t.Fatal("the load did not fail")
	}
	flush(t, d)
	d.Stop(t)
	o.Wrap = nil
	d2 := testenv.Start(t, o)
	e2 := register(t, d2, small, "m")
	if lr := e2.lookup(t, k); lr.Ready != 0 {
		t.Fatalf("%d blocks whose load failed came back after a restart", lr.Ready)
	}
}

func demotions(t testing.TB, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "kvoffload_disk_demotions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" {
					out[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	return out
}

// counter sums a counter's series whose labels include want.
func counter(t testing.TB, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if labels[k] != v {
					continue series
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// TestCloseEvictsNothing: closing the policies at shutdown used to report
// every cached block as evicted, and with a disk tier each became a
// demotion queued with nothing left to write it.
func TestCloseEvictsNothing(t *testing.T) {
	for _, withDisk := range []bool{false, true} {
		t.Run(fmt.Sprintf("disk=%v", withDisk), func(t *testing.T) {
			o := testenv.Options{CPUBytes: 8 << 20, ChunkBytes: 4 << 20, Quiet: true}
			if withDisk {
				o = diskOpts(t.TempDir())
			}
			d := testenv.Start(t, o)
			e := register(t, d, small, "m")
			storeMany(t, e, 1, 16)
			if withDisk {
				flush(t, d)
			}
			before := counter(t, d.Registry, "kvoffload_evictions_total", nil)
			queued := demotions(t, d.Registry)
			d.Stop(t)
			if after := counter(t, d.Registry, "kvoffload_evictions_total", nil); after != before {
				t.Fatalf("shutdown evicted %v blocks", after-before)
			}
			if withDisk {
				c, cancel := context.WithTimeout(context.Background(), 5e9)
				defer cancel()
				if err := d.Svc.FlushDisk(c); err != nil {
					t.Fatalf("disk writes left queued by shutdown: %v", err)
				}
				if after := demotions(t, d.Registry); after["dropped"] != queued["dropped"] {
					t.Fatalf("shutdown queued demotions: %v -> %v", queued, after)
				}
			}
		})
	}
}
