package e2e

// Results piggybacked on a Store or Load without wait (issue 11 item 4): a
// Transfer that acknowledges (ack_seq) answers with the registration's
// finished results after it, as Completions would, so an engine that sends
// a Store or Load every step needs no Completions call for them.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/offload"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// missingJob is a load job of n keys never stored: it fails MISSING at
// once, inside the call that submits it.
func (e *engine) missingJob(id uint64, n int, requestID string) *pb.Job {
	j := testenv.Job(id, e.hashes(1_000_000+id, n), seq(int(id%8)*n, n))
	if requestID != "" {
		j.RequestId = requestID
	}
	return j
}

func (e *engine) transfer(t testing.TB, op pb.Op, ack *uint64, wait bool, jobs ...*pb.Job) *pb.TransferResponse {
	t.Helper()
	req := &pb.TransferRequest{RegistrationId: e.reg.RegistrationId, Jobs: jobs, AckSeq: ack, Wait: wait}
	var r *pb.TransferResponse
	var err error
	if op == pb.Op_OP_STORE {
		r, err = e.c.API.Store(ctx(t), req)
	} else {
		r, err = e.c.API.Load(ctx(t), req)
	}
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (e *engine) completions(t testing.TB, ack uint64) *pb.CompletionsResponse {
	t.Helper()
	c, err := e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &ack})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func seqsOf(rs []*pb.JobResult) []uint64 {
	out := make([]uint64, len(rs))
	for i, r := range rs {
		out[i] = r.GetSeq()
	}
	return out
}

// samePrefix fails unless a's results are, one for one, the first of b's.
func samePrefix(t testing.TB, what string, a, b []*pb.JobResult) {
	t.Helper()
	if len(a) > len(b) {
		t.Fatalf("%s: %d results, Completions has %d: %v vs %v", what, len(a), len(b), seqsOf(a), seqsOf(b))
	}
	for i := range a {
		if !proto.Equal(a[i], b[i]) {
			t.Fatalf("%s: result %d is %v, Completions says %v", what, i, a[i], b[i])
		}
	}
}

