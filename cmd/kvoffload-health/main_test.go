package main

import (
	"bytes"
	"context"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
)

func probe(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var stderr bytes.Buffer
	code := run(context.Background(), args, &stderr)
	return code, stderr.String()
}

// TestAgainstDaemon asks a real daemon core over its socket, serving and
// then shutting down.
func TestAgainstDaemon(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true})
	for _, svc := range []string{"", "kvoffload.v1.KVOffload"} {
		if code, out := probe(t, "--socket", d.Socket, "--service", svc); code != 0 {
			t.Fatalf("serving daemon, service %q: exit %d, %s", svc, code, out)
		}
	}
	if code, out := probe(t, "--socket", d.Socket, "--service", "no.such.Service"); code != 1 || !strings.Contains(out, "NotFound") {
		t.Fatalf("unknown service: exit %d, %s", code, out)
	}
	d.Srv.SetNotServing() // the first step of the daemon's shutdown
	if code, out := probe(t, "--socket", d.Socket); code != 1 || !strings.Contains(out, "NOT_SERVING") {
		t.Fatalf("daemon shutting down: exit %d, %s", code, out)
	}
}

func TestNobodyListening(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "kv.sock")
	if code, out := probe(t, "--socket", sock); code != 1 || !strings.Contains(out, "no such file") {
		t.Fatalf("absent socket: exit %d, %s", code, out)
	}
	// A socket file nobody listens on: what a killed daemon leaves.
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	if code, out := probe(t, "--socket", sock); code != 1 || !strings.Contains(out, "connection refused") {
		t.Fatalf("stale socket: exit %d, %s", code, out)
	}
}

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{{"--timeout", "0"}, {"--wait", "-1s"}, {"extra"}, {"--no-such-flag"}} {
		if code, _ := probe(t, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
	}
	if code, out := probe(t, "--help"); code != 0 || !strings.Contains(out, "Exit status") {
		t.Errorf("--help: exit %d, %s", code, out)
	}
}

// slowStart answers NOT_SERVING to its first checks, as a daemon does while
// it starts, then SERVING.
type slowStart struct {
	healthpb.UnimplementedHealthServer
	checks atomic.Int32
	after  int32
}

func (s *slowStart) Check(context.Context, *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if s.checks.Add(1) <= s.after {
		return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_NOT_SERVING}, nil
	}
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

// refuseFirst closes the first n connections it accepts, as a socket does
// before its daemon serves, then hands connections to the server.
type refuseFirst struct {
	net.Listener
	n atomic.Int32
}

func (l *refuseFirst) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil || l.n.Add(-1) < 0 {
			return c, err
		}
		c.Close()
	}
}

// TestWait keeps checking through refused connections and NOT_SERVING
// answers until SERVING; without --wait one NOT_SERVING is the answer.
func TestWait(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "kv.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	rl := &refuseFirst{Listener: l}
	rl.n.Store(3)
	hs := &slowStart{after: 3}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	go srv.Serve(rl)
	t.Cleanup(srv.Stop)

	if code, out := probe(t, "--socket", sock); code != 1 {
		t.Fatalf("first check, connection refused: exit %d, %s", code, out)
	}
	if code, out := probe(t, "--socket", sock, "--wait", "2m"); code != 0 {
		t.Fatalf("--wait: exit %d, %s", code, out)
	}
	if rl.n.Load() >= 0 || hs.checks.Load() != 4 {
		t.Fatalf("--wait returned before the server served: %d refusals left, %d checks", rl.n.Load(), hs.checks.Load())
	}
}
