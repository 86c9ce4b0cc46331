package disk

import "errors"

// Errors a request's done callback gets. They wrap the cause (an errno, a
// slot.Err* sentinel); test them with errors.Is.
var (
	// ErrIO means the device failed the transfer: EIO, a short read, a
	// torn or refused write (ENOSPC included), or a chunk map that could
	// not be saved before a write. After a failed Read the caller
	// quarantines the slot (Space.Quarantine): the device may fail it
	// again. After a failed Write the block is not on disk.
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
