package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

func TestHelpExplainsRemoteFlags(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"--help"}, io.Discard, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	for _, f := range []string{"-remote-redis", "-remote-password-file", "-remote-tls", "-remote-ca-file", "-remote-timeout", "-remote-key-file", "-remote-write", "-remote-queue", "-remote-wait-replicas", "-remote-state-dir"} {
		if !strings.Contains(out.String(), f+" ") && !strings.Contains(out.String(), f+"\n") {
			t.Errorf("--help does not mention %s", f)
		}
	}
}

func TestRemoteFlagsRefuseToStart(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "s.sock")
	secret := func(name string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, bytes.Repeat([]byte("k"), 40), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	open, private, short := secret("open", 0o644), secret("private", 0o600), filepath.Join(dir, "short")
	os.WriteFile(short, []byte("too short\n"), 0o600)
	seed := []string{"--remote-redis", "127.0.0.1:1"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--remote-key-file", private}, "need a remote tier: add --remote-redis"},
		{[]string{"--remote-tls"}, "need a remote tier"},
		{[]string{"--remote-redis", "nohost"}, `--remote-redis "nohost": want host:port`},
		{[]string{"--remote-redis", "h:99999"}, "want host:port"},
		{append(seed, "--remote-timeout", "0s"), "--remote-timeout 0s"},
		{append(seed, "--remote-timeout", "2m"), "--remote-timeout 2m0s"},
		{append(seed, "--remote-write", "sometimes"), "--remote-write"},
		{append(seed, "--remote-queue", "0"), "--remote-queue 0"},
		{append(seed, "--remote-wait-replicas", "-1"), "--remote-wait-replicas -1"},
		{append(seed, "--remote-state-dir", dir, "--disk-dir", dir), "--remote-state-dir is for a node without --disk-dir"},
		{[]string{"--remote-state-dir", dir}, "need a remote tier"},
		{append(seed, "--remote-ca-file", private), "--remote-ca-file needs --remote-tls"},
		{append(seed, "--remote-tls", "--remote-ca-file", filepath.Join(dir, "none")), "--remote-ca-file"},
		{append(seed, "--remote-key-file", open), "lets others read it"},
		{append(seed, "--remote-password-file", open), "lets others read it"},
		{append(seed, "--remote-key-file", filepath.Join(dir, "none")), "--remote-key-file"},
		{append(seed, "--remote-key-file", short), "at least 32"},
		{append(seed, "--remote-tls", "--remote-ca-file", private), "no PEM certificate"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			args := append([]string{"--socket", sock, "--metrics-addr", ""}, tc.args...)
			err := run(context.Background(), args, io.Discard, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestRemoteFlagsEndToEnd runs two daemon binaries against a Redis Cluster
// that speaks only TLS and wants a password, configured by the flags alone
// (--remote-redis, --remote-tls, --remote-ca-file, --remote-password-file,
// --remote-key-file): a block one stores, the other loads byte-exact, and
// the value in the cluster carries the MAC.
func TestRemoteFlagsEndToEnd(t *testing.T) {
	if err := rediscluster.Available(); err != nil && !rediscluster.Required() {
		t.Skip(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const password = "s3cret-cluster-password"
	c, err := rediscluster.Start(ctx, rediscluster.Options{TLS: true, Password: password})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	dir := t.TempDir()
	pw, key := filepath.Join(dir, "password"), filepath.Join(dir, "key")
	os.WriteFile(pw, []byte(password+"\n"), 0o600)
	os.WriteFile(key, []byte("fleet-key-material-of-at-least-32-bytes\n"), 0o600)
	bin := buildDaemon(t)
	start := func(name string) (*testenv.Model, *pb.RegisterResponse, *testenv.Region, func([]*pb.Job) []*pb.JobResult, func([]*pb.Job) []*pb.JobResult, func([][]byte) *pb.LookupResponse) {
		sock := filepath.Join(t.TempDir(), name+".sock")
		_, cl, _ := startDaemon(t, bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "64MiB",
			"--remote-redis", c.Addrs()[0], "--remote-tls", "--remote-ca-file", c.CAFile(),
			"--remote-password-file", pw, "--remote-key-file", key)
		m := testenv.Model{Layers: 2, SegBytes: 32 << 10, Blocks: 16, HashBytes: 16}
		r := testenv.NewRegion(t, m.RegionBytes())
		reg, err := cl.Register(ctx, []byte("flags-e2e"), m.Layout(), m.Regions(r), name)
		if err != nil {
			t.Fatal(err)
		}
		store := func(jobs []*pb.Job) []*pb.JobResult {
			res, err := cl.Store(ctx, reg.RegistrationId, jobs, true)
			if err != nil {
				t.Fatal(err)
			}
			return res
		}
		load := func(jobs []*pb.Job) []*pb.JobResult {
			res, err := cl.Load(ctx, reg.RegistrationId, jobs, true)
			if err != nil {
				t.Fatal(err)
			}
			return res
		}
		lookup := func(hs [][]byte) *pb.LookupResponse {
			lr, err := cl.Lookup(ctx, []uint32{reg.NamespaceId}, testenv.Keys(hs...), 0)
			if err != nil {
				t.Fatal(err)
			}
			return lr
		}
		return &m, reg, r, store, load, lookup
	}
	ma, _, ra, storeA, _, _ := start("a")
	mb, _, rb, _, loadB, lookupB := start("b")
	hs := [][]byte{ma.Hash(9, 0), ma.Hash(9, 1), ma.Hash(9, 2)}
	for i, h := range hs {
		ma.Fill(ra, i, h)
	}
	if res := storeA([]*pb.Job{testenv.Job(1, hs, []uint32{0, 1, 2})}); !res[0].Ok {
		t.Fatalf("store: %+v", res[0])
	}
	// A publishes write-behind; B sees the blocks once they are there.
	deadline := time.Now().Add(30 * time.Second)
	for {
		lr := lookupB(hs)
		if lr.Ready == 3 && lr.Tiers[0] == pb.Tier_TIER_REMOTE {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("B never saw A's blocks: %+v", lr)
		}
		time.Sleep(20 * time.Millisecond)
	}
	res := loadB([]*pb.Job{testenv.Job(2, hs, []uint32{5, 6, 7})})
	if !res[0].Ok {
		t.Fatalf("load: %+v", res[0])
	}
	for i, h := range hs {
		if err := mb.Check(rb, 5+i, h); err != nil {
			t.Fatal(err)
		}
	}
	// Every value is in the keyed keyspace and carries the MAC.
	mac, err := remote.LoadMAC(key)
	if err != nil {
		t.Fatal(err)
	}
	var keyed, open int
	for _, n := range c.Nodes() {
		cl := n.Client()
		for pattern, count := range map[string]*int{remote.KeyPrefix + mac.ID() + ":*": &keyed, remote.KeyPrefix + "open:*": &open} {
			ks, err := cl.Keys(ctx, pattern).Result()
			if err != nil {
				t.Fatal(err)
			}
			for _, k := range ks {
				if remote.IsRecordKey(k) {
					continue // a generation record, not a value
				}
				*count++
				v, err := cl.Get(ctx, k).Bytes()
				if err != nil {
					t.Fatal(err)
				}
				if len(v) < remote.HeaderSize || v[10] != 1 {
					t.Errorf("value %s carries no MAC", k)
				}
			}
		}
		cl.Close()
	}
	if keyed != 3 || open != 0 {
		t.Fatalf("%d values in the fleet's keyspace, %d open ones; want 3 and 0", keyed, open)
	}
}

// TestSecondDaemonOnRemoteStateDirRefuses: two daemons given one
// --remote-state-dir would overwrite each other's fences file (each
// forgetting the invalidations the other still owes the cluster). The
// second refuses to start, naming the directory and the first's pid; the
// first keeps serving, and once it has stopped the directory is free.
func TestSecondDaemonOnRemoteStateDirRefuses(t *testing.T) {
	bin := buildDaemon(t)
	dir := t.TempDir()
	args := func(sock string) []string {
		// The cluster is down: a warning, the daemon serves its local
		// tiers and keeps its fences file all the same.
		return []string{"--socket", sock, "--metrics-addr", "", "--cpu-bytes", "16MiB",
			"--remote-redis", "127.0.0.1:1", "--remote-timeout", "100ms", "--remote-state-dir", dir}
	}
	proc, c, exited := startDaemon(t, bin, args(filepath.Join(t.TempDir(), "a.sock"))...)

	out, err := refused(t, bin, args(filepath.Join(t.TempDir(), "b.sock"))...)
	holder := fmt.Sprintf("pid %d", proc.Process.Pid)
	if err == nil || !strings.Contains(string(out), "in use by another kvoffloadd") || !strings.Contains(string(out), dir) || !strings.Contains(string(out), holder) {
		t.Fatalf("a second daemon on the same --remote-state-dir: %v\n%s\nwant a refusal naming %s and %s", err, out, dir, holder)
	}
	hctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if ok, err := c.Healthy(hctx); !ok {
		t.Fatalf("the first daemon stopped serving: %v", err)
	}

	proc.Process.Signal(syscall.SIGTERM)
	<-exited
	startDaemon(t, bin, args(filepath.Join(t.TempDir(), "c.sock"))...)
}

// refused runs the daemon binary expecting it to refuse to start: its exit
// error and its output. A daemon that serves instead fails the test.
func refused(t *testing.T, bin string, args ...string) ([]byte, error) {
	t.Helper()
	var out bytes.Buffer
	proc := exec.Command(bin, args...)
	proc.Stdout, proc.Stderr = &out, &out
	if err := proc.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- proc.Wait() }()
	c, err := client.Dial(args[1])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(time.Minute)
	for {
		select {
		case err := <-done:
			return out.Bytes(), err
		case <-time.After(20 * time.Millisecond):
		}
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		ok, _ := c.Healthy(ctx)
		cancel()
		if ok || time.Now().After(deadline) {
			proc.Process.Kill()
			<-done
			t.Fatalf("the daemon serves (or neither serves nor exits after a minute); want a refusal to start:\n%s", out.String())
		}
	}
}
