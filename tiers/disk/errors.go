package disk

import (
	"errors"
	"syscall"
)

// Errors a request's done callback gets. They wrap the cause (an errno, a
// slot.Err* sentinel); test them with errors.Is.
var (
	// ErrIO means the device failed the transfer: EIO, a short read, a
	// torn or refused write (ENOSPC included), or a chunk map that could
	// not be saved before a write. After a failed Write the block is not
	// on disk. Whether the slot itself is to blame (quarantine it) or
	// not (free it), ShouldQuarantine says.
	ErrIO = errors.New("disk tier: I/O error")

	// ErrCorrupt means a Read returned, but what it read is not the block
	// the caller asked for: a bad header or payload checksum, another key,
	// another slot, another write (stale), another length, or a slot whose
	// last write failed. The bytes in dst must not be used. The caller
	// frees the slot (Release): the device is fine, the slot can be
	// written again.
	ErrCorrupt = errors.New("disk tier: slot does not hold the block")

	// ErrInvalid means a request does not fit its slot: the slot is not a
	// slot of a chunk of SlotBytes(PayloadLen) bytes, a buffer is not
	// layout.AlignUp(PayloadLen) bytes, the key hash is empty or too long.
	// It is a bug in the caller; nothing was transferred.
	ErrInvalid = errors.New("disk tier: invalid request")

	// ErrClosed means the request came after Close; its done callback runs
	// on the caller's goroutine, before Write, Read or Discard returns.
	ErrClosed = errors.New("disk tier: closed")
)

// errSlotDevice marks the ErrIO of a transfer of the slot itself that the
// device failed, as opposed to a chunk map that could not be saved first.
var errSlotDevice = errors.New("the device failed the slot's transfer")

// ShouldQuarantine reports whether the slot of a failed Read or Write is to
// be taken out of use (Space.Quarantine): the device failed the slot's own
// transfer (EIO, a short read, a torn write), so it may fail it again.
// Nothing else quarantines a healthy slot: ErrCorrupt (the slot is fine,
// its bytes are not the block's), ErrClosed, ErrInvalid, a write refused
// because its chunk map could not be saved (the slot was never written),
// and ENOSPC on the preallocated file (the filesystem's fault, not the
// slot's) free the slot instead.
func ShouldQuarantine(err error) bool {
	return errors.Is(err, errSlotDevice) && !errors.Is(err, syscall.ENOSPC)
}
