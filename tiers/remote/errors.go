package remote

import "errors"

// Errors from Verify and the stores. They are wrapped with details; test
// them with errors.Is.
var (
	// ErrCorrupt means a value read back is not the block asked for: it
	// fails a header field, its length, its checksum or its MAC. The
	// block is reported CORRUPT and the value is deleted from the store.
	// Every verification error below wraps it.
	ErrCorrupt = errors.New("remote: corrupt value")

	// ErrBadMagic: the value does not start with Magic (not ours, or cut).
	ErrBadMagic = errors.New("remote: bad magic")
	// ErrBadVersion: a format version this build does not read.
	ErrBadVersion = errors.New("remote: unsupported format version")
	// ErrLength: the value is shorter than a header, or its payload is not
	// the length the header and the namespace say.
	ErrLength = errors.New("remote: bad length")
	// ErrKeyMismatch: a well-formed header names another block (another
	// namespace, group or key hash) than the key it was stored under.
	ErrKeyMismatch = errors.New("remote: value names another block")
	// ErrMalformed: reserved or padding bytes are not zero.
	ErrMalformed = errors.New("remote: malformed header")
	// ErrChecksum: the payload does not hash to the header's checksum.
	ErrChecksum = errors.New("remote: payload checksum mismatch")
	// ErrMAC: the value has no MAC where one is required, or its MAC does
	// not verify under the node's key (forged, or written with another key).
	ErrMAC = errors.New("remote: MAC missing or wrong")

	// ErrUnavailable means the store could not answer for a key: the node
	// holding it is down, slow past the deadline, or the cluster is
	// failing over. The block is reported IO_ERROR; nothing is known about
	// the value.
	ErrUnavailable = errors.New("remote: store unavailable")

	// ErrReplicas (with ErrUnavailable) means a generation record was
	// written on its master but fewer of the master's replicas than
	// RedisConfig.WaitReplicas acknowledged it in time.
	ErrReplicas = errors.New("remote: too few replicas acknowledged the write")

	// ErrQueueFull means the publisher's queue was full; the block is not
	// published (counted, never an error to the engine).
	ErrQueueFull = errors.New("remote: publish queue full")
)

// ErrStale means a value read back is well-formed but not of the current
// generations of its key or namespace: an invalidation came after it was
// written (or the store lost the records). It is never served (MISSING)
// and is deleted as garbage; it does not wrap ErrCorrupt.
var ErrStale = errors.New("remote: stale value (invalidated since it was written)")
