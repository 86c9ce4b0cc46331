package vfs

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// Default is the operating system's filesystem.
var Default FS = osFS{}

type osFS struct{}

func (osFS) OpenFile(path string, size int64, direct bool) (File, error) {
	flag := os.O_RDWR | os.O_CREATE | unix.O_NOFOLLOW
	if direct {
		flag |= unix.O_DIRECT
	}
	fi, _ := os.Lstat(path) // nil: OpenFile creates it
	f, err := os.OpenFile(path, flag, 0o600)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return nil, symlinkError(err, path)
		}
		if direct {
			return nil, directError(err, path)
		}
		return nil, err
	}
	file := &osFile{f: f, direct: direct}
	if size > 0 {
		if err := file.Preallocate(size); err != nil {
			return nil, errors.Join(err, undoPreallocate(f, fi, path), f.Close())
		}
	}
	return file, nil
}

// undoPreallocate gives back what a failed preallocation took (ENOSPC
// midway leaves blocks allocated, past the end of the file or in it): a
// file it created is removed; an existing one is cut back to its old size,
// through one byte more so that the filesystem frees every block past it.
func undoPreallocate(f *os.File, before os.FileInfo, path string) error {
	if before == nil {
		return os.Remove(path)
	}
	size := before.Size()
	return errors.Join(f.Truncate(size+1), f.Truncate(size))
}

func (osFS) Space(dir string) (Space, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return Space{}, &os.PathError{Op: "statfs", Path: dir, Err: err}
	}
	var ds unix.Stat_t
	if err := unix.Stat(dir, &ds); err != nil {
		return Space{}, &os.PathError{Op: "stat", Path: dir, Err: err}
	}
	return Space{Dev: ds.Dev, Free: st.Bavail * uint64(st.Bsize), Total: st.Blocks * uint64(st.Bsize)}, nil
}

func (osFS) Remove(path string) error                    { return os.Remove(path) }
func (osFS) Stat(path string) (os.FileInfo, error)       { return os.Lstat(path) }
func (osFS) MkdirAll(dir string, perm os.FileMode) error { return os.MkdirAll(dir, perm) }
func (osFS) Rename(oldpath, newpath string) error        { return os.Rename(oldpath, newpath) }

func (osFS) SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	return errors.Join(d.Sync(), d.Close())
}

func (osFS) Lock(path string) (io.Closer, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return nil, symlinkError(err, path)
		}
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			holder := make([]byte, 32)
			n, _ := f.ReadAt(holder, 0)
			f.Close()
			return nil, fmt.Errorf("%w: %s (held by pid %s)", ErrLocked, path, bytes.TrimSpace(holder[:n]))
		}
		f.Close()
		return nil, &os.PathError{Op: "flock", Path: path, Err: err}
	}
	// Who holds it, for the next one's error message; the lock, not the
	// contents, is what excludes.
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}

// symlinkError explains the ELOOP of an O_NOFOLLOW open.
func symlinkError(err error, path string) error {
	return fmt.Errorf("%w: %s is a symbolic link; refusing to follow it: %w", ErrSymlink, path, err)
}

type osFile struct {
	f      *os.File
	direct bool
}

func (f *osFile) ReadAt(p []byte, off int64) (int, error) {
	if f.direct {
		if err := CheckAlignment(p, off); err != nil {
			return 0, fmt.Errorf("read %s: %w", f.f.Name(), err)
		}
	}
	return f.f.ReadAt(p, off)
}

func (f *osFile) WriteAt(p []byte, off int64) (int, error) {
	if f.direct {
		if err := CheckAlignment(p, off); err != nil {
			return 0, fmt.Errorf("write %s: %w", f.f.Name(), err)
		}
	}
	return f.f.WriteAt(p, off)
}

func (f *osFile) Preallocate(size int64) error {
	if size <= 0 {
		return nil
	}
	rc, err := f.f.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	err = rc.Control(func(fd uintptr) {
		// Mode 0 allocates blocks and extends the size; it never shrinks,
		// and a large allocation may be interrupted by a signal.
		for {
			ferr = unix.Fallocate(int(fd), 0, 0, size)
			if ferr != unix.EINTR {
				return
			}
		}
	})
	if err != nil {
		// Control fails only once the file is closed.
		return &os.PathError{Op: "fallocate", Path: f.f.Name(), Err: fmt.Errorf("%w (%w)", os.ErrClosed, err)}
	}
	if ferr != nil {
		return &os.PathError{Op: "fallocate", Path: f.f.Name(), Err: ferr}
	}
	return nil
}

func (f *osFile) Sync() error  { return f.f.Sync() }
func (f *osFile) Close() error { return f.f.Close() }
func (f *osFile) Name() string { return f.f.Name() }

// directError explains the EINVAL of an O_DIRECT open: the filesystem of
// path does not do direct I/O.
func directError(err error, path string) error {
	if !errors.Is(err, unix.EINVAL) {
		return err
	}
	return fmt.Errorf("%w: the filesystem of %s has no direct I/O (tmpfs before Linux 6.6, for example): %w", ErrDirectUnsupported, path, err)
}

// ProbeDirect tells whether the filesystem holding dir accepts O_DIRECT
// reads and writes of Alignment-sized aligned blocks. It writes, reads back
// and removes one small temporary file. A filesystem that refuses (tmpfs
// does, with EINVAL at open) gives an error wrapping ErrDirectUnsupported;
// any other failure (missing directory, no permission) is returned as is.
// tmpfs accepts O_DIRECT since Linux 6.6 (the flag is then a no-op there).
func ProbeDirect(dir string) error {
	tmp, err := os.CreateTemp(dir, ".kvoffloadd-direct-probe-*")
	if err != nil {
		return err
	}
	name := tmp.Name()
	defer os.Remove(name)
	if err := tmp.Close(); err != nil {
		return err
	}

	f, err := os.OpenFile(name, os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		return directError(err, dir)
	}
	defer f.Close()

	buf, err := AlignedBuffer(2 * Alignment)
	if err != nil {
		return err
	}
	defer FreeBuffer(buf)
	out, in := buf[:Alignment], buf[Alignment:]
	for i := range out {
		out[i] = byte(i*7 + 1)
	}
	if _, err := f.WriteAt(out, 0); err != nil {
		if errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("%w: %s accepts O_DIRECT at open but refuses an aligned %d-byte write: %w", ErrDirectUnsupported, filepath.Clean(dir), Alignment, err)
		}
		return err
	}
	if _, err := f.ReadAt(in, 0); err != nil {
		if errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("%w: %s accepts O_DIRECT at open but refuses an aligned %d-byte read: %w", ErrDirectUnsupported, filepath.Clean(dir), Alignment, err)
		}
		return err
	}
	if !bytes.Equal(in, out) {
		return fmt.Errorf("vfs: direct I/O probe in %s read back different bytes than it wrote", dir)
	}
	return nil
}
