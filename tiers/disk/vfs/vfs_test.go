package vfs_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// backend is one FS under test with a directory it may write in.
type backend struct {
	name string
	fs   vfs.FS
	dir  string
	// direct is false when the directory's filesystem refuses O_DIRECT.
	direct bool
}

func backends(t *testing.T) []backend {
	t.Helper()
	dir := t.TempDir()
	direct := true
	if err := vfs.ProbeDirect(dir); err != nil {
		if !errors.Is(err, vfs.ErrDirectUnsupported) {
			t.Fatalf("ProbeDirect(%s): %v", dir, err)
		}
		t.Logf("%s refuses O_DIRECT, direct cases skipped on the OS FS: %v", dir, err)
		direct = false
	}
	mem := vfs.NewMem()
	if err := mem.MkdirAll("/data", 0o700); err != nil {
		t.Fatal(err)
	}
	return []backend{
		{name: "os", fs: vfs.Default, dir: dir, direct: direct},
		{name: "mem", fs: mem, dir: "/data", direct: true},
	}
}

func alignedBuf(t *testing.T, n int) []byte {
	t.Helper()
	b, err := vfs.AlignedBuffer(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := vfs.FreeBuffer(b); err != nil {
			t.Errorf("FreeBuffer: %v", err)
		}
	})
	return b
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = seed + byte(i*31)
	}
}

func TestOpenPreallocate(t *testing.T) {
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			path := filepath.Join(be.dir, "slots")
			f, err := be.fs.OpenFile(path, 1<<20, false)
			if err != nil {
				t.Fatal(err)
			}
			if f.Name() != path {
				t.Errorf("Name() = %q, want %q", f.Name(), path)
			}
			fi, err := be.fs.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Size() != 1<<20 || fi.IsDir() {
				t.Errorf("after OpenFile(size=1MiB): size %d dir %v", fi.Size(), fi.IsDir())
			}
			if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Blocks*512 < 1<<20 {
				t.Errorf("only %d bytes allocated for a 1 MiB preallocation: space was not reserved", st.Blocks*512)
			}
			// Preallocation never shrinks, neither by Preallocate nor by reopening smaller.
			if err := f.Preallocate(4096); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
			f, err = be.fs.OpenFile(path, 8192, false)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if fi, _ := be.fs.Stat(path); fi.Size() != 1<<20 {
				t.Errorf("reopen with a smaller size: size %d, want %d", fi.Size(), 1<<20)
			}
			// Preallocated space reads as zeros.
			buf := make([]byte, 4096)
			fill(buf, 1)
			if n, err := f.ReadAt(buf, 1<<19); n != len(buf) || err != nil {
				t.Fatalf("ReadAt = %d, %v", n, err)
			}
			if !bytes.Equal(buf, make([]byte, 4096)) {
				t.Error("preallocated bytes are not zero")
			}
		})
	}
}

func TestReadWrite(t *testing.T) {
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			f, err := be.fs.OpenFile(filepath.Join(be.dir, "rw"), 0, false)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			// Unaligned writes across the 4 KiB page boundary, buffered file.
			data := make([]byte, 10000)
			fill(data, 3)
			if n, err := f.WriteAt(data, 1234); n != len(data) || err != nil {
				t.Fatalf("WriteAt = %d, %v", n, err)
			}
			got := make([]byte, len(data))
			if n, err := f.ReadAt(got, 1234); n != len(got) || err != nil {
				t.Fatalf("ReadAt = %d, %v", n, err)
			}
			if !bytes.Equal(got, data) {
				t.Error("read back different bytes")
			}
			// The hole before the first write reads as zeros.
			head := make([]byte, 1234)
			fill(head, 9)
			if _, err := f.ReadAt(head, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(head, make([]byte, 1234)) {
				t.Error("hole is not zero")
			}
			// Reading across the end is short with io.EOF.
			end := int64(1234 + len(data))
			n, err := f.ReadAt(make([]byte, 100), end-40)
			if n != 40 || !errors.Is(err, io.EOF) {
				t.Errorf("read across the end = %d, %v; want 40, io.EOF", n, err)
			}
			if n, err := f.ReadAt(make([]byte, 10), end+10); n != 0 || !errors.Is(err, io.EOF) {
				t.Errorf("read past the end = %d, %v; want 0, io.EOF", n, err)
			}
			if err := f.Sync(); err != nil {
				t.Errorf("Sync: %v", err)
			}
		})
	}
}

