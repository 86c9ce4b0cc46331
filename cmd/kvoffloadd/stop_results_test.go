package main

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/rpc/server"
)

// TestStopSendsTheResultsItFinished: a client that has not read the result
// of a job when the daemon gets SIGTERM reads it on its open connection
// after the daemon removed its socket (a successor may serve the path by
// then); meanwhile only Completions (and Unregister, Stats, health) is
// answered there, and the daemon exits 0 once the result was sent
// (docs/operations.md, Shutdown and signals).
func TestStopSendsTheResultsItFinished(t *testing.T) {
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	proc := exec.Command(bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "16MiB", "--shutdown-timeout", "30s")
	d := runWatched(t, proc)
	logs, exited := d.logs, d.exited
	c := d.dial(t, sock)
	defer c.Close()

	ctx := context.Background()
	m := testenv.Model{Layers: 2, SegBytes: 64 << 10, Blocks: 4}
	r := testenv.NewRegion(t, m.RegionBytes())
	reg, err := c.Register(ctx, []byte("stop-results"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	hs := m.Hashes(1, 2)
	for i, h := range hs {
		m.Fill(r, i, h)
	}
	// Submitted without reading its result: the reply carries none yet, or
	// it is read (and the test has nothing to show) — then it submits again.
	var jobID uint64
	for id := uint64(1); jobID == 0; id++ {
		if id > 20 {
			t.Fatal("every store's result came back on its own reply")
		}
		resp, err := c.Submit(ctx, pb.Op_OP_STORE, reg.RegistrationId, []*pb.Job{testenv.Job(id, hs, []uint32{0, 1})})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.GetResults()) == 0 || resp.GetResults()[len(resp.GetResults())-1].GetJobId() != id {
			jobID = id
		}
	}
	if err := proc.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// The daemon drained, removed its socket and waits for the result to
	// be read (or, before it did, has exited with it unread).
	for deadline := time.Now().Add(60 * time.Second); ; {
		select {
		case <-exited:
		default:
			if !strings.Contains(logs.String(), "waiting for clients to read the results") {
				if time.Now().After(deadline) {
					t.Fatal("the daemon neither exited nor waited for its results 60s after SIGTERM")
				}
				time.Sleep(5 * time.Millisecond)
				continue
			}
		}
		break
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("the socket is still there while the daemon waits for results to be read: %v", err)
	}
	if _, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, testenv.Keys(hs...), 0); status.Code(err) != codes.Unavailable || !errors.Is(err, client.ErrDaemonStopping) {
		t.Errorf("a Lookup while the daemon waits for its results to be read: %v, want UNAVAILABLE marked daemon-stopping", err)
	}
	// A Load sent now is refused whole, and says so: the client may send
	// its jobs to the next daemon.
	if _, err := c.Submit(ctx, pb.Op_OP_LOAD, reg.RegistrationId, []*pb.Job{testenv.Job(99, hs, []uint32{2, 3})}); status.Code(err) != codes.Unavailable || !errors.Is(err, client.ErrDaemonStopping) {
		t.Errorf("a Load while the daemon waits for its results to be read: %v, want UNAVAILABLE marked daemon-stopping", err)
	}
	var got *pb.JobResult
	for got == nil {
		cr, err := c.Completions(ctx, reg.RegistrationId, 1000)
		if err != nil {
			t.Fatalf("Completions on the open connection after SIGTERM: %v", err)
		}
		for _, res := range cr.GetResults() {
			if res.GetJobId() == jobID {
				got = res
			}
		}
		if got == nil && cr.GetPending() == 0 && len(cr.GetResults()) == 0 {
			t.Fatalf("the daemon holds no result of job %d", jobID)
		}
	}
	if !got.GetOk() {
		t.Fatalf("store finished before the stop: %+v", got)
	}
	select {
	case <-exited:
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon did not exit after its result was read")
	}
	if d.err != nil {
		t.Fatalf("daemon exit: %v", d.err)
	}
	if !strings.Contains(logs.String(), "every result was sent") {
		t.Fatalf("the daemon did not log that its results were read:\n%s", logs.String())
	}
	// The daemon is gone: the transport's UNAVAILABLE is never marked (the
	// client cannot tell whether such a call was accepted).
	if _, err := c.Submit(ctx, pb.Op_OP_LOAD, reg.RegistrationId, []*pb.Job{testenv.Job(100, hs, []uint32{2, 3})}); status.Code(err) != codes.Unavailable || errors.Is(err, client.ErrDaemonStopping) {
		t.Errorf("a Load after the daemon exited: %v, want UNAVAILABLE not marked daemon-stopping", err)
	}
}