// TestPiggybackedResultsAreCompletions: a Store or Load without wait and
// with ack_seq acknowledges as Completions does and answers with exactly
// what Completions would: every finished result after ack_seq, in seq
// order, its own among them, and they stay queued until acknowledged.
// Without ack_seq the reply stays empty; a call naming another
// connection's registration is refused and acknowledges nothing.
func TestPiggybackedResultsAreCompletions(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	e := register(t, d, small, "m")
	load := pb.Op_OP_LOAD
	zero := uint64(0)

	// A missing load finishes inside its call: its reply carries it.
	r1 := e.transfer(t, load, &zero, false, e.missingJob(1, 2, ""))
	if len(r1.Results) != 1 || r1.Results[0].JobId != 1 || r1.Results[0].Seq != 1 || r1.More || r1.Pending != 0 {
		t.Fatalf("first reply: %v", r1)
	}
	if f := r1.Results[0].Failures; len(f) != 2 || f[0].Status != pb.BlockStatus_BLOCK_STATUS_MISSING || len(f[0].Hash) != 32 {
		t.Fatalf("failures: %v", f)
	}
	// As if that reply was lost: the same cursor gets it again.
	r2 := e.transfer(t, load, &zero, false, e.missingJob(2, 2, ""))
	if got := seqsOf(r2.Results); len(got) != 2 || got[0] != 1 || got[1] != 2 {
		t.Fatalf("second reply with the same cursor: seqs %v", got)
	}
	c := e.completions(t, 0)
	samePrefix(t, "second reply", r2.Results, c.Results)
	if len(c.Results) != 2 || c.Pending != r2.Pending || c.More {
		t.Fatalf("completions: %v", c)
	}

	// Without ack_seq: no results on the reply, and the queue is as it was.
	if r := e.transfer(t, load, nil, false, e.missingJob(3, 1, "")); len(r.Results) != 0 || r.More || r.Pending != 0 {
		t.Fatalf("a reply without ack_seq carried results: %v", r)
	}
	if c := e.completions(t, 0); len(c.Results) != 3 {
		t.Fatalf("after a call without ack_seq: %v", seqsOf(c.Results))
	}

	// Another connection naming the registration is refused and
	// acknowledges nothing.
	other := d.Client(t)
	big := uint64(1 << 40)
	_, err := other.API.Load(ctx(t), &pb.TransferRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &big, Jobs: []*pb.Job{e.missingJob(4, 1, "")}})
	if codeOf(err) != codes.NotFound {
		t.Fatalf("a load naming another connection's registration: %v", err)
	}
	if c := e.completions(t, 0); len(c.Results) != 3 {
		t.Fatalf("a refused call acknowledged results: %v", seqsOf(c.Results))
	}

	// Real copies: a store, then a load of it into other blocks, each
	// acknowledging what came before. Its reply is a prefix of what
	// Completions answers right after (more may finish in between).
	hs := e.hashes(7, 4)
	for i, h := range hs {
		e.m.Fill(e.r, i, h)
	}
	ack := uint64(3)
	rs := e.transfer(t, pb.Op_OP_STORE, &ack, false, testenv.Job(10, hs, seq(0, 4)))
	samePrefix(t, "store reply", rs.Results, e.completions(t, ack).Results)
	waitFor(t, "the store to finish", func() bool { return e.completions(t, ack).Pending == 0 })
	rl := e.transfer(t, load, &ack, false, testenv.Job(11, hs, seq(40, 4)))
	if len(rl.Results) == 0 || rl.Results[0].JobId != 10 || !rl.Results[0].Ok || rl.Results[0].Seq != 4 {
		t.Fatalf("the load's reply does not start with the finished store: %v", rl.Results)
	}
	samePrefix(t, "load reply", rl.Results, e.completions(t, ack).Results)
	waitFor(t, "the load to finish", func() bool { return e.completions(t, ack).Pending == 0 })
	ack = 4
	last := e.transfer(t, load, &ack, false, e.missingJob(12, 1, ""))
	if len(last.Results) != 2 || last.Results[0].JobId != 11 || last.Results[1].JobId != 12 {
		t.Fatalf("after acknowledging the store: %v", last.Results)
	}
	e.verify(t, last.Results[0], hs, seq(40, 4))
	if !last.Results[0].Ok {
		t.Fatalf("load: %v", last.Results[0])
	}
	if c := e.completions(t, last.Results[1].Seq); len(c.Results) != 0 {
		t.Fatalf("results left after acknowledging every one: %v", seqsOf(c.Results))
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestPiggybackReplyIsBounded: hundreds of failed jobs, each naming every
// failed block with its 32-byte hash and a 512-byte request id, queue up.
// A piggybacked reply never encodes to more than MaxReplyBytes, is cut
// exactly where Completions' is, says more, and the rest comes with the
// next calls, in order, none lost and none twice.
func TestPiggybackReplyIsBounded(t *testing.T) {
	lim := offload.Limits{MaxJobsPerRequest: 8, MaxBlocksPerRequest: 64, MaxRequestID: 512}
	d := testenv.Start(t, testenv.Options{Limits: lim, Quiet: true})
	bound := d.Svc.Limits().MaxReplyBytes()
	e := register(t, d, small, "m")
	const calls, jobs, blocks = 60, 8, 8
	zero := uint64(0)
	id := uint64(0)
	cut := 0
	for i := 0; i < calls; i++ {
		var js []*pb.Job
		for j := 0; j < jobs; j++ {
			id++
			job := testenv.Job(id, e.hashes(1_000_000+id, blocks), seq(j*blocks, blocks))
			job.RequestId = fmt.Sprintf("%d-%s", id, strings.Repeat("r", 500))
			js = append(js, job)
		}
		// The cursor stays at 0: every reply starts from the first result.
		r := e.transfer(t, pb.Op_OP_LOAD, &zero, false, js...)
		if n := proto.Size(r); n > bound {
			t.Fatalf("call %d: the reply encodes to %d bytes, the bound is %d", i, n, bound)
		}
		if len(r.Results) == 0 || r.Results[0].Seq != 1 {
			t.Fatalf("call %d: reply starts at %v", i, seqsOf(r.Results))
		}
		c := e.completions(t, 0)
		if len(c.Results) != len(r.Results) || c.More != r.More {
			t.Fatalf("call %d: the reply carries %d results (more %v), Completions %d (more %v)", i, len(r.Results), r.More, len(c.Results), c.More)
		}
		samePrefix(t, "reply", r.Results, c.Results)
		if r.More {
			cut++
		}
	}
	if cut == 0 {
		t.Fatalf("no reply was cut: the test does not reach the bound")
	}
	// Read everything with the cursor, on the replies of further loads.
	seen := map[uint64]bool{}
	var ack uint64
	for rounds := 0; ; rounds++ {
		id++
		r := e.transfer(t, pb.Op_OP_LOAD, &ack, false, e.missingJob(id, 1, ""))
		if n := proto.Size(r); n > bound {
			t.Fatalf("the reply encodes to %d bytes, the bound is %d", n, bound)
		}
		for _, jr := range r.Results {
			if jr.Seq != ack+1 || seen[jr.JobId] {
				t.Fatalf("seq %d (job %d) after the cursor %d", jr.Seq, jr.JobId, ack)
			}
			if jr.JobId <= calls*jobs && !strings.HasPrefix(jr.RequestId, fmt.Sprint(jr.JobId)+"-") {
				t.Fatalf("job %d carries request id %.20q", jr.JobId, jr.RequestId)
			}
			if len(jr.Failures) != int(jr.Blocks) {
				t.Fatalf("job %d: %d failures of %d blocks", jr.JobId, len(jr.Failures), jr.Blocks)
			}
			seen[jr.JobId] = true
			ack = jr.Seq
		}
		if !r.More && r.Pending == 0 && len(seen) == int(id) {
			break
		}
		if rounds > 2*calls*jobs {
			t.Fatalf("%d results read of %d after %d rounds", len(seen), id, rounds)
		}
	}
	t.Logf("%d failed jobs; %d of %d replies cut at %d bytes", id, cut, calls, bound)
}

// cursor is a client's view of one registration's results, shared by the
// goroutines that read them: ack is the seq below which every result was
// processed, ahead those above it processed already.
type cursor struct {
	mu    sync.Mutex
	ack   uint64
	ahead map[uint64]bool
	jobs  map[uint64]uint64 // job -> seq
}

// take files a reply's results. A reply of the queue (Completions', or a
// Transfer's without wait) read with acknowledgement a holds the results
// after the daemon's front, with no gap; the front is past a and at most
// one past every seq acknowledged so far. A wait reply holds its own
// results, anywhere past a. Each seq is processed once, whichever reply
// brings it first.
func (c *cursor) take(a uint64, rs []*pb.JobResult, queue bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, r := range rs {
		s := r.GetSeq()
		if s <= a || (queue && i == 0 && s > c.ack+1) || (queue && i > 0 && s != rs[i-1].GetSeq()+1) {
			return fmt.Errorf("acknowledging %d: seqs %v (cursor at %d): a result repeated or lost", a, seqsOf(rs), c.ack)
		}
		if s <= c.ack || c.ahead[s] {
			if c.jobs[r.GetJobId()] != s {
				return fmt.Errorf("job %d came with seq %d and %d", r.GetJobId(), c.jobs[r.GetJobId()], s)
			}
			continue
		}
		if _, dup := c.jobs[r.GetJobId()]; dup {
			return fmt.Errorf("job %d reported twice (seqs %d and %d)", r.GetJobId(), c.jobs[r.GetJobId()], s)
		}
		c.jobs[r.GetJobId()] = s
		c.ahead[s] = true
		for c.ahead[c.ack+1] {
			delete(c.ahead, c.ack+1)
			c.ack++
		}
	}
	return nil
}

func (c *cursor) acked() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ack
}

