package offload

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/kvoffloadd/kvoffloadd/tiers/remote/fence"
)

// Sentinel errors. Every error the Service returns wraps one of these (or
// dma.ErrBadRegion / dma.ErrNoCUDA); rpc/server maps them to gRPC codes.
var (
	// ErrInvalid: a request field is malformed or out of bounds. The
	// message names the field.
	ErrInvalid = errors.New("invalid argument")
	// ErrUnknownNamespace: a namespace id that no Register returned.
	ErrUnknownNamespace = errors.New("unknown namespace")
	// ErrUnknownRegistration: the registration id is not (or no longer)
	// registered; its connection may have closed. Register again.
	ErrUnknownRegistration = errors.New("unknown registration")
	// ErrLayoutMismatch: the fingerprint is registered with another layout.
	ErrLayoutMismatch = errors.New("fingerprint already registered with a different layout")
	// ErrBacklog: the registration has too many unfinished or unread jobs;
	// read Completions before submitting more.
	ErrBacklog = errors.New("too many pending jobs")
	// ErrLimit: a bound on what clients may make the daemon hold was
	// reached (registrations, mapped regions, leases, pinned blocks,
	// namespaces, block sizes); the message names it and, where there is
	// one, its flag. Retry once some is given back, or raise the bound.
	ErrLimit = errors.New("limit reached")
	// ErrShuttingDown: the daemon is stopping and takes no new work.
	ErrShuttingDown = errors.New("daemon is shutting down")
	// ErrRemoteUnrecorded: an Invalidate dropped the blocks on this node,
	// but some of their generation records could not be written to the
	// remote tier (a master down, slow, failing over): other nodes may
	// still load them until a retry (in the background, or the call again)
	// writes them. The remote tier's fences return it.
	ErrRemoteUnrecorded = fence.ErrUnrecorded

	// The disk tier could not record what a call needed recorded (the
	// namespace catalog of a Register): the disk's fault, not the
	// caller's. storageError sorts an error into one of these.

	// ErrDiskFull: the disk tier's directory is out of space or quota
	// (ENOSPC, EDQUOT).
	ErrDiskFull = errors.New("disk tier out of space")
	// ErrDiskReadOnly: the disk tier's directory refuses writes (a
	// read-only filesystem, permissions): nothing will succeed there until
	// an operator fixes it.
	ErrDiskReadOnly = errors.New("disk tier directory not writable")
	// ErrDiskFailed: the disk tier's device failed the write (EIO and any
	// other error); a retry may succeed.
	ErrDiskFailed = errors.New("disk tier I/O failed")
)

// storageError wraps a failure of the disk tier's files with the sentinel
// that says what kind of failure it is.
func storageError(err error) error {
	switch {
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return fmt.Errorf("%w: %w", ErrDiskFull, err)
	case errors.Is(err, syscall.EROFS), errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return fmt.Errorf("%w: %w", ErrDiskReadOnly, err)
	default:
		return fmt.Errorf("%w: %w", ErrDiskFailed, err)
	}
}
