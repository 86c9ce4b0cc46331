package remote

import (
	"context"
	"math/rand/v2"
	"sync"
)

// Store is a shared block store reached over the network. Every method
// takes many keys and answers each one: a batch costs one round trip per
// server that holds some of its keys (never one per key), all under the
// deadline of ctx. A key the store could not answer for (its server down or
// slow past the deadline) gets ErrUnavailable for that key alone; the
// others are answered.
//
// Every block has a generation record beside its value (GenKey, on the
// same server: a Redis hash tag), and so does its namespace (a copy per
// bucket of the namespace, NamespaceGenKeyOf, in the same slot). An invalidation writes a new generation; a value is
// stamped with the generations its writer read, and a reader refuses one
// whose stamp is not what it reads now (docs/remote.md, Invalidation).
//
// Redis Cluster implements it (NewRedis); an S3-compatible object store
// could, with parallel HEAD/GET/PUT/DELETE requests and conditional PUTs.
type Store interface {
	// Get fetches values straight into the caller's buffers (for a
	// block: its header into a small buffer, its payload into the staging
	// slot, with no copy in between), each with its generation records
	// read after it, all in one round trip per server; it fills in each
	// Fetch's results.
	Get(ctx context.Context, fs []Fetch) error
	// Set stores values where none is (never overwriting another
	// writer's: SET NX; an item with Replace drops the value there
	// first, one found stale), and returns one error per item (nil:
	// stored, or Kept: a value was there).
	Set(ctx context.Context, items []Item) []error
	// SetGens writes generation records (an invalidation), each followed
	// by the delete of the value it makes stale (Unlink, on the same
	// server), and returns one error per record (nil: written).
	SetGens(ctx context.Context, gs []GenWrite) []error
	// Delete removes keys, and returns one error per key (nil: the key
	// is gone from the store, deleted now or absent already). A key whose
	// server could not be reached has its error: it may still be there.
	Delete(ctx context.Context, keys []string) []error
	// DeletePrefix removes every key that starts with prefix (garbage
	// of a namespace invalidated whole) and returns how many it removed.
	// It walks the whole store, many round trips; ctx bounds it all. An
	// error means some keys may remain: the caller tries again, passing
	// the same done, in which DeletePrefix records each server it swept
	// through (by name) and which it skips: a try keeps what the tries
	// before it did (nil: sweep every server).
	DeletePrefix(ctx context.Context, prefix string, done *Swept) (int, error)
	// Ping reports whether the store answers at all.
	Ping(ctx context.Context) error
	// Close releases connections. No call may be in flight.
	Close() error
}

// Swept is the servers a sweep has been through; safe for concurrent use.
type Swept struct {
	mu   sync.Mutex
	done map[string]bool
}

// Has reports whether server name was swept through.
func (s *Swept) Has(name string) bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done[name]
}

// Add records that server name was swept through.
func (s *Swept) Add(name string) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done == nil {
		s.done = map[string]bool{}
	}
	s.done[name] = true
}

// Len is the number of servers swept through.
func (s *Swept) Len() int {
	if s == nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.done)
}

// Gen is a generation: a random non-zero token an invalidation writes into
// a generation record; 0 stands for a record that is absent.
type Gen uint64

// NewGen draws a generation. Random rather than counted, so that a record
// the store lost (a restarted master, an eviction) and created again never
// matches a value stamped before: such values are refused, never served.
func NewGen() Gen {
	for {
		if g := Gen(rand.Uint64()); g != 0 {
			return g
		}
	}
}

// Fetch is one value to read: its first len(Head) bytes into Head, the
// next len(Body) bytes into Body (none: the header only), then its
// block's generation record (GenKey) and its namespace's
// (NamespaceGenKeyOf), all in the value's slot. With CreateGen the records
// are first created where absent (a writer's look). The value's header is
// read again after its payload: a value replaced between the reads is
// Torn, not corrupt.
type Fetch struct {
	Key       string
	Head      []byte
	Body      []byte
	CreateGen bool

	// Results. Size is the value's length, 0 when the key is absent;
	// HeadN and BodyN are the bytes read into Head and Body (fewer when
	// the value is shorter); Gen and NSGen the records (0: absent). Err
	// wraps ErrUnavailable when the store could not answer for this key
	// or its records; the other results then hold nothing meaningful.
	Size         int64
	HeadN, BodyN int
	Gen, NSGen   Gen
	Torn         bool
	Err          error
}

// GenWrite is one generation record to write, and the value it makes stale.
type GenWrite struct {
	Key    string
	Gen    Gen
	Unlink string // "" none
}

// Item is one value to store.
type Item struct {
	Key     string
	Value   []byte
	Replace bool // drop the value there first (it was found stale)
	Kept    bool // result: another value was there and stays
}
