package offload

import (
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
)

func markedKey(i int) index.Key {
	k := index.Key{NS: 1, Group: uint32(i % 2)}
	k.Hash[0], k.Hash[1] = byte(i), byte(i>>8)
	return k
}

// TestMarks: a key's mark covers its blocks written before it, and only
// those; past maxKeyMarks keys go into the namespace's filter, and past
// maxFilterKeys the namespace is marked whole at the newest clock; the
// catalog keeps the marks as they are.
func TestMarks(t *testing.T) {
	var m marks
	a, b := markedKey(1), markedKey(2)
	m.mark(markKey{a.Group, a.Hash}, 100)
	switch {
	case !m.covers(&a, 99), m.covers(&a, 100), m.covers(&b, 1):
		t.Fatal("a key mark covers the wrong writes")
	}
	m.mark(markKey{a.Group, a.Hash}, 50) // an older mark changes nothing
	if !m.covers(&a, 99) {
		t.Fatal("an older mark lowered a newer one")
	}

	ns := &Namespace{Fingerprint: []byte("fp"), Layout: layout.Layout{HashBytes: 32, Segments: []layout.Segment{{Group: 0, Bytes: 4096}}}, marks: m}
	back, err := decodeMarks(encodeMeta(ns))
	if err != nil || len(back.keys) != 1 || !back.covers(&a, 99) || back.covers(&a, 100) {
		t.Fatalf("catalog round trip: %+v %v", back, err)
	}
	if _, _, err := decodeMeta(encodeMeta(ns)); err != nil {
		t.Fatalf("the catalog entry with marks no longer decodes: %v", err)
	}

	// a and maxKeyMarks-1 more fill the namespace's key marks; the next
	// ones go into its filter, which covers them (and a few keys that
	// collide with them), not the others.
	for i := 0; i < maxKeyMarks-1; i++ {
		k := markedKey(i + 10)
		m.mark(markKey{k.Group, k.Hash}, uint64(200+i))
	}
	if len(m.keys) != maxKeyMarks || m.filter != nil {
		t.Fatalf("%d key marks, filter %v; want %d and none", len(m.keys), m.filter != nil, maxKeyMarks)
	}
	over := func(i int) index.Key { k := markedKey(i); k.Hash[5] = 0xf0; return k }
	for i := 0; i < 1000; i++ {
		k := over(i)
		m.mark(markKey{k.Group, k.Hash}, uint64(5000+i))
	}
	if m.all != 0 || len(m.keys) != maxKeyMarks || m.filterKeys != 1000 || m.filterBefore != 5999 {
		t.Fatalf("past %d key marks: all %d, %d keys, filter of %d keys before %d", maxKeyMarks, m.all, len(m.keys), m.filterKeys, m.filterBefore)
	}
	for i := 0; i < 1000; i++ {
		if k := over(i); !m.covers(&k, 5998) || m.covers(&k, 5999) {
			t.Fatalf("filtered key %d: covers the wrong writes", i)
		}
	}
	collide := 0
	for i := 0; i < 10000; i++ {
		k := markedKey(i + 20000)
		k.Hash[6] = 0x0f
		if m.covers(&k, 0) {
			collide++
		}
	}
	if collide > 100 { // 1000 keys in 65536 bits, 4 hashes: about 0.2%
		t.Fatalf("%d of 10000 keys never marked are covered by the filter", collide)
	}
	back, err = decodeMarks(encodeMeta(&Namespace{Fingerprint: ns.Fingerprint, Layout: ns.Layout, marks: m}))
	if k := over(7); err != nil || back.filterKeys != 1000 || !back.covers(&k, 5998) {
		t.Fatalf("catalog round trip of the filter: %v", err)
	}
	// The filter full: the namespace is marked whole, at the newest clock.
	for i := 1000; i < maxFilterKeys+1; i++ {
		k := over(i)
		m.mark(markKey{k.Group, k.Hash}, uint64(5000+i))
	}
	last := uint64(5000 + maxFilterKeys)
	if m.keys != nil || m.filter != nil || m.all != last {
		t.Fatalf("past the filter: %d keys, filter %v, all %d; want the namespace marked whole at %d", len(m.keys), m.filter != nil, m.all, last)
	}
	if !m.covers(&b, last-1) || m.covers(&b, last) {
		t.Fatal("a namespace mark covers the wrong writes")
	}
	m.mark(markKey{a.Group, a.Hash}, last-5) // below the namespace's mark: nothing to add
	if m.keys != nil {
		t.Fatal("a key mark under the namespace's was kept")
	}
}
