package fence

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// memStore is a remote.Store in memory whose record writes fail while down
// (for keys of a namespace prefix, or all).
type memStore struct {
	mu    sync.Mutex
	gens  map[string]remote.Gen
	down  string // record keys with this prefix fail; "" none
	swept []string
}

func (m *memStore) Get(ctx context.Context, fs []remote.Fetch) error { return nil }
func (m *memStore) Set(ctx context.Context, items []remote.Item) []error {
	return make([]error, len(items))
}
func (m *memStore) SetGens(ctx context.Context, gs []remote.GenWrite) []error {
	m.mu.Lock()
	defer m.mu.Unlock()
	errs := make([]error, len(gs))
	for i, g := range gs {
		if m.down != "" && strings.HasPrefix(g.Key, m.down) {
			errs[i] = fmt.Errorf("%w: master down", remote.ErrUnavailable)
			continue
		}
		m.gens[g.Key] = g.Gen
	}
	return errs
}
func (m *memStore) Delete(ctx context.Context, keys []string) []error {
	return make([]error, len(keys))
}
func (m *memStore) DeletePrefix(ctx context.Context, prefix string, done *remote.Swept) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.swept = append(m.swept, prefix)
	return 0, nil
}
func (m *memStore) Ping(ctx context.Context) error { return nil }
func (m *memStore) Close() error                   { return nil }

func (m *memStore) setDown(prefix string) {
	m.mu.Lock()
	m.down = prefix
	m.mu.Unlock()
}

// memState is a StateFile in memory.
type memState struct {
	mu    sync.Mutex
	files map[string][]byte
}

func (s *memState) SaveState(name string, data []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.files[name] = append([]byte(nil), data...)
	return nil
}

func (s *memState) LoadState(name string) (map[string][]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string][]byte{}
	if b, ok := s.files[name]; ok {
		out["mem/"+name] = b
	}
	return out, nil
}

func open(t *testing.T, st remote.Store, state StateFile) *Set {
	t.Helper()
	cfg := Config{Store: st, Keyspace: remote.NewKeyspace(nil), Timeout: time.Second, Metrics: remote.NewMetrics(nil),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if state != nil {
		cfg.State = state
	}
	s, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func ref(ns byte, i int) KeyRef {
	k := Key{Group: 0}
	k.NS[0] = ns
	k.Hash[0], k.Hash[1] = byte(i), byte(i>>8)
	id := remote.Ident{NS: k.NS, Group: k.Group, Hash: k.Hash[:16]}
	return KeyRef{Key: k, Store: remote.NewKeyspace(nil).Key(id), Namespace: uint32(ns)}
}

func waitFor(t *testing.T, f func() error) {
	t.Helper()
	end := time.Now().Add(time.Minute)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(end) {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestUnrecordedUntilWritten: an invalidation whose records cannot be
// written answers ErrUnrecorded, fences its keys (kept in the state file)
// until the sweeper's retry writes them, and a Set opened on that state
// file fences them again; keys covered by a namespace invalidated whole
// whose records are missing answer for those records too.
func TestUnrecordedUntilWritten(t *testing.T) {
	st := &memStore{gens: map[string]remote.Gen{}}
	state := &memState{files: map[string][]byte{}}
	s := open(t, st, state)
	a := ref(1, 1)
	st.setDown(remote.NewKeyspace(nil).NamespacePrefix(a.Key.NS))
	unrecorded, err := s.Invalidate(nil, []KeyRef{a, ref(2, 1)}).Reach()
	if err != nil || !errors.Is(unrecorded, ErrUnrecorded) {
		t.Fatalf("Reach with namespace 1's master down: %v, %v; want ErrUnrecorded", unrecorded, err)
	}
	if !s.Fenced(&a.Key) {
		t.Fatal("a key whose record is missing is not fenced")
	}
	if b := ref(2, 1); s.Fenced(&b.Key) {
		t.Fatal("a key whose record was written is still fenced")
	}
	if k, n := s.Pending(); k != 1 || n != 0 {
		t.Fatalf("pending %d keys %d namespaces, want 1 and 0", k, n)
	}
	// Brought back by a node restarted on the state file.
	s2 := open(t, &memStore{gens: map[string]remote.Gen{}, down: "kvo:"}, state)
	if !s2.Fenced(&a.Key) {
		t.Fatal("a key whose record is missing is not fenced after a restart")
	}
	// Namespace 3 whole, its master down; a key of it invalidated again
	// answers for the namespace's records.
	w := ref(3, 1)
	st.setDown(remote.NewKeyspace(nil).NamespacePrefix(w.Key.NS))
	if u, _ := s.Invalidate([][32]byte{w.Key.NS}, nil).Reach(); !errors.Is(u, ErrUnrecorded) {
		t.Fatalf("a namespace whole with its master down: %v", u)
	}
	if u, _ := s.Invalidate(nil, []KeyRef{w}).Reach(); !errors.Is(u, ErrUnrecorded) {
		t.Fatalf("a key of a namespace whose records are missing: %v, want ErrUnrecorded", u)
	}
	st.setDown("")
	if u, err := s.Invalidate(nil, []KeyRef{w}).Reach(); u != nil || err != nil {
		t.Fatalf("the call again with the master back: %v, %v", u, err)
	}
	waitFor(t, func() error {
		if k, n := s.Pending(); k+n != 0 {
			return fmt.Errorf("%d keys and %d namespaces still pending", k, n)
		}
		return nil
	})
	if s.Fenced(&a.Key) || s.Fenced(&w.Key) {
		t.Fatal("fenced after the records were written")
	}
}