func TestClosedFile(t *testing.T) {
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			f, err := be.fs.OpenFile(filepath.Join(be.dir, "closed"), 4096, false)
			if err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 16)
			ops := map[string]error{
				"read":        func() error { _, err := f.ReadAt(buf, 0); return err }(),
				"write":       func() error { _, err := f.WriteAt(buf, 0); return err }(),
				"sync":        f.Sync(),
				"preallocate": f.Preallocate(8192),
				"close":       f.Close(),
			}
			for op, err := range ops {
				if !errors.Is(err, os.ErrClosed) {
					t.Errorf("%s after Close: %v, want os.ErrClosed", op, err)
				}
			}
		})
	}
}

func TestNamespace(t *testing.T) {
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			sub := filepath.Join(be.dir, "a", "b")
			if _, err := be.fs.OpenFile(filepath.Join(sub, "f"), 0, false); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("open in a missing directory: %v, want fs.ErrNotExist", err)
			}
			if err := be.fs.MkdirAll(sub, 0o700); err != nil {
				t.Fatal(err)
			}
			if fi, err := be.fs.Stat(sub); err != nil || !fi.IsDir() {
				t.Fatalf("Stat(dir) = %v, %v", fi, err)
			}
			path := filepath.Join(sub, "f")
			f, err := be.fs.OpenFile(path, 0, false)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt([]byte("kept"), 0); err != nil {
				t.Fatal(err)
			}
			if err := be.fs.Remove(sub); err == nil {
				t.Error("removed a non-empty directory")
			}
			if err := be.fs.Remove(path); err != nil {
				t.Fatal(err)
			}
			if _, err := be.fs.Stat(path); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("Stat after Remove: %v, want fs.ErrNotExist", err)
			}
			if err := be.fs.Remove(path); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("second Remove: %v, want fs.ErrNotExist", err)
			}
			// An open handle still reads a removed file, as on Linux.
			got := make([]byte, 4)
			if _, err := f.ReadAt(got, 0); err != nil || string(got) != "kept" {
				t.Errorf("read of a removed open file = %q, %v", got, err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
			if err := be.fs.Remove(sub); err != nil {
				t.Errorf("remove of an empty directory: %v", err)
			}
		})
	}
}

func TestDirectAlignment(t *testing.T) {
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			if !be.direct {
				t.Skipf("%s refuses O_DIRECT", be.dir)
			}
			f, err := be.fs.OpenFile(filepath.Join(be.dir, "direct"), 64<<10, true)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			buf := alignedBuf(t, 3*vfs.Alignment)
			fill(buf, 5)

			// Aligned round trip.
			if n, err := f.WriteAt(buf[:2*vfs.Alignment], vfs.Alignment); n != 2*vfs.Alignment || err != nil {
				t.Fatalf("aligned WriteAt = %d, %v", n, err)
			}
			got := alignedBuf(t, 2*vfs.Alignment)
			if n, err := f.ReadAt(got, vfs.Alignment); n != len(got) || err != nil {
				t.Fatalf("aligned ReadAt = %d, %v", n, err)
			}
			if !bytes.Equal(got, buf[:2*vfs.Alignment]) {
				t.Error("direct read back different bytes")
			}

			bad := []struct {
				name string
				p    []byte
				off  int64
			}{
				{"address", buf[512 : 512+vfs.Alignment], 0},
				{"offset", buf[:vfs.Alignment], 512},
				{"length", buf[:vfs.Alignment+512], 0},
				{"negative", buf[:vfs.Alignment], -vfs.Alignment},
			}
			for _, c := range bad {
				if n, err := f.WriteAt(c.p, c.off); n != 0 || !errors.Is(err, vfs.ErrMisaligned) {
					t.Errorf("misaligned %s WriteAt = %d, %v; want 0, ErrMisaligned", c.name, n, err)
				}
				if n, err := f.ReadAt(c.p, c.off); n != 0 || !errors.Is(err, vfs.ErrMisaligned) {
					t.Errorf("misaligned %s ReadAt = %d, %v; want 0, ErrMisaligned", c.name, n, err)
				}
			}
			// The refused writes changed nothing.
			if _, err := f.ReadAt(got[:vfs.Alignment], 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got[:vfs.Alignment], make([]byte, vfs.Alignment)) {
				t.Error("a refused misaligned write reached the file")
			}
			if n, err := f.WriteAt(nil, 0); n != 0 || err != nil {
				t.Errorf("empty direct write = %d, %v; want 0, nil", n, err)
			}
		})
	}
}

