// Package vfs owns the filesystem seam of the disk tier: every open,
// read, write, preallocation and sync the disk tier does goes through FS
// and File, so tests can run it on memory (NewMem) and inject faults
// (package errorfs) without touching the code that drives it.
//
// # Basics
//
// Default is the operating system. OpenFile creates a file if it is
// missing, preallocates it (fallocate) when a size is given, and opens it
// with O_DIRECT when asked. NewMem is an in-memory FS with the same rules,
// sparse, so a test can preallocate gigabytes for free.
//
// # Alignment rule for direct files
//
// A File opened with direct=true only accepts ReadAt and WriteAt calls whose
// buffer address, file offset and length are all multiples of Alignment
// (4096 bytes). A call that breaks the rule fails with an error wrapping
// ErrMisaligned before it reaches the kernel, instead of the kernel's bare
// EINVAL; NewMem enforces the same rule so a test on memory catches what a
// disk would refuse. Buffers on the Go heap are not reliably aligned: the
// daemon's buffers come from its page-aligned host arena, and tests can take
// one from AlignedBuffer. A zero-length call is allowed and does nothing.
//
// # Caveats
//
// The disk tier is Linux-only: O_DIRECT and fallocate are Linux calls. Some
// filesystems refuse O_DIRECT with EINVAL at open (tmpfs before Linux 6.6,
// ramfs, some FUSE filesystems); ProbeDirect says so before the daemon
// relies on a directory. Since 6.6 tmpfs accepts O_DIRECT and ignores it,
// so a directory that passes the probe is not necessarily a disk.
package vfs

import (
	"fmt"
	"io"
	"os"
	"syscall"
	"unsafe"
)

// Alignment is the unit of direct I/O: buffer addresses, file offsets and
// lengths of direct reads and writes are multiples of it. 4096 covers both
// 512-byte-sector and 4Kn devices and the page size of the host arena.
const Alignment = 4096

// FS is a filesystem. Implementations are safe for concurrent use.
//
// No call follows a symbolic link at the last element of its path: a link
// planted where the disk tier keeps a file would otherwise make the daemon
// write through it into whatever it points at.
type FS interface {
	// OpenFile opens path for reading and writing, creating it (mode 0600)
	// if it does not exist. If size > 0 the file is then preallocated to at
	// least size bytes (see File.Preallocate); an existing larger file is
	// not shrunk. If direct is true the file is opened with O_DIRECT and
	// its reads and writes must follow the alignment rule. A symbolic link
	// at path is refused with an error wrapping ErrSymlink.
	OpenFile(path string, size int64, direct bool) (File, error)
	// Remove removes a file or an empty directory (a link itself, never
	// what it points at).
	Remove(path string) error
	// Stat describes path itself (lstat): a symbolic link is described as
	// one, not followed. A missing path gives an error matching
	// fs.ErrNotExist.
	Stat(path string) (os.FileInfo, error)
	// MkdirAll creates dir and any missing parents.
	MkdirAll(dir string, perm os.FileMode) error
	// Rename replaces newpath with oldpath atomically: a reader sees the
	// old file or the new one, never a mix. Both are in the same
	// directory. The change is durable only after SyncDir of it.
	Rename(oldpath, newpath string) error
	// SyncDir flushes dir's entries (creations, renames, removals) to
	// stable storage. Writing a small file durably is: write a temporary
	// file, Sync it, Rename it over the target, SyncDir the directory.
	SyncDir(dir string) error
	// Space describes the filesystem holding dir, so that a caller can
	// refuse, before it allocates anything, what would not fit.
	Space(dir string) (Space, error)
	// Lock takes an exclusive lock named by path (created if missing,
	// never through a symbolic link), held until the returned Closer is
	// closed or the process ends. A lock another holder has fails at once
	// with an error wrapping ErrLocked. On the OS it is flock(2) on the
	// file, so it also excludes other processes; the file records the
	// holder's pid for the error message of the next would-be holder.
	Lock(path string) (io.Closer, error)
}

// File is an open file. ReadAt and WriteAt are safe for concurrent use on
// disjoint or overlapping ranges (the result of overlapping concurrent
// writes is unspecified, as on a disk).
type File interface {
	// ReadAt reads len(p) bytes at off. As io.ReaderAt: fewer bytes come
	// with a non-nil error (io.EOF at the end of the file).
	io.ReaderAt
	// WriteAt writes p at off, extending the file if needed.
	io.WriterAt
	// Preallocate reserves disk space so that the file is at least size
	// bytes and writes below size cannot fail for lack of space. It never
	// shrinks the file.
	Preallocate(size int64) error
	// Sync flushes the file's data and metadata to stable storage.
	Sync() error
	// Close closes the file; later calls fail with an error matching
	// os.ErrClosed.
	Close() error
	// Name is the path the file was opened with.
	Name() string
}

// CheckAlignment reports whether a direct read or write of p at off keeps
// the alignment rule; the error wraps ErrMisaligned and says which of
// address, offset and length is off.
func CheckAlignment(p []byte, off int64) error {
	if len(p) == 0 {
		return nil
	}
	if addr := uintptr(unsafe.Pointer(&p[0])); addr%Alignment != 0 {
		return fmt.Errorf("%w: buffer address %#x is not a multiple of %d", ErrMisaligned, addr, Alignment)
	}
	if off < 0 {
		return fmt.Errorf("%w: offset %d is negative", ErrMisaligned, off)
	}
	if off%Alignment != 0 {
		return fmt.Errorf("%w: offset %d is not a multiple of %d", ErrMisaligned, off, Alignment)
	}
	if len(p)%Alignment != 0 {
		return fmt.Errorf("%w: length %d is not a multiple of %d", ErrMisaligned, len(p), Alignment)
	}
	return nil
}

// Space is what a filesystem has room for.
type Space struct {
	// Dev tells filesystems apart: directories with the same Dev share
	// their free space.
	Dev uint64
	// Free is the bytes an unprivileged writer may still allocate (statfs
	// f_bavail: a root-reserved part is not counted); Total the
	// filesystem's size.
	Free, Total uint64
}

// Allocated is the bytes of storage a file described by fi holds (its
// blocks, which a sparse file has fewer of than its size); its size where
// the FileInfo does not say (NewMem).
func Allocated(fi os.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Blocks) * 512
	}
	return uint64(fi.Size())
}
