package vfs

import "errors"

// ErrMisaligned means a direct read or write broke the alignment rule:
// its buffer address, offset or length is not a multiple of Alignment.
// It is a bug in the caller, never a disk fault.
var ErrMisaligned = errors.New("vfs: direct I/O not aligned")

// ErrDirectUnsupported means the filesystem refuses O_DIRECT (tmpfs does,
// answering EINVAL). The daemon should refuse to use such a directory as a
// disk tier, or run it without direct I/O if told to.
var ErrDirectUnsupported = errors.New("vfs: filesystem refuses O_DIRECT")

// ErrSymlink means a path the disk tier opens is a symbolic link (or a
// loop of them). The tier never follows one: whoever planted it could make
// the daemon write into any file it can write.
var ErrSymlink = errors.New("vfs: symbolic link refused")

// ErrLocked means a lock is held by someone else: another daemon uses the
// directory.
var ErrLocked = errors.New("vfs: locked by another holder")
