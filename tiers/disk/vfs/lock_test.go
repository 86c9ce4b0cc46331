package vfs_test

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

func TestLock(t *testing.T) {
	for _, be := range backends(t) {
		t.Run(be.name, func(t *testing.T) {
			path := filepath.Join(be.dir, "lock")
			l, err := be.fs.Lock(path)
			if err != nil {
				t.Fatal(err)
			}
			if l2, err := be.fs.Lock(path); !errors.Is(err, vfs.ErrLocked) {
				if l2 != nil {
					l2.Close()
				}
				t.Fatalf("second Lock while held: %v, want ErrLocked", err)
			}
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			l, err = be.fs.Lock(path)
			if err != nil {
				t.Fatalf("Lock after the holder let go: %v", err)
			}
			l.Close()
		})
	}
}

// The OS lock is flock(2): it excludes another process too, and that
// process is told who holds it.
func TestLockExcludesProcesses(t *testing.T) {
	if _, err := exec.LookPath("flock"); err != nil {
		t.Skip("no flock(1) to take the lock from another process")
	}
	path := filepath.Join(t.TempDir(), "lock")
	l, err := vfs.Default.Lock(path)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("flock", "--nonblock", path, "true").CombinedOutput()
	if err == nil {
		t.Errorf("another process took the lock while it was held: %s", out)
	}
	l.Close()
	if out, err := exec.Command("flock", "--nonblock", path, "sleep", "0").CombinedOutput(); err != nil {
		t.Fatalf("another process could not take the released lock: %v %s", err, out)
	}
	// Held by another process: refused, naming its pid.
	cmd := exec.Command("flock", path, "cat")
	stdin, _ := cmd.StdinPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); cmd.Wait() }()
	for {
		l, err := vfs.Default.Lock(path)
		if err == nil {
			l.Close() // flock(1) has not taken it yet
			continue
		}
		if !errors.Is(err, vfs.ErrLocked) {
			t.Fatalf("Lock held by another process: %v, want ErrLocked", err)
		}
		break
	}
	// flock(1) writes no pid; ours did, and the file keeps the last one.
	if b, _ := os.ReadFile(path); !strings.Contains(string(b), strconv.Itoa(os.Getpid())) {
		t.Errorf("lock file holds %q, want the pid of its last holder", b)
	}
}

// No call of the OS FS follows a symbolic link at the end of its path.
func TestSymlinksNotFollowed(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	dangling := filepath.Join(dir, "dangling")
	if err := os.Symlink(filepath.Join(dir, "nothing"), dangling); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{link, dangling} {
		for _, direct := range []bool{false, true} {
			f, err := vfs.Default.OpenFile(p, 1<<20, direct)
			if err == nil {
				f.Close()
				t.Errorf("OpenFile(%s, direct=%v) followed the link", p, direct)
			} else if !errors.Is(err, vfs.ErrSymlink) || !strings.Contains(err.Error(), p) {
				t.Errorf("OpenFile(%s): %v, want ErrSymlink naming the path", p, err)
			}
		}
		if l, err := vfs.Default.Lock(p); !errors.Is(err, vfs.ErrSymlink) {
			if l != nil {
				l.Close()
			}
			t.Errorf("Lock(%s): %v, want ErrSymlink", p, err)
		}
	}
	fi, err := vfs.Default.Stat(link)
	if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
		t.Errorf("Stat(link) = %v, %v; want the link itself", fi, err)
	}
	if b, _ := os.ReadFile(target); string(b) != "keep" {
		t.Errorf("target changed: %q", b)
	}
	if _, err := os.Stat(filepath.Join(dir, "nothing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a dangling link's target was created: %v", err)
	}
}