// TestStoppingLongPollWaitsForPendingJobs: once the daemon is stopping, a
// Completions long poll of a registration with a job still running waits
// for its result (the drain finishes it) instead of returning at once with
// nothing, which sent a connector round a busy loop for the whole drain.
func TestStoppingLongPollWaitsForPendingJobs(t *testing.T) {
	hc := &failingCopier{arrived: make(chan struct{}, 16), failed: make(chan struct{})}
	wrapCopier = func(e dma.Engine) dma.Engine {
		hc.Engine = e
		return hc
	}
	t.Cleanup(func() { wrapCopier = nil })
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	exited := make(chan error, 1)
	go func() {
		exited <- run(ctx, []string{"--socket", sock, "--metrics-addr", metrics, "--cpu-bytes", "16MiB", "--shutdown-timeout", "1m"}, io.Discard, io.Discard)
	}()
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitServing(t, c, true, exited)
	t.Cleanup(hc.release) // a failed test must not leave the daemon's drain waiting

	m := testenv.Model{Layers: 2, Blocks: 4, SegBytes: 4096}
	r := testenv.NewRegion(t, m.RegionBytes())
	rctx, rcancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer rcancel()
	reg, err := c.Register(rctx, []byte(t.Name()), m.Layout(), m.Regions(r), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	h := m.Hash(1, 0)
	m.Fill(r, 0, h)
	hc.hold()
	if _, err := c.Submit(rctx, pb.Op_OP_STORE, reg.RegistrationId, []*pb.Job{testenv.Job(1, [][]byte{h}, []uint32{0})}); err != nil {
		t.Fatal(err)
	}
	<-hc.arrived
	cancel() // SIGTERM
	waitServing(t, c, false, exited)
	// The drain refuses new work, and says it refused the call whole.
	if _, err := c.Submit(rctx, pb.Op_OP_LOAD, reg.RegistrationId, []*pb.Job{testenv.Job(2, [][]byte{h}, []uint32{1})}); status.Code(err) != codes.Unavailable || !errors.Is(err, client.ErrDaemonStopping) {
		t.Fatalf("a Load during the drain: %v, want UNAVAILABLE marked daemon-stopping", err)
	}
	// So are a Register and a WatchEvents stream (the connector registers
	// again and its mirror follows the next daemon on that mark), the
	// stream's trailer carrying it too.
	if _, err := c.Register(rctx, []byte(t.Name()+"-late"), m.Layout(), m.Regions(r), t.Name()); status.Code(err) != codes.Unavailable || !errors.Is(err, client.ErrDaemonStopping) {
		t.Fatalf("a Register during the drain: %v, want UNAVAILABLE marked daemon-stopping", err)
	}
	ws, err := pb.NewKVOffloadClient(c.Conn()).WatchEvents(rctx, &pb.WatchEventsRequest{NamespaceIds: []uint32{reg.NamespaceId}})
	if err != nil {
		t.Fatal(err) // a stream's error comes with its first Recv
	}
	_, err = ws.Recv()
	if mark := ws.Trailer().Get(server.RefusalKey); status.Code(err) != codes.Unavailable || len(mark) != 1 || mark[0] != server.RefusalStopping {
		t.Fatalf("a WatchEvents during the drain: %v (trailer %v), want UNAVAILABLE marked %s", err, mark, server.RefusalStopping)
	}

	type polled struct {
		r   *pb.CompletionsResponse
		err error
	}
	done := make(chan polled, 1)
	go func() {
		r, err := c.Completions(rctx, reg.RegistrationId, 10000)
		done <- polled{r, err}
	}()
	// The poll is in the daemon (its request bytes are booked until its
	// handler returns); only then is the copy let go.
	inflight := regexp.MustCompile(`(?m)^kvoffload_inflight_request_bytes ([1-9][0-9]*)$`)
	for deadline := time.Now().Add(30 * time.Second); ; {
		select {
		case p := <-done:
			t.Fatalf("a long poll during the drain returned before the job finished: %+v %v", p.r, p.err)
		default:
		}
		if inflight.MatchString(scrape(t, metrics)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the long poll never reached the daemon")
		}
		time.Sleep(5 * time.Millisecond)
	}
	hc.release()
	p := <-done
	if p.err != nil || len(p.r.GetResults()) != 1 || !p.r.GetResults()[0].GetOk() {
		t.Fatalf("the long poll during the drain: %+v %v, want the store's result", p.r, p.err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon did not exit")
	}
}
