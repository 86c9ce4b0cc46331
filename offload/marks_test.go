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
// those; past maxKeyMarks a namespace is marked whole at the newest clock;
// the catalog keeps the marks as they are.
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

	// a and maxKeyMarks-1 more fill the namespace's marks; one more
	// marks it whole.
	for i := 0; i < maxKeyMarks; i++ {
		k := markedKey(i + 10)
		m.mark(markKey{k.Group, k.Hash}, uint64(200+i))
	}
	last := uint64(200 + maxKeyMarks - 1)
	if m.keys != nil || m.all != last {
		t.Fatalf("past %d key marks: %d keys, all %d, want the namespace marked whole at %d", maxKeyMarks, len(m.keys), m.all, last)
	}
	if !m.covers(&b, last-1) || m.covers(&b, last) {
		t.Fatal("a namespace mark covers the wrong writes")
	}
	m.mark(markKey{a.Group, a.Hash}, last-5) // below the namespace's mark: nothing to add
	if m.keys != nil {
		t.Fatal("a key mark under the namespace's was kept")
	}
}
