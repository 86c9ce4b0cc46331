package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// TestRecoveryChild is not a test of its own: TestKill9MidRecovery runs
// this test binary again with KVO_CHILD_ARGS set, and the process becomes
// the daemon (run, with those flags), its disk tier's recovery held after
// KVO_CHILD_ALLOW reads of a window, until it is killed.
func TestRecoveryChild(t *testing.T) {
	args := os.Getenv("KVO_CHILD_ARGS")
	if args == "" {
		t.Skip("the daemon process of TestKill9MidRecovery")
	}
	allow, err := strconv.Atoi(os.Getenv("KVO_CHILD_ALLOW"))
	if err != nil {
		t.Fatal(err)
	}
	testHookDiskFS = func(fs vfs.FS) vfs.FS { return testenv.NewGateFS(fs, 1<<20, allow) }
	err = run(context.Background(), strings.Split(args, "\n"), io.Discard, os.Stderr)
	t.Fatalf("the daemon returned before it was killed: %v", err)
}

// recModel has 16 KiB blocks: 20 KiB disk slots, 204 per 4 MiB chunk, so
// each chunk is one recovery read.
var recModel = testenv.Model{Layers: 2, SegBytes: 8 << 10, Blocks: 128}

const slotsPerChunk = 204

// storeAll stores hs 64 blocks per job (write-through) and waits until
// every one is on disk.
func storeAll(t *testing.T, c *client.Client, reg *pb.RegisterResponse, r *testenv.Region, hs [][]byte, id uint64) {
	t.Helper()
	ctx := context.Background()
	for i := 0; i < len(hs); i += 64 {
		part := hs[i:min(i+64, len(hs))]
		blocks := make([]uint32, len(part))
		for j, h := range part {
			blocks[j] = uint32(j)
			recModel.Fill(r, j, h)
		}
		res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(id+uint64(i), part, blocks)}, true)
		if err != nil || !res[0].Ok {
			t.Fatalf("store: %v %v", res, err)
		}
	}
	for { // the writes to disk run behind the stores
		onDisk := 0
		for i := 0; i < len(hs); i += 64 {
			part := hs[i:min(i+64, len(hs))]
			lr, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, testenv.Keys(part...), 0)
			if err != nil {
				t.Fatal(err)
			}
			for _, tier := range lr.Tiers {
				if tier == pb.Tier_TIER_CPU_AND_DISK || tier == pb.Tier_TIER_DISK {
					onDisk++
				}
			}
		}
		if onDisk == len(hs) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ready returns the hashes of hs that Lookup offers, looked up one by one.
func ready(t *testing.T, c *client.Client, reg *pb.RegisterResponse, hs [][]byte) [][]byte {
	t.Helper()
	var out [][]byte
	for _, h := range hs {
		lr, err := c.Lookup(context.Background(), []uint32{reg.NamespaceId}, testenv.Keys(h), 0)
		if err != nil {
			t.Fatal(err)
		}
		if lr.Ready == 1 {
			out = append(out, h)
		}
	}
	return out
}

// loadAllExact loads hs 64 per job and insists on every byte.
func loadAllExact(t *testing.T, c *client.Client, reg *pb.RegisterResponse, r *testenv.Region, hs [][]byte) {
	t.Helper()
	for i := 0; i < len(hs); i += 64 {
		part := hs[i:min(i+64, len(hs))]
		blocks := make([]uint32, len(part))
		for j := range part {
			blocks[j] = uint32(64 + j)
			clear(recModel.Segment(r, 0, 64+j))
		}
		res, err := c.Load(context.Background(), reg.RegistrationId, []*pb.Job{testenv.Job(uint64(1<<40+i), part, blocks)}, true)
		if err != nil || !res[0].Ok {
			t.Fatalf("load of offered blocks: %v %v", res, err)
		}
		for j, h := range part {
			if err := recModel.Check(r, int(blocks[j]), h); err != nil {
				t.Fatalf("block %x: %v", h[:8], err)
			}
		}
	}
}

