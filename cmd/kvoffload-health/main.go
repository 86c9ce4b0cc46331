// Command kvoffload-health asks a kvoffloadd, over its unix socket, whether
// it is serving: exit status 0 when the daemon's gRPC health service answers
// SERVING, 1 when it answers anything else or cannot be reached, 2 on a bad
// flag. It is the readiness, liveness and startup probe of the Kubernetes
// sidecar (a kubelet's own gRPC probe reaches only TCP ports, and the API
// listens on a unix socket only) and the systemd unit's start check
// (--wait), in deploy/.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stderr))
}

// defaultSocket is the daemon's default --socket (cmd/kvoffloadd).
func defaultSocket() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "kvoffloadd", "kvoffloadd.sock")
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("kvoffloadd-%d", os.Getuid()), "kvoffloadd.sock")
}

const usageHead = `kvoffload-health asks a kvoffloadd over its unix socket whether it serves.
Exit status: 0 SERVING; 1 NOT_SERVING, unreachable or no answer in time; 2 bad flags.

Usage: kvoffload-health [flags]

Flags:
`

func run(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("kvoffload-health", flag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("socket", defaultSocket(), "the daemon's unix socket (its --socket).")
	service := fs.String("service", "", `health service name to ask about: "" (the daemon as a whole) or kvoffload.v1.KVOffload.`)
	timeout := fs.Duration("timeout", 5*time.Second, "how long one check may take.")
	wait := fs.Duration("wait", 0, "keep checking until SERVING or this long has passed (0: check once). For a service manager's start check.")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usageHead)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 || *timeout <= 0 || *wait < 0 {
		fmt.Fprintln(stderr, "kvoffload-health: want only flags, a positive --timeout and a --wait of 0 or more (see --help)")
		return 2
	}
	deadline := time.Now().Add(*wait)
	for {
		status, err := check(ctx, *socket, *service, *timeout)
		if err == nil && status == healthpb.HealthCheckResponse_SERVING {
			return 0
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			if err != nil {
				fmt.Fprintf(stderr, "kvoffload-health: %s: %v\n", *socket, err)
			} else {
				fmt.Fprintf(stderr, "kvoffload-health: %s: %s\n", *socket, status)
			}
			return 1
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// check asks once, over a connection of its own: a channel kept across
// attempts would back off reconnecting (up to two minutes) after the daemon
// was absent, and miss it coming up. It does not wait for the socket to
// accept (grpc fails fast by default): an absent daemon is an answer.
func check(ctx context.Context, socket, service string, timeout time.Duration) (healthpb.HealthCheckResponse_ServingStatus, error) {
	conn, err := grpc.NewClient("unix:"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	return r.GetStatus(), err
}
