package vfs_test

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// TestPreallocateFailureGivesSpaceBack, on a real 64MiB ext4 filesystem: a
// preallocation that runs out of space midway leaves no file it created,
// and an existing file at its old size with its old blocks; Space reports
// the free space the next start needs (issue 30, 4).
func TestPreallocateFailureGivesSpaceBack(t *testing.T) {
	mnt := testenv.SmallExt4(t, 64<<20)
	sp, err := vfs.Default.Space(mnt)
	if err != nil || sp.Free == 0 || sp.Total < sp.Free {
		t.Fatalf("Space: %+v %v", sp, err)
	}
	path := filepath.Join(mnt, "f")
	if _, err := vfs.Default.OpenFile(path, 1<<30, true); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("preallocating 1GiB on 64MiB: %v, want ENOSPC", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("the failed preallocation left the file it created: %v", err)
	}
	if sp2, _ := vfs.Default.Space(mnt); sp2.Free != sp.Free {
		t.Fatalf("free space %d after the failed preallocation, was %d", sp2.Free, sp.Free)
	}

	f, err := vfs.Default.OpenFile(path, 16<<20, true)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	before, _ := os.Stat(path)
	sp3, _ := vfs.Default.Space(mnt)
	if _, err := vfs.Default.OpenFile(path, 1<<30, true); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("growing to 1GiB on 64MiB: %v, want ENOSPC", err)
	}
	after, _ := os.Stat(path)
	if after.Size() != before.Size() || vfs.Allocated(after) != vfs.Allocated(before) {
		t.Fatalf("the failed preallocation left the file at %d bytes, %d allocated; it was %d, %d",
			after.Size(), vfs.Allocated(after), before.Size(), vfs.Allocated(before))
	}
	if sp4, _ := vfs.Default.Space(mnt); sp4.Free != sp3.Free {
		t.Fatalf("free space %d after the failed preallocation, was %d", sp4.Free, sp3.Free)
	}
}
