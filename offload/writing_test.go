package offload

import (
	"encoding/binary"
	"runtime"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// TestDemotionMapShrinksAfterABurst: once a burst's demotions are all over,
// the map that tracked them gives its room back (a Go map keeps the room it
// grew to: 50,000 demotions left some 4 MiB held at rest).
func TestDemotionMapShrinksAfterABurst(t *testing.T) {
	s := &Service{}
	s.writing.byKey = map[index.Key]*demotion{}
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	before := heap()
	ds := make([]*demotion, 50_000)
	for i := range ds {
		ds[i] = &demotion{}
		ds[i].key.NS = 1
		binary.LittleEndian.PutUint64(ds[i].key.Hash[:], uint64(i))
		// What demote does with the map.
		s.writing.byKey[ds[i].key] = ds[i]
		s.writing.peak = max(s.writing.peak, len(s.writing.byKey))
	}
	for _, d := range ds {
		s.endDemotion(d)
	}
	ds = nil
	if after := heap(); after > before+512<<10 {
		t.Fatalf("%d KiB more heap with no demotion left than before the burst", (after-before)>>10)
	}
	// A few at a time keep their map.
	d := &demotion{}
	s.writing.byKey[d.key] = d
	m := s.writing.byKey
	s.endDemotion(d)
	if len(s.writing.byKey) != 0 || s.writing.byKey == nil {
		t.Fatal("the map is gone")
	}
	s.writing.byKey[d.key] = d
	if len(m) != 1 {
		t.Fatal("a map that never grew past writingKeep was made again")
	}
}
