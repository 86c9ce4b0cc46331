package main

import (
	"context"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// daemonArgs are the flags of a small daemon with a disk tier in dir.
func daemonArgs(sock, dir string, extra ...string) []string {
	return append([]string{"--socket", sock, "--metrics-addr", "", "--cpu-bytes", "8MiB", "--cpu-chunk-bytes", "4MiB",
		"--disk-dir", dir, "--disk-bytes", "64MiB", "--disk-chunk-bytes", "4MiB"}, extra...)
}

// runInProcess runs the daemon until stop is called or the test ends; it
// returns a client once the daemon reports SERVING.
func runInProcess(t *testing.T, args []string, stderr io.Writer) (c *client.Client, stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, io.Discard, stderr) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			runErr = <-done
		})
		return runErr
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("daemon: %v", err)
		}
	})
	c, err := client.Dial(args[1])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	for {
		hctx, hcancel := context.WithTimeout(ctx, time.Second)
		ok, _ := c.Healthy(hctx)
		hcancel()
		if ok {
			return c, stop
		}
		select {
		case err := <-done:
			done <- err
			t.Fatalf("daemon exited at start: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// TestSecondDaemonOnDiskDirRefuses: a second daemon given a --disk-dir
// that a running one uses refuses to start, saying why, and the first
// keeps serving.
func TestSecondDaemonOnDiskDirRefuses(t *testing.T) {
	dir := t.TempDir()
	first, _ := runInProcess(t, daemonArgs(filepath.Join(t.TempDir(), "a.sock"), dir), io.Discard)

	sock2 := filepath.Join(t.TempDir(), "b.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- run(ctx, daemonArgs(sock2, dir), io.Discard, io.Discard) }()
	c2, err := client.Dial(sock2)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	for {
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), "in use by another kvoffloadd") || !strings.Contains(err.Error(), dir) {
				t.Fatalf("second daemon on %s: %v; want a refusal naming the directory", dir, err)
			}
			hctx, hcancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer hcancel()
			if ok, err := first.Healthy(hctx); !ok {
				t.Fatalf("the first daemon stopped serving: %v", err)
			}
			return
		case <-time.After(10 * time.Millisecond):
		}
		hctx, hcancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		ok, _ := c2.Healthy(hctx)
		hcancel()
		if ok {
			cancel()
			<-done
			t.Fatal("a second daemon started serving on a --disk-dir another one uses")
		}
	}
}

// waitRecovered waits until the daemon's disk tier has finished
// recovering its files (it serves before that), and returns the progress.
func waitRecovered(t *testing.T, c *client.Client) *pb.DiskRecovery {
	t.Helper()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		st, err := c.Stats(ctx)
		cancel()
		if err != nil {
			t.Fatalf("stats: %v", err)
		}
		r := st.GetDiskRecovery()
		if r == nil {
			t.Fatal("a daemon with a disk tier reports no recovery")
		}
		if r.State != pb.RecoveryState_RECOVERY_STATE_RUNNING {
			return r
		}
		time.Sleep(5 * time.Millisecond)
	}
}
