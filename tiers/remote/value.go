package remote

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/zeebo/xxh3"
)

// The value format, version 2. A value is a HeaderSize-byte header and the
// payload (one block: the engine's segments packed back to back). All
// integers little-endian; docs/remote.md has the table. Version 2 added
// the stamp (the generation records the value was written under, and a
// write id); a value of version 1 carries none and is refused.
const (
	// HeaderSize is the bytes before the payload.
	HeaderSize = 160
	// Version is the format version this build writes and reads.
	Version = 2
	// MaxHashLen is the longest key hash.
	MaxHashLen = 32
	// MaxPayloadLen bounds the payload a header may declare (a Redis
	// string holds at most 512 MiB).
	MaxPayloadLen = 512<<20 - HeaderSize
)

// Magic opens every value.
const Magic = "KVOFRBLK"

// MAC algorithms, in the header's mac_alg byte.
const (
	macNone   = 0
	macBLAKE3 = 1
)

const (
	offMagic      = 0   // [8]byte
	offVersion    = 8   // uint16
	offMACAlg     = 10  // uint8
	offHashLen    = 11  // uint8
	offGroup      = 12  // uint32
	offPayloadLen = 16  // uint64
	offPayloadSum = 24  // uint64, xxh3-64 of the payload
	offNamespace  = 32  // [32]byte
	offHash       = 64  // [32]byte, hash_len bytes then zeros
	offKeyGen     = 96  // uint64, the block's generation record when written
	offNSGen      = 104 // uint64, the namespace's generation record when written
	offWriteID    = 112 // uint64, random per write
	offReserved   = 120 // [8]byte, zero
	offMAC        = 128 // [32]byte, zeros without a MAC
)

// Stamp is what a value carries besides the block: the generation records
// of its key and of its namespace that the writer read before it wrote
// (docs/remote.md, Invalidation), and a random id of the write, so that a
// value read in parts is known to be one write's.
type Stamp struct {
	Key, NS Gen
	Write   uint64
}

// StampOf reads the stamp of a header (HeaderSize bytes or more).
func StampOf(head []byte) Stamp {
	le := binary.LittleEndian
	return Stamp{Key: Gen(le.Uint64(head[offKeyGen:])), NS: Gen(le.Uint64(head[offNSGen:])), Write: le.Uint64(head[offWriteID:])}
}

// Current reports whether a value stamped st is of the generations the
// reader just read from the store: both records present (non-zero) and
// both the same. Anything else is a value an invalidation made stale (or
// whose records the store lost): never served.
func (st Stamp) Current(key, ns Gen) bool {
	return st.Key != 0 && st.NS != 0 && st.Key == key && st.NS == ns
}

// Checksum is the payload checksum, xxh3-64 (the disk tier's, for the same
// reasons: docs/disk-format.md).
func Checksum(payload []byte) uint64 { return xxh3.Hash(payload) }

// EncodeHeader fills value[:HeaderSize] for the payload in
// value[HeaderSize:], stamped st, with a MAC (covering the stamp) when mac
// is set. The caller has read the payload into place already, so a value
// is assembled with one copy.
func EncodeHeader(value []byte, id Ident, st Stamp, mac *MAC) error {
	if len(value) < HeaderSize {
		return fmt.Errorf("%w: value buffer of %d bytes has no room for a header", ErrLength, len(value))
	}
	if len(id.Hash) == 0 || len(id.Hash) > MaxHashLen {
		return fmt.Errorf("%w: key hash of %d bytes, want 1 to %d", ErrLength, len(id.Hash), MaxHashLen)
	}
	payload := value[HeaderSize:]
	if len(payload) > MaxPayloadLen {
		return fmt.Errorf("%w: payload of %d bytes exceeds %d", ErrLength, len(payload), MaxPayloadLen)
	}
	h := value[:HeaderSize]
	clear(h)
	le := binary.LittleEndian
	copy(h[offMagic:], Magic)
	le.PutUint16(h[offVersion:], Version)
	h[offHashLen] = byte(len(id.Hash))
	le.PutUint32(h[offGroup:], id.Group)
	le.PutUint64(h[offPayloadLen:], uint64(len(payload)))
	le.PutUint64(h[offPayloadSum:], Checksum(payload))
	copy(h[offNamespace:], id.NS[:])
	copy(h[offHash:], id.Hash)
	le.PutUint64(h[offKeyGen:], uint64(st.Key))
	le.PutUint64(h[offNSGen:], uint64(st.NS))
	le.PutUint64(h[offWriteID:], st.Write)
	if mac != nil {
		h[offMACAlg] = macBLAKE3
		var sum [MACLen]byte
		mac.sum(&sum, h[:offMAC], payload)
		copy(h[offMAC:], sum[:])
	}
	return nil
}

