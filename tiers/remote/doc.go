// Package remote owns the shared remote tier: a block store that outlives
// one machine and that every node of a fleet reads and writes, so a prefix
// computed on one node is loaded on another.
//
// It holds four things, each in its own file:
//
//   - the Store interface (store.go): pipelined get/set/delete and the
//     writes of generation records over many keys, under one deadline,
//     with a result per key. Redis Cluster
//     implements it (redis.go); an S3-compatible object store can follow.
//   - the key layout (keys.go): a block's key names the format version, the
//     MAC key in use and a digest of the namespace, so two nodes with the
//     same engine, model and layout share blocks and nothing else does; its
//     hash tag puts a block's value and its generation records in one slot.
//   - the value format (value.go, mac.go): a 160-byte header (magic,
//     version, namespace digest, group, key hash, length, payload checksum,
//     the generations it was written under, a write id, keyed MAC) before
//     the payload, checked by Verify and CheckFetch on every read before a
//     byte of it is used. A value whose generations are not what its
//     records in the store say now (an invalidation came after it) is
//     stale: never served (docs/remote.md, Invalidation).
//   - the write-behind publisher (publisher.go): a bounded queue of blocks
//     to publish, deduplicated, drained by a few goroutines off the engine's
//     path; a full queue drops and counts.
//
// docs/remote.md is the operator's and the byte-level description.
//
// # Caveats
//
// The store is shared and not trusted: anything read back is verified, and
// without a MAC key any node (or anyone) that reaches the store can write a
// value that verifies. Redis may drop any value at any time (maxmemory with
// allkeys-lru): absence is normal and never an error.
package remote
