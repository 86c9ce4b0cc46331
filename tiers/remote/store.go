package remote

import "context"

// Store is a shared block store reached over the network. Every method
// takes many keys and answers each one: a batch costs one round trip per
// server that holds some of its keys (never one per key), all under the
// deadline of ctx. A key the store could not answer for (its server down or
// slow past the deadline) gets ErrUnavailable for that key alone; the
// others are answered.
//
// Redis Cluster implements it (NewRedis); an S3-compatible object store
// could, with parallel HEAD/GET/PUT/DELETE requests.
type Store interface {
	// Exists reports for each key whether the store holds a value:
	// out[i] is Present, Absent or Failed.
	Exists(ctx context.Context, keys []string, out []Presence) error
	// Get fetches values straight into the caller's buffers (for a
	// block: its header into a small buffer, its payload into the staging
	// slot, with no copy in between) and fills in each Fetch's results.
	Get(ctx context.Context, fs []Fetch) error
	// Set stores values (overwriting), and returns one error per item
	// (nil: stored).
	Set(ctx context.Context, items []Item) []error
	// Delete removes keys, and returns one error per key (nil: the key
	// is gone from the store, deleted now or absent already). A key whose
	// server could not be reached has its error: it may still be there.
	Delete(ctx context.Context, keys []string) []error
	// DeletePrefix removes every key that starts with prefix (a
	// namespace invalidated whole) and returns how many it removed. It
	// walks the whole store, many round trips; ctx bounds it all. An
	// error means some keys may remain: the caller tries again.
	DeletePrefix(ctx context.Context, prefix string) (int, error)
	// Ping reports whether the store answers at all.
	Ping(ctx context.Context) error
	// Close releases connections. No call may be in flight.
	Close() error
}

// Presence is what Exists learned about one key.
type Presence uint8

// Presences.
const (
	Absent Presence = iota
	Present
	Failed // the store could not answer for this key
)

// Fetch is one value to read: its first len(Head) bytes into Head, the
// next len(Body) bytes into Body. Reading the two parts need not be atomic:
// every valid value of a key is the same bytes (values are content
// addressed and their encoding deterministic), so parts of two valid values
// make the valid value, and anything else fails Verify.
type Fetch struct {
	Key  string
	Head []byte
	Body []byte

	// Results. Size is the value's length, 0 when the key is absent;
	// HeadN and BodyN are the bytes read into Head and Body (fewer when
	// the value is shorter). Err wraps ErrUnavailable when the store
	// could not answer for this key; Head and Body then hold nothing
	// meaningful.
	Size         int64
	HeadN, BodyN int
	Err          error
}

// Item is one value to store.
type Item struct {
	Key   string
	Value []byte
}