func TestProbeDirect(t *testing.T) {
	t.Run("missing", func(t *testing.T) {
		err := vfs.ProbeDirect(filepath.Join(t.TempDir(), "missing"))
		if err == nil || errors.Is(err, vfs.ErrDirectUnsupported) {
			t.Errorf("ProbeDirect(missing dir) = %v; want a plain error", err)
		}
	})
	t.Run("tmpfs", func(t *testing.T) {
		// tmpfs refused O_DIRECT before Linux 6.6 and accepts it since: both
		// are right, but the probe and OpenFile must agree.
		const dir = "/dev/shm"
		var st unix.Statfs_t
		if err := unix.Statfs(dir, &st); err != nil || st.Type != unix.TMPFS_MAGIC || unix.Access(dir, unix.W_OK) != nil {
			t.Skipf("%s is not a writable tmpfs", dir)
		}
		probe := vfs.ProbeDirect(dir)
		if probe != nil && !errors.Is(probe, vfs.ErrDirectUnsupported) {
			t.Fatalf("ProbeDirect(tmpfs) = %v; want nil or ErrDirectUnsupported", probe)
		}
		t.Logf("ProbeDirect(%s) = %v", dir, probe)
		path := filepath.Join(dir, fmt.Sprintf("kvoffloadd-vfs-test-%d", os.Getpid()))
		f, err := vfs.Default.OpenFile(path, 0, true)
		if err == nil {
			f.Close()
			os.Remove(path)
		}
		if (probe == nil) != (err == nil) || (err != nil && !errors.Is(err, vfs.ErrDirectUnsupported)) {
			t.Errorf("ProbeDirect = %v but OpenFile(direct) = %v", probe, err)
		}
		if left, _ := filepath.Glob(filepath.Join(dir, ".kvoffloadd-direct-probe-*")); len(left) > 0 {
			t.Errorf("probe left files behind: %v", left)
		}
	})
}

func TestAlignedBuffer(t *testing.T) {
	for _, n := range []int{1, vfs.Alignment, 3*vfs.Alignment + 5, 2 << 20} {
		b := alignedBuf(t, n)
		if len(b) != n {
			t.Errorf("AlignedBuffer(%d): len %d", n, len(b))
		}
		if err := vfs.CheckAlignment(b[:n/vfs.Alignment*vfs.Alignment], 0); err != nil {
			t.Errorf("AlignedBuffer(%d): %v", n, err)
		}
		if !bytes.Equal(b, make([]byte, n)) {
			t.Errorf("AlignedBuffer(%d) is not zeroed", n)
		}
		fill(b, 1) // writable
	}
	if _, err := vfs.AlignedBuffer(0); err == nil {
		t.Error("AlignedBuffer(0) succeeded")
	}
}

func TestRenameSyncDir(t *testing.T) {
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			write := func(path, s string) {
				f, err := be.fs.OpenFile(path, 0, false)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				if _, err := f.WriteAt([]byte(s), 0); err != nil {
					t.Fatal(err)
				}
			}
			dst, tmp := filepath.Join(be.dir, "catalog"), filepath.Join(be.dir, "catalog.tmp")
			write(dst, "old")
			write(tmp, "new")
			if err := be.fs.Rename(tmp, dst); err != nil {
				t.Fatal(err)
			}
			if err := be.fs.SyncDir(be.dir); err != nil {
				t.Errorf("SyncDir: %v", err)
			}
			if _, err := be.fs.Stat(tmp); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("Stat of the renamed file: %v, want fs.ErrNotExist", err)
			}
			f, err := be.fs.OpenFile(dst, 0, false)
			if err != nil {
				t.Fatal(err)
			}
			got := make([]byte, 3)
			if _, err := f.ReadAt(got, 0); err != nil || string(got) != "new" {
				t.Errorf("after Rename: %q, %v; want the new contents", got, err)
			}
			f.Close()
			if err := be.fs.Rename(tmp, dst); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("Rename of a missing file: %v, want fs.ErrNotExist", err)
			}
			if err := be.fs.SyncDir(filepath.Join(be.dir, "missing")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("SyncDir of a missing directory: %v, want fs.ErrNotExist", err)
			}
		})
	}
}
