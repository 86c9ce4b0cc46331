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
