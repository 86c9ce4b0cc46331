package e2e

// Tests of finding N3 of the model-based test: the results of a Store or
// Load with wait were lost when the caller gave up just as its jobs
// finished, or when the reply never reached it. They follow Completions'
// delivery rule now (docs/api.md, "Results of a Store or Load with wait").

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/offload"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// missingLoad is a load job of n keys never stored: it finishes at once,
// inside the call that submits it.
func (e *engine) missingLoad(id uint64, n int) offload.Job {
	var hs []byte
	for _, h := range e.hashes(1000+id, n) {
		hs = append(hs, h...)
	}
	return offload.Job{ID: id, Keys: offload.Keys{Hashes: hs}, BlockIDs: seq(0, n)}
}

// TestWaitResultsOfAGivenUpCaller: a caller that gave up waiting (its
// context ended) as its jobs finished was still handed their results, in a
// reply nobody would read, and they never reached Completions. The
// registration is made over the socket; the call is made in-process with a
// context already ended, so every result is in when the call finds its
// caller gone.
func TestWaitResultsOfAGivenUpCaller(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	e := register(t, d, small, "m")
	reg, err := d.Svc.Registration(e.reg.RegistrationId)
	if err != nil {
		t.Fatal(err)
	}
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	const calls = 20
	ids := make([]uint64, 0, calls)
	for i := uint64(1); i <= calls; i++ {
		res, err := reg.Transfer(gone, 0, offload.OpLoad, []offload.Job{e.missingLoad(i, 2)}, true, nil, nil)
		if err == nil {
			t.Fatalf("call %d: a caller that gave up was handed %d results nobody reads", i, len(res.Results))
		}
		ids = append(ids, i)
	}
	got, err := e.c.WaitJobs(ctx(t), e.reg.RegistrationId, ids...)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if r := got[id]; r == nil || len(r.Failures) != 2 || r.Failures[0].Status != pb.BlockStatus_BLOCK_STATUS_MISSING {
			t.Fatalf("job %d: %+v", id, r)
		}
	}
	// Acknowledged by the next call: nothing is left.
	if r, err := e.c.Completions(ctx(t), e.reg.RegistrationId, 0); err != nil || len(r.Results) != 0 {
		t.Fatalf("completions after every result was read: %+v %v", r, err)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestWaitResultsWithTheCursor: a Store or Load with wait and ack_seq has
// its results queued like any other: the reply carries them with their seq,
// and they stay until acknowledged (by a Transfer's ack_seq or Completions').
// Without ack_seq they have seq 0 and leave as they are sent.
func TestWaitResultsWithTheCursor(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	e := register(t, d, small, "m")
	hs := e.hashes(1, 2)
	for i, h := range hs {
		e.m.Fill(e.r, i, h)
	}
	zero := uint64(0)
	r, err := e.c.API.Store(ctx(t), &pb.TransferRequest{RegistrationId: e.reg.RegistrationId, Wait: true, AckSeq: &zero,
		Jobs: []*pb.Job{testenv.Job(1, hs[:1], seq(0, 1)), testenv.Job(2, hs[1:], seq(1, 1))}})
	if err != nil || len(r.Results) != 2 {
		t.Fatal(r, err)
	}
	seqs := map[uint64]uint64{}
	for _, jr := range r.Results {
		if !jr.Ok || jr.Seq == 0 {
			t.Fatalf("result %+v", jr)
		}
		seqs[jr.JobId] = jr.Seq
	}
	// The reply may have been lost: Completions sends the results again.
	c, err := e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &zero})
	if err != nil || len(c.Results) != 2 {
		t.Fatalf("completions: %+v %v", c, err)
	}
	for _, jr := range c.Results {
		if seqs[jr.JobId] != jr.Seq {
			t.Fatalf("job %d again with seq %d, the reply said %d", jr.JobId, jr.Seq, seqs[jr.JobId])
		}
	}
	// A load acknowledging both: they leave, its own result stays.
	last := max(seqs[1], seqs[2])
	l, err := e.c.API.Load(ctx(t), &pb.TransferRequest{RegistrationId: e.reg.RegistrationId, Wait: true, AckSeq: &last,
		Jobs: []*pb.Job{testenv.Job(3, hs, seq(40, 2))}})
	if err != nil || len(l.Results) != 1 || !l.Results[0].Ok || l.Results[0].Seq <= last {
		t.Fatalf("load: %+v %v", l, err)
	}
	e.verify(t, l.Results[0], hs, seq(40, 2))
	c, err = e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &last})
	if err != nil || len(c.Results) != 1 || c.Results[0].JobId != 3 {
		t.Fatalf("completions after the acknowledgement: %+v %v", c, err)
	}
	all := l.Results[0].Seq
	if _, err := e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &all}); err != nil {
		t.Fatal(err)
	}
	// Without ack_seq: seq 0, and nothing stays behind.
	res := e.load(t, 4, hs, seq(40, 2))
	if !res.Ok || res.Seq != 0 {
		t.Fatalf("load without a cursor: %+v", res)
	}
	c, err = e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &all})
	if err != nil || len(c.Results) != 0 {
		t.Fatalf("a result returned without a cursor stayed queued: %+v %v", c, err)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestWaitWithTheCursorLosesNothing: a client that passes ack_seq and
// gives up its Loads with wait after a random few hundred microseconds
// (often before the reply, sometimes as it is sent, sometimes with copies
// still running) finds every result the daemon produced in Completions: as
// many blocks in the results it reads as the daemon counted.
func TestWaitWithTheCursorLosesNothing(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true})
	e := register(t, d, small, "m")
	const calls, blocks = 300, 2
	stored := e.hashes(1, blocks)
	e.store(t, 1_000_000, stored, seq(0, blocks))
	r := rand.New(rand.NewPCG(1, 2))
	zero := uint64(0)
	replied, gaveUp := 0, 0
	seen := map[uint64]uint64{} // job -> seq, from replies
	for i := uint64(1); i <= calls; i++ {
		c, cancel := context.WithTimeout(context.Background(), time.Duration(r.IntN(1500))*time.Microsecond)
		// Half the loads copy (into blocks of their own), half find
		// nothing and finish inside the call.
		job := testenv.Job(i, e.hashes(5000+i, blocks), seq(0, blocks))
		if i%2 == 0 {
			job = testenv.Job(i, stored, seq(2+int(i%30)*blocks, blocks))
		}
		out, err := e.c.API.Load(c, &pb.TransferRequest{RegistrationId: e.reg.RegistrationId, Wait: true, AckSeq: &zero, Jobs: []*pb.Job{job}})
		cancel()
		switch code := codeOf(err); code {
		case codes.OK:
			replied++
			seen[i] = out.Results[0].Seq
		case codes.DeadlineExceeded, codes.Canceled:
			gaveUp++
		default:
			t.Fatalf("call %d: %v", i, err)
		}
	}
	// Quiet: every accepted job has finished.
	waitFor(t, "the jobs to finish", func() bool {
		c, err := e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &zero, MaxJobs: 1})
		return err == nil && c.Pending == 0
	})
	got := map[uint64]uint64{}
	var ack uint64
	for {
		c, err := e.c.API.Completions(ctx(t), &pb.CompletionsRequest{RegistrationId: e.reg.RegistrationId, AckSeq: &ack})
		if err != nil {
			t.Fatal(err)
		}
		for _, jr := range c.Results {
			if _, dup := got[jr.JobId]; dup || jr.Seq <= ack {
				t.Fatalf("job %d (seq %d) twice past the cursor %d", jr.JobId, jr.Seq, ack)
			}
			got[jr.JobId] = jr.Seq
			ack = jr.Seq
		}
		if len(c.Results) == 0 {
			break
		}
	}
	for id, s := range seen {
		if got[id] != s {
			t.Fatalf("job %d was replied with seq %d, Completions has %d", id, s, got[id])
		}
	}
	counted := counter(t, d.Registry, "kvoffload_blocks_total", map[string]string{"op": "load"})
	if want := float64(len(got) * blocks); counted != want {
		t.Fatalf("the daemon counted %v load blocks, the results read hold %v: results were lost", counted, want)
	}
	t.Logf("%d calls: %d replied, %d gave up; %d results read", calls, replied, gaveUp, len(got))
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}
