package model

import (
	"encoding/binary"
	"fmt"
)

// The bytes of a stored block are a pure function of its key and its
// generation (how many times the key was invalidated before it was stored),
// segment by segment. Each segment opens with its identity, so a wrong
// block says whose bytes it holds: another key, an older generation, a
// load's poison, or zeros.

const (
	magicContent = 0x314c45444f4d564b // "KVMODEL1", little-endian
	magicPoison  = 0x214e4f53494f50   // "POISON!"
	identWords   = 4
)

// KeyRef names a block key in the model: a namespace spec (not the
// daemon's id, which changes across restarts), a KV cache group, and a
// position in a chain of block hashes.
type KeyRef struct {
	NS    int
	Group int
	Chain int
	Pos   int
}

func (k KeyRef) String() string {
	return fmt.Sprintf("ns%d/g%d/c%d.%d", k.NS, k.Group, k.Chain, k.Pos)
}

// Hash is the block hash of a chain position, hashBytes long. Hashes do not
// depend on the namespace: the TP ranks of one model look up the same
// hashes in their own namespaces, as vLLM's do.
func Hash(chain, pos, hashBytes int) []byte {
	h := make([]byte, hashBytes)
	binary.LittleEndian.PutUint32(h[0:], uint32(chain))
	binary.LittleEndian.PutUint32(h[4:], uint32(pos))
	x := mix(uint64(chain)<<32 | uint64(pos))
	for i := 8; i < hashBytes; i++ {
		if i%8 == 0 {
			x = mix(x)
		}
		h[i] = byte(x >> (8 * (i % 8)))
	}
	return h
}

// mix is splitmix64's finaliser.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

func identity(k KeyRef, gen uint32, seg int) [identWords]uint64 {
	return [identWords]uint64{
		magicContent,
		uint64(k.NS)<<48 | uint64(k.Group)<<32 | uint64(seg),
		uint64(k.Chain)<<32 | uint64(k.Pos),
		uint64(gen),
	}
}

func bodySeed(id [identWords]uint64) uint64 {
	return mix(id[1] ^ mix(id[2]^mix(id[3])))
}

// FillSegment writes segment seg of key k at generation gen into dst, a
// multiple of 8 bytes at least 32 long.
func FillSegment(dst []byte, k KeyRef, gen uint32, seg int) {
	id := identity(k, gen, seg)
	for i, w := range id {
		binary.LittleEndian.PutUint64(dst[8*i:], w)
	}
	x := bodySeed(id)
	for i := 8 * identWords; i+8 <= len(dst); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(dst[i:], x)
	}
}

// SegmentMatches reports whether got is exactly segment seg of k at gen,
// and if not the offset of the first wrong byte.
func SegmentMatches(got []byte, k KeyRef, gen uint32, seg int) (bool, int) {
	id := identity(k, gen, seg)
	for i, w := range id {
		if v := binary.LittleEndian.Uint64(got[8*i:]); v != w {
			return false, 8*i + firstByteDiff(v, w)
		}
	}
	x := bodySeed(id)
	for i := 8 * identWords; i+8 <= len(got); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		if v := binary.LittleEndian.Uint64(got[i:]); v != x {
			return false, i + firstByteDiff(v, x)
		}
	}
	return true, -1
}

func firstByteDiff(a, b uint64) int {
	for j := 0; j < 8; j++ {
		if byte(a>>(8*j)) != byte(b>>(8*j)) {
			return j
		}
	}
	return 0
}

// Poison fills a load's destination before the load, so a load that copies
// nothing (or half) is told from one that copied the right bytes.
func Poison(dst []byte, job uint64) {
	clear(dst)
	binary.LittleEndian.PutUint64(dst, magicPoison)
	binary.LittleEndian.PutUint64(dst[8:], job)
}

// Describe says whose bytes a segment holds, from its identity words.
func Describe(got []byte) string {
	w0 := binary.LittleEndian.Uint64(got)
	switch w0 {
	case magicPoison:
		return fmt.Sprintf("the poison of load job %d (nothing was copied)", binary.LittleEndian.Uint64(got[8:]))
	case magicContent:
		w1 := binary.LittleEndian.Uint64(got[8:])
		w2 := binary.LittleEndian.Uint64(got[16:])
		w3 := binary.LittleEndian.Uint64(got[24:])
		k := KeyRef{NS: int(w1 >> 48), Group: int(w1 >> 32 & 0xffff), Chain: int(w2 >> 32), Pos: int(uint32(w2))}
		id := identity(k, uint32(w3), int(uint32(w1)))
		if ok, at := SegmentMatches(got, k, uint32(w3), int(uint32(w1))); !ok {
			return fmt.Sprintf("the identity of %s gen %d segment %d, torn at byte %d", k, w3, id[1]&0xffffffff, at)
		}
		return fmt.Sprintf("%s gen %d segment %d", k, w3, uint32(w1))
	}
	for _, b := range got {
		if b != 0 {
			return fmt.Sprintf("unknown bytes starting %x", got[:min(32, len(got))])
		}
	}
	return "zeros"
}