// TestKill9MidRecovery: a daemon killed with SIGKILL in the middle of its
// disk tier's recovery (held there by a gate), after serving loads of
// what it had recovered and storing new blocks, loses nothing: the next
// start brings back every block, byte-exact.
func TestKill9MidRecovery(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(t.TempDir(), "kv.sock")
	args := daemonArgs(sock, dir, "--write-through", "--cpu-bytes", "32MiB")
	r := testenv.NewRegion(t, recModel.RegionBytes())
	ctx := context.Background()
	hash := func(seed uint64, n int) [][]byte {
		hs := make([][]byte, n)
		for i := range hs {
			hs[i] = recModel.Hash(seed, i)
		}
		return hs
	}

	// 1200 blocks on disk: six chunks.
	c, stop := runInProcess(t, args, io.Discard)
	reg, err := c.Register(ctx, []byte("kill9-recovery"), recModel.Layout(), recModel.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	stored := hash(1, 1200)
	storeAll(t, c, reg, r, stored, 0)
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	// The daemon in another process, recovery held after two chunks.
	var logs bytes.Buffer
	child := exec.Command(os.Args[0], "-test.run=^TestRecoveryChild$", "-test.count=1")
	child.Env = append(os.Environ(), "KVO_CHILD_ARGS="+strings.Join(args, "\n"), "KVO_CHILD_ALLOW=2")
	child.Stderr = &logs
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { child.Wait(); close(exited) }()
	t.Cleanup(func() {
		child.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("child daemon log:\n%s", logs.String())
		}
	})
	c2, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	waitHealthy(t, c2, child, exited, &logs)
	reg2, err := c2.Register(ctx, []byte("kill9-recovery"), recModel.Layout(), recModel.Regions(r), "test")
	if err != nil || !reg2.JoinedExisting {
		t.Fatalf("register on the restarted daemon: %v %v", reg2, err)
	}
	var rec *pb.DiskRecovery
	for { // until the two chunks the gate lets through are scanned
		st, err := c2.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if rec = st.DiskRecovery; rec.SlotsScanned == 2*slotsPerChunk {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	// (The store spread its blocks over the six chunks' slots in no
	// particular order: two chunks hold most of 408 blocks.)
	if rec.State != pb.RecoveryState_RECOVERY_STATE_RUNNING || rec.SlotsTotal != 6*slotsPerChunk || rec.BlocksRecovered == 0 || rec.BlocksRecovered >= uint64(len(stored)) {
		t.Fatalf("mid-recovery: %+v", rec)
	}
	online := ready(t, c2, reg2, stored)
	if uint64(len(online)) != rec.BlocksRecovered {
		t.Fatalf("%d blocks offered mid-recovery, recovery says %d are online", len(online), rec.BlocksRecovered)
	}
	loadAllExact(t, c2, reg2, r, online)
	fresh := hash(2, 300)
	storeAll(t, c2, reg2, r, fresh, 1<<20)

	if err := child.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-exited

	// The next start: everything, byte-exact.
	c3, _ := runInProcess(t, args, io.Discard)
	rec = waitRecovered(t, c3)
	if rec.State != pb.RecoveryState_RECOVERY_STATE_DONE || rec.BlocksRecovered != uint64(len(stored)+len(fresh)) || rec.BadSlots != 0 {
		t.Fatalf("after kill -9 mid-recovery, the next recovery: %+v; want %d blocks", rec, len(stored)+len(fresh))
	}
	reg3, err := c3.Register(ctx, []byte("kill9-recovery"), recModel.Layout(), recModel.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	all := append(append([][]byte{}, stored...), fresh...)
	if back := ready(t, c3, reg3, all); len(back) != len(all) {
		t.Fatalf("%d of %d blocks back after kill -9 mid-recovery", len(back), len(all))
	}
	loadAllExact(t, c3, reg3, r, all)
}