// TestPiggybackLosesNothing: loads without wait that acknowledge, given up
// after a random few hundred microseconds (before the daemon took them, as
// it answered, or never), race waiting loads with ack_seq and a goroutine
// long-polling Completions with the same cursor. Every result the daemon
// produced is processed exactly once, in the seq order of one queue,
// whether a piggybacked reply, a wait reply or Completions brought it;
// replies that never arrived cost nothing.
func TestPiggybackLosesNothing(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true})
	e := register(t, d, small, "m")
	const calls, blocks = 300, 2
	stored := e.hashes(1, blocks)
	e.store(t, 1_000_000, stored, seq(0, blocks))
	cur := &cursor{ahead: map[uint64]bool{}, jobs: map[uint64]uint64{}}
	stop := make(chan struct{})
	var pollErr error
	var polls int
	pctx := ctx(t)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			a := cur.acked()
			c, err := e.c.API.Completions(pctx, &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &a, WaitMs: 20})
			if err == nil {
				polls++
				err = cur.take(a, c.Results, true)
			}
			if err != nil {
				pollErr = err
				return
			}
		}
	}()
	r := rand.New(rand.NewPCG(3, 4))
	replied, gaveUp, waited := 0, 0, 0
	for i := uint64(1); i <= calls; i++ {
		c, cancel := context.WithTimeout(context.Background(), time.Duration(r.IntN(1500))*time.Microsecond)
		// Half the loads copy (into blocks of their own), half find
		// nothing and finish inside the call; one in five waits.
		job := testenv.Job(i, e.hashes(5000+i, blocks), seq(0, blocks))
		if i%2 == 0 {
			job = testenv.Job(i, stored, seq(2+int(i%30)*blocks, blocks))
		}
		wait := i%5 == 0
		a := cur.acked()
		out, err := e.c.API.Load(c, &pb.TransferRequest{RegistrationId: e.reg.RegistrationId, Wait: wait, AckSeq: &a, Jobs: []*pb.Job{job}})
		cancel()
		switch code := codeOf(err); code {
		case codes.OK:
			replied++
			if wait {
				waited++
				// One per job in request order, not in the queue's order.
				if err := cur.take(a, out.Results, false); err != nil {
					t.Fatal(err)
				}
			} else if err := cur.take(a, out.Results, true); err != nil {
				t.Fatal(err)
			}
		case codes.DeadlineExceeded, codes.Canceled:
			gaveUp++
		default:
			t.Fatalf("call %d: %v", i, err)
		}
	}
	waitFor(t, "the jobs to finish", func() bool {
		a := cur.acked()
		c, err := e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &a, MaxJobs: 1})
		return err == nil && c.Pending == 0
	})
	close(stop)
	wg.Wait()
	if pollErr != nil {
		t.Fatal(pollErr)
	}
	for {
		a := cur.acked()
		c := e.completions(t, a)
		if err := cur.take(a, c.Results, true); err != nil {
			t.Fatal(err)
		}
		if len(c.Results) == 0 {
			break
		}
	}
	if len(cur.ahead) != 0 {
		t.Fatalf("seqs %v processed past a gap at %d", cur.ahead, cur.ack)
	}
	counted := counter(t, d.Registry, "kvoffload_blocks_total", map[string]string{"op": "load"})
	if want := float64(len(cur.jobs) * blocks); counted != want {
		t.Fatalf("the daemon counted %v load blocks, the results read hold %v: results were lost", counted, want)
	}
	t.Logf("%d calls: %d replied (%d waited), %d gave up; %d results read, %d Completions polls", calls, replied, waited, gaveUp, len(cur.jobs), polls)
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}
