package index

import "testing"

// TestTombstones: keys and whole namespaces are recorded only while
// recovery runs, and forgotten when it stops.
func TestTombstones(t *testing.T) {
	var ts Tombstones
	k := func(ns uint32, b byte) Key { return Key{NS: ns, Group: 1, Hash: [32]byte{b}} }
	a, b, c := k(1, 1), k(1, 2), k(2, 1)
	ts.Add([]uint32{1}, []Key{a}) // before Start: not recorded
	if ts.Has(&a) {
		t.Fatal("a key invalidated before recovery started is a tombstone")
	}
	ts.Start()
	ts.Add([]uint32{1}, []Key{a})
	ts.Add([]uint32{2}, nil)
	switch {
	case !ts.Has(&a):
		t.Fatal("an invalidated key has no tombstone")
	case ts.Has(&b):
		t.Fatal("a key not invalidated has a tombstone")
	case !ts.Has(&c):
		t.Fatal("a key of a namespace invalidated whole has no tombstone")
	}
	ts.Stop()
	if ts.Has(&a) || ts.Has(&c) {
		t.Fatal("tombstones outlive recovery")
	}
}

// TestTombstonesBound: past MaxTombstones keys, a further key's namespace
// counts as invalidated whole (more is dropped than asked, never less),
// other namespaces keep their own keys, and the map does not grow.
func TestTombstonesBound(t *testing.T) {
	var ts Tombstones
	ts.Start()
	keys := make([]Key, MaxTombstones)
	for i := range keys {
		keys[i] = Key{NS: 1, Hash: [32]byte{byte(i), byte(i >> 8), byte(i >> 16)}}
	}
	ts.Add(nil, keys)
	other := Key{NS: 1, Hash: [32]byte{0xff, 0xff, 0xff, 1}} // not among keys
	if ts.Has(&other) {
		t.Fatal("at the bound, a key never invalidated has a tombstone")
	}
	over := Key{NS: 3, Hash: [32]byte{1}}
	ts.Add(nil, []Key{over})
	sibling := Key{NS: 3, Hash: [32]byte{2}}
	unrelated := Key{NS: 4, Hash: [32]byte{1}}
	switch {
	case !ts.Has(&over):
		t.Fatal("a key invalidated past the bound has no tombstone")
	case !ts.Has(&sibling):
		t.Fatal("past the bound, the key's namespace is not invalidated whole")
	case ts.Has(&unrelated):
		t.Fatal("past the bound, another namespace's keys have tombstones")
	case !ts.Has(&keys[0]) || !ts.Has(&keys[MaxTombstones-1]):
		t.Fatal("the keys recorded before the bound lost their tombstones")
	}
	ts.mu.Lock()
	n := len(ts.mu.keys)
	ts.mu.Unlock()
	if n != MaxTombstones {
		t.Fatalf("%d keys recorded, want the bound %d", n, MaxTombstones)
	}
}