// Verify checks a value read back under the key of want, for a payload of
// payloadLen bytes, and returns the payload (a slice of value). Every check
// compares with what the reader expects, so no field is trusted: magic,
// version, MAC algorithm (a node with a key accepts only MAC'd values, a
// node without one only open ones), hash length, group, payload length,
// namespace digest, key hash and its zero padding, the payload checksum,
// then the MAC. Every error wraps ErrCorrupt. It never panics, whatever
// value holds. The stamp is covered by the MAC but not compared here: the
// caller compares it with the generation records it read (CheckFetch).
func Verify(value []byte, want Ident, payloadLen uint64, mac *MAC) ([]byte, error) {
	if len(value) < HeaderSize {
		return nil, corrupt(ErrLength, "value of %d bytes is shorter than its %d-byte header", len(value), HeaderSize)
	}
	payload := value[HeaderSize:]
	return payload, VerifyParts(value[:HeaderSize], payload, want, payloadLen, mac)
}

// VerifyParts is Verify for a value read in two parts (Fetch): head is
// its header and payload the rest of it.
func VerifyParts(head, payload []byte, want Ident, payloadLen uint64, mac *MAC) error {
	if uint64(len(payload)) != payloadLen {
		return corrupt(ErrLength, "value holds %d payload bytes, the namespace's blocks are %d", len(payload), payloadLen)
	}
	if err := verifyHead(head, want, payloadLen, mac); err != nil {
		return err
	}
	h := head
	le := binary.LittleEndian
	if got, sum := Checksum(payload), le.Uint64(h[offPayloadSum:]); got != sum {
		return corrupt(ErrChecksum, "header says %#016x, payload hashes to %#016x", sum, got)
	}
	if mac == nil {
		return nil
	}
	var sum [MACLen]byte
	mac.sum(&sum, h[:offMAC], payload)
	if !macEqual(sum[:], h[offMAC:offMAC+MACLen]) {
		return corrupt(ErrMAC, "the value's MAC does not verify under this node's key")
	}
	return nil
}

// verifyHead checks every header field VerifyParts does but the payload's
// checksum and the MAC, which need the payload.
func verifyHead(head []byte, want Ident, payloadLen uint64, mac *MAC) error {
	if len(head) != HeaderSize {
		return corrupt(ErrLength, "header of %d bytes, want %d", len(head), HeaderSize)
	}
	h := head
	if string(h[offMagic:offMagic+len(Magic)]) != Magic {
		return corrupt(ErrBadMagic, "%q", h[offMagic:offMagic+len(Magic)])
	}
	le := binary.LittleEndian
	if v := le.Uint16(h[offVersion:]); v != Version {
		return corrupt(ErrBadVersion, "%d, this build reads %d", v, Version)
	}
	wantAlg := byte(macNone)
	if mac != nil {
		wantAlg = macBLAKE3
	}
	if alg := h[offMACAlg]; alg != wantAlg {
		return corrupt(ErrMAC, "mac_alg %d, this node requires %d", alg, wantAlg)
	}
	hl := int(h[offHashLen])
	if hl != len(want.Hash) || hl == 0 || hl > MaxHashLen {
		return corrupt(ErrKeyMismatch, "hash_len %d, want %d", hl, len(want.Hash))
	}
	if g := le.Uint32(h[offGroup:]); g != want.Group {
		return corrupt(ErrKeyMismatch, "group %d, want %d", g, want.Group)
	}
	if n := le.Uint64(h[offPayloadLen:]); n != payloadLen {
		return corrupt(ErrLength, "header says %d payload bytes, the namespace's blocks are %d", n, payloadLen)
	}
	if !bytes.Equal(h[offNamespace:offNamespace+32], want.NS[:]) {
		return corrupt(ErrKeyMismatch, "namespace %x, want %x", h[offNamespace:offNamespace+8], want.NS[:8])
	}
	if !bytes.Equal(h[offHash:offHash+hl], want.Hash) {
		return corrupt(ErrKeyMismatch, "key hash %x, want %x", h[offHash:offHash+hl], want.Hash)
	}
	if !isZero(h[offHash+hl : offHash+MaxHashLen]) {
		return corrupt(ErrMalformed, "key hash padding is not zero")
	}
	if !isZero(h[offReserved:offMAC]) {
		return corrupt(ErrMalformed, "reserved bytes are not zero")
	}
	if mac == nil && !isZero(h[offMAC:]) {
		return corrupt(ErrMalformed, "MAC field of an open value is not zero")
	}
	return nil
}

