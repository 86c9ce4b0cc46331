package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// SmallExt4 mounts a fresh ext4 filesystem of size bytes (a loop-mounted
// image in a temporary directory, 4KiB blocks, which takes O_DIRECT as a
// disk does) and returns its mount point, unmounted and removed when the
// test ends. It skips, saying why, where the test is not root or the
// kernel refuses the mount (CI and the test machine run as root).
func SmallExt4(t testing.TB, size int64) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small filesystem (CI runs as root)")
	}
	dir := t.TempDir()
	img, mnt := filepath.Join(dir, "fs.img"), filepath.Join(dir, "mnt")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	err = f.Truncate(size)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-b", "4096", "-m", "0", img).CombinedOutput(); err != nil {
		t.Skipf("mkfs.ext4: %v: %s", err, out)
	}
	mount(t, mnt, "-o", "loop", img)
	return mnt
}

// SmallTmpfs mounts a tmpfs of size bytes and returns its mount point,
// unmounted when the test ends; it skips as SmallExt4 does.
func SmallTmpfs(t testing.TB, size int64) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small filesystem (CI runs as root)")
	}
	mnt := filepath.Join(t.TempDir(), "tmpfs")
	mount(t, mnt, "-t", "tmpfs", "-o", fmt.Sprintf("size=%d,mode=0700", size), "tmpfs")
	return mnt
}

func mount(t testing.TB, mnt string, args ...string) {
	t.Helper()
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", append(args, mnt)...).CombinedOutput(); err != nil {
		t.Skipf("mount %v %s is not permitted here: %v: %s", args, mnt, err, out)
	}
	// Registered after TempDir's removal, so it runs first.
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			// Busy (a process of the test still in it): detach it now,
			// the kernel frees it when the last user goes.
			if out2, err2 := exec.Command("umount", "-l", mnt).CombinedOutput(); err2 != nil {
				t.Errorf("umount %s: %v: %s; %v: %s", mnt, err, out, err2, out2)
			}
		}
	})
}
