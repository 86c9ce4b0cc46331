package remote

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strconv"
	"strings"

	"github.com/zeebo/xxh3"
)

// KeyPrefix opens every key the tier writes; with the version after it, an
// operator can find (redis-cli --scan --pattern 'kvo:2:*') or drop them.
const KeyPrefix = "kvo:2:"

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

// KeyspaceOf is the keyspace whose Prefix is prefix.
func KeyspaceOf(prefix string) Keyspace { return Keyspace{prefix: prefix} }

// Prefix is the part every key of the keyspace starts with.
func (ks Keyspace) Prefix() string { return ks.prefix }

// Key is the store key of a block:
//
//	kvo:2:<key id>:{<first 16 bytes of the namespace digest, hex>:<bucket>}:<group>:<key hash, hex>
//
// The namespace is named by 128 bits of its digest (the header carries all
// 256 and Verify compares them); the bucket (Bucket) and the group in
// decimal; the hash in hex. The hash tag is the namespace's bucket: a
// namespace's blocks spread over NamespaceBuckets slots, so over every
// master, and the generation records a reader checks a value against (the
// block's, GenKey, and its namespace's, NamespaceGenKey) are in the value's
// slot: one node answers for all three in one round trip, and a dead
// master costs its own slots only.
func (ks Keyspace) Key(id Ident) string {
	b := make([]byte, 0, len(ks.prefix)+1+32+1+4+2+10+1+2*len(id.Hash))
	return string(ks.AppendKey(b, id))
}

// NamespacePrefix is what every key of the namespace with digest ns starts
// with in this keyspace: a namespace invalidated whole is swept from the
// store by it (Store.DeletePrefix).
func (ks Keyspace) NamespacePrefix(ns [32]byte) string {
	return ks.prefix + "{" + hex.EncodeToString(ns[:16]) + ":"
}

// NamespaceBuckets is how many slots a namespace's blocks spread over,
// each with its own copy of the namespace's generation record: an
// invalidation of the namespace writes them all (one round trip per node).
const NamespaceBuckets = 1024

// Bucket is the bucket of a block's key hash.
func Bucket(hash []byte) uint32 { return uint32(xxh3.Hash(hash) % NamespaceBuckets) }

// GenKey is the generation record of the block whose value is at key:
// the key and ":gen", in the value's slot.
func GenKey(key string) string { return key + ":gen" }

// IsRecordKey reports whether key names a generation record (a block's or
// a namespace's), not a value: what a tool listing the keyspace's values
// skips.
func IsRecordKey(key string) bool {
	return strings.HasSuffix(key, ":gen") || strings.HasSuffix(key, "}:ns")
}

// NamespaceGenKeyOf is the copy of the namespace's generation record in
// the slot of the value at key: kvo:2:<key id>:{<namespace>:<bucket>}:ns.
func NamespaceGenKeyOf(key string) string {
	open := strings.IndexByte(key, '{')
	if open < 0 {
		return key + ":ns"
	}
	end := strings.IndexByte(key[open:], '}')
	if end < 0 {
		return key + ":ns"
	}
	return key[:open+end+1] + ":ns"
}

// NamespaceGenKeys are every copy of namespace ns's generation record in
// this keyspace, one per bucket: what an invalidation of it writes.
func (ks Keyspace) NamespaceGenKeys(ns [32]byte) []string {
	out := make([]string, NamespaceBuckets)
	p := ks.NamespacePrefix(ns)
	for b := range out {
		out[b] = p + strconv.Itoa(b) + "}:ns"
	}
	return out
}

// AppendKey appends Key(id) to dst.
func (ks Keyspace) AppendKey(dst []byte, id Ident) []byte {
	dst = append(dst, ks.prefix...)
	dst = append(dst, '{')
	dst = hex.AppendEncode(dst, id.NS[:16])
	dst = append(dst, ':')
	dst = strconv.AppendUint(dst, uint64(Bucket(id.Hash)), 10)
	dst = append(dst, "}:"...)
	dst = strconv.AppendUint(dst, uint64(id.Group), 10)
	dst = append(dst, ':')
	return hex.AppendEncode(dst, id.Hash)
}