// CheckFetch settles a Fetch of a block whose header was read into a
// HeaderSize buffer and payload into a payloadLen one, with its generation
// records: found is false when
// the key is absent, the value changed while it was read (Torn), or the
// value is stale (err wraps ErrStale: written before an invalidation of
// its key or namespace, or its records are gone); err wraps ErrUnavailable
// when the store could not answer (for the value or either record).
// Otherwise err is nil only when the value is exactly the block want names
// (VerifyParts) and of the current generations, and Body holds its payload.
func CheckFetch(f *Fetch, want Ident, payloadLen uint64, mac *MAC) (found bool, err error) {
	switch {
	case f.Err != nil:
		return false, f.Err
	case f.Size == 0, f.Torn:
		return false, nil
	case uint64(f.Size) != HeaderSize+payloadLen || f.HeadN != HeaderSize || uint64(f.BodyN) != payloadLen ||
		len(f.Head) < HeaderSize || uint64(len(f.Body)) < payloadLen:
		return true, corrupt(ErrLength, "value of %d bytes (read %d+%d), want %d+%d", f.Size, f.HeadN, f.BodyN, HeaderSize, payloadLen)
	}
	if err := VerifyParts(f.Head[:HeaderSize], f.Body[:payloadLen], want, payloadLen, mac); err != nil {
		return true, err
	}
	return checkStamp(f.Head, f.Gen, f.NSGen)
}

// CheckHead settles a Fetch that read a header only (a Lookup, a
// publisher's look at what the store holds): found reports a value of the
// block want names, payloadLen bytes, of the current generations. Its
// payload and MAC are not checked (a Load does that); stale reports a
// value is there that is not current or not well-formed (to be replaced).
func CheckHead(f *Fetch, want Ident, payloadLen uint64, mac *MAC) (found, stale bool, err error) {
	switch {
	case f.Err != nil:
		return false, false, f.Err
	case f.Size == 0:
		return false, false, nil
	case uint64(f.Size) != HeaderSize+payloadLen || f.HeadN != HeaderSize || len(f.Head) < HeaderSize:
		return false, true, nil
	}
	// The payload is not here: every header field but its sum and the
	// MAC is checked.
	if err := verifyHead(f.Head[:HeaderSize], want, payloadLen, mac); err != nil {
		return false, true, nil
	}
	if _, err := checkStamp(f.Head, f.Gen, f.NSGen); err != nil {
		return false, true, nil
	}
	return true, false, nil
}

func checkStamp(head []byte, key, ns Gen) (bool, error) {
	if st := StampOf(head); !st.Current(key, ns) {
		return true, fmt.Errorf("%w: value stamped key generation %016x, namespace %016x; the store's records say %016x, %016x", ErrStale, uint64(st.Key), uint64(st.NS), uint64(key), uint64(ns))
	}
	return true, nil
}

func corrupt(kind error, format string, a ...any) error {
	return fmt.Errorf("%w: %w: %s", ErrCorrupt, kind, fmt.Sprintf(format, a...))
}

func isZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
