package slot

import "errors"

// Errors from Decode, VerifyPayload and Check. They are wrapped with
// details; test them with errors.Is. Every one of them means the slot does
// not hold what the caller wants: on a read the block is reported failed,
// at recovery the slot is free space.
var (
	// ErrLength means a buffer or a length field is out of range: a header
	// block that is not HeaderSize bytes, a key hash longer than
	// MaxHashLen or empty, a payload length over MaxPayloadLen, or a
	// payload whose size differs from the header's payload length.
	ErrLength = errors.New("slot: bad length")

	// ErrEmpty means the header block is all zeros: the slot was never
	// written (preallocated space) or was erased. It is free space, not
	// corruption.
	ErrEmpty = errors.New("slot: empty")

	// ErrBadMagic means the header block does not start with Magic: the
	// slot holds something that is not a slot header (garbage, or a write
	// that landed in the wrong place).
	ErrBadMagic = errors.New("slot: bad magic")

	// ErrBadVersion means the header was written in a format version this
	// build does not read.
	ErrBadVersion = errors.New("slot: unsupported format version")

	// ErrHeaderChecksum means the header block's crc32c does not match: a
	// torn header write or a corrupted header.
	ErrHeaderChecksum = errors.New("slot: header checksum mismatch")

	// ErrMalformed means a header with a good checksum breaks the format:
	// non-zero reserved bytes or key hash padding. Only a buggy or
	// hostile writer produces it.
	ErrMalformed = errors.New("slot: malformed header")

	// ErrPayloadChecksum means the payload does not hash to the header's
	// payload checksum: a torn slot write (new header, old payload, or the
	// reverse), or corrupted data.
	ErrPayloadChecksum = errors.New("slot: payload checksum mismatch")

	// ErrKeyMismatch means a valid header describes another block than the
	// one expected (another namespace, group or key hash).
	ErrKeyMismatch = errors.New("slot: header names another block")

	// ErrStale means a valid header for the expected block carries another
	// write than the one expected (epoch and sequence number differ): a
	// lost write left an older copy, or the slot was rewritten since.
	ErrStale = errors.New("slot: stale write")

	// ErrMisplaced means a valid header was read from another slot than
	// the one it was written for: a misdirected write, or a file that was
	// copied or cut into slots differently.
	ErrMisplaced = errors.New("slot: header belongs to another slot")
)
