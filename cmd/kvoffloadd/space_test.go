package main

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// refusedStart runs the daemon with args, which must refuse to start: it
// returns what it printed.
func refusedStart(t *testing.T, bin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 {
		t.Fatalf("kvoffloadd %v: %v, want a refused start (exit status 1); output:\n%s", args, err, out)
	}
	return string(out)
}

// fileState is what a refused start must leave as it was: a file's size,
// its allocated blocks and its bytes.
func fileState(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("size %d, %d blocks, sha256 %x", st.Size, st.Blocks, h.Sum(nil))
}

func freeBytes(t *testing.T, dir string) uint64 {
	t.Helper()
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return st.Bavail * uint64(st.Bsize)
}

// TestDiskTierThatCannotFitIsRefused, on a real 320MiB ext4 filesystem: a
// --disk-bytes larger than the free space is refused before anything is
// allocated, with a message giving the free space and what fits; a refused
// start leaves an existing tier exactly as it was, and the next start with
// the right size serves its blocks; the size the message offers starts and
// leaves the reserve free (issue 30, 4).
func TestDiskTierThatCannotFitIsRefused(t *testing.T) {
	mnt := testenv.SmallExt4(t, 320<<20)
	bin := buildDaemon(t)
	dir := filepath.Join(mnt, "kv")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "kv.sock")
	args := func(diskBytes string) []string {
		return []string{"--socket", sock, "--metrics-addr", "", "--cpu-bytes", "8MiB", "--cpu-chunk-bytes", "4MiB",
			"--disk-dir", dir, "--disk-bytes", diskBytes, "--disk-chunk-bytes", "4MiB", "--write-through"}
	}
	slotFile := filepath.Join(dir, "kvoffload-0.slots")
	free := freeBytes(t, mnt)
	wantRefusal := regexp.MustCompile(`not enough free space in ` + regexp.QuoteMeta(dir) + `: 1 slot file\(s\) of 2GiB need \S+ more, and the filesystem has \S+ free, of which the tier leaves \S+ \(5% of its \S+, at most 1GiB\); at most (\d+MiB) per directory fits there`)

	// An empty directory: refused, nothing allocated.
	out := refusedStart(t, bin, args("2GiB")...)
	if !wantRefusal.MatchString(out) {
		t.Fatalf("refusal does not give the free space and what fits:\n%s", out)
	}
	if _, err := os.Stat(slotFile); !os.IsNotExist(err) {
		t.Fatalf("a refused start left a slot file: %v", err)
	}
	if got := freeBytes(t, mnt); got+1<<20 < free {
		t.Fatalf("a refused start took %d bytes of the filesystem", free-got)
	}

	// A 128MiB tier holding a block.
	proc, c, exited := startDaemon(t, bin, args("128MiB")...)
	waitRecovered(t, c)
	ctx := context.Background()
	m := testenv.Model{Layers: 2, SegBytes: 64 << 10, Blocks: 4}
	_, r, h := storeOne(t, c, m, "space", 1)
	for deadline := time.Now().Add(60 * time.Second); ; {
		st, err := c.Stats(ctx)
		if err == nil && len(st.Tiers) == 2 && st.Tiers[1].Blocks == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the block is not on disk after 60s: %v %v", st, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	proc.Process.Signal(syscall.SIGTERM)
	<-exited
	before := fileState(t, slotFile)

	// Too large again: refused, the tier as it was.
	out = refusedStart(t, bin, args("2GiB")...)
	fits := wantRefusal.FindStringSubmatch(out)
	if fits == nil {
		t.Fatalf("refusal does not give the free space and what fits:\n%s", out)
	}
	if after := fileState(t, slotFile); after != before {
		t.Fatalf("a refused start changed the tier: %s, was %s", after, before)
	}

	// The right size: the block comes back.
	proc2, c2, exited2 := startDaemon(t, bin, args("128MiB")...)
	waitRecovered(t, c2)
	reg2, err := c2.Register(ctx, []byte("space"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	if ok, tier := lookupTier(t, c2, reg2.NamespaceId, h); !ok || tier != pb.Tier_TIER_DISK {
		t.Fatalf("after a refused start the block is not offered from disk: %v %v", ok, tier)
	}
	proc2.Process.Signal(syscall.SIGTERM)
	<-exited2

	// What the refusal said fits, fits, and leaves the reserve free (but
	// for the few KiB of the chunk map and catalog written after it).
	proc3, c3, exited3 := startDaemon(t, bin, args(fits[1])...)
	waitRecovered(t, c3)
	var st syscall.Statfs_t
	if err := syscall.Statfs(mnt, &st); err != nil {
		t.Fatal(err)
	}
	reserve := st.Blocks * uint64(st.Bsize) / 20
	if left := st.Bavail * uint64(st.Bsize); left+1<<20 < reserve {
		t.Fatalf("a tier of %s left %d bytes free, less than the reserve %d", fits[1], left, reserve)
	}
	proc3.Process.Signal(syscall.SIGTERM)
	<-exited3
}
