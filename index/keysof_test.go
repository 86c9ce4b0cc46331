package index

import "testing"

// TestKeysOf finds each filed key by its hash, through table growth and
// backward-shift deletions, and no key once it is gone.
func TestKeysOf(t *testing.T) {
	ix := New()
	const n = 5000
	for i := range uint64(n) {
		put(ix, key(1, 0, i), uint32(i))
	}
	for i := uint64(0); i < n; i += 3 {
		del(ix, key(1, 0, i))
	}
	var buf []Key
	for i := range uint64(n) {
		k := key(1, 0, i)
		buf = ix.KeysOf(HashKey(&k), buf[:0])
		switch {
		case i%3 == 0 && len(buf) != 0:
			t.Fatalf("key %d deleted, KeysOf found %v", i, buf)
		case i%3 != 0 && (len(buf) != 1 || buf[0] != k):
			t.Fatalf("key %d: KeysOf found %v", i, buf)
		}
	}
	other := key(2, 0, 1)
	if got := ix.KeysOf(HashKey(&other), nil); len(got) != 0 {
		t.Fatalf("a key never filed: KeysOf found %v", got)
	}
}
