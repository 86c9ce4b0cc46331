package remote

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strconv"
)

// KeyPrefix opens every key the tier writes; with the version after it, an
// operator can find (redis-cli --scan --pattern 'kvo:1:*') or drop them.
const KeyPrefix = "kvo:1:"

// Ident names one block: the digest of its namespace, its KV cache group
// and its key hash. A value carries it in its header and Verify compares it
// with the key the value was read under.
type Ident struct {
	NS    [32]byte // NamespaceDigest
	Group uint32
	Hash  []byte // 1 to MaxHashLen bytes
}

// NamespaceDigest is the identity of a namespace across nodes: SHA-256 over
// the fingerprint and the layout's canonical encoding, each length-prefixed.
// Two daemons whose engines registered the same fingerprint with the same
// layout get the same digest and share blocks; a different fingerprint or a
// different layout (another block size, another number of layers) gives
// another digest, so their blocks never meet.
func NamespaceDigest(fingerprint, layout []byte) [32]byte {
	h := sha256.New()
	h.Write([]byte("kvoffloadd remote namespace v1\x00"))
	var n [4]byte
	binary.LittleEndian.PutUint32(n[:], uint32(len(fingerprint)))
	h.Write(n[:])
	h.Write(fingerprint)
	binary.LittleEndian.PutUint32(n[:], uint32(len(layout)))
	h.Write(n[:])
	h.Write(layout)
	var d [32]byte
	h.Sum(d[:0])
	return d
}

// Keyspace builds the store keys of one node: every key names the format
// version, the MAC key in use (its id, or "open" without one) and the
// block. Nodes with different MAC keys, or with and without one, therefore
// never read (and never delete as corrupt) each other's values; rotating
// the key starts a new keyspace and the old one ages out of the store.
type Keyspace struct {
	prefix string // KeyPrefix + key id + ":"
}

// NewKeyspace returns the keyspace of nodes using mac (nil: no MAC key).
func NewKeyspace(mac *MAC) Keyspace {
	id := "open"
	if mac != nil {
		id = mac.ID()
	}
	return Keyspace{prefix: KeyPrefix + id + ":"}
}

// Prefix is the part every key of the keyspace starts with.
func (ks Keyspace) Prefix() string { return ks.prefix }

// Key is the store key of a block:
//
//	kvo:1:<key id>:<first 16 bytes of the namespace digest, hex>:<group>:<key hash, hex>
//
// The namespace is named by 128 bits of its digest (the header carries all
// 256 and Verify compares them); the group in decimal; the hash in hex. No
// hash tag: blocks spread over every slot of the cluster.
func (ks Keyspace) Key(id Ident) string {
	b := make([]byte, 0, len(ks.prefix)+32+1+10+1+2*len(id.Hash))
	return string(ks.AppendKey(b, id))
}

// NamespacePrefix is what every key of the namespace with digest ns starts
// with in this keyspace: a namespace invalidated whole is swept from the
// store by it (Store.DeletePrefix).
func (ks Keyspace) NamespacePrefix(ns [32]byte) string {
	return ks.prefix + hex.EncodeToString(ns[:16]) + ":"
}

// AppendKey appends Key(id) to dst.
func (ks Keyspace) AppendKey(dst []byte, id Ident) []byte {
	dst = append(dst, ks.prefix...)
	dst = hex.AppendEncode(dst, id.NS[:16])
	dst = append(dst, ':')
	dst = strconv.AppendUint(dst, uint64(id.Group), 10)
	dst = append(dst, ':')
	return hex.AppendEncode(dst, id.Hash)
}
