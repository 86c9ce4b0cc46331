package slots

import (
	"slices"
	"testing"
)

// TestVoidWaitsForPinsThenErases: a void slot is erased only once its last
// reader's pin drops, stays taken while the eraser holds it, and is freed
// when the eraser lets go; voiding a released slot, an unpinned one, and
// quarantining a void one behave the same way. Without an eraser, Void is
// Release.
func TestVoidWaitsForPinsThenErases(t *testing.T) {
	sp, o := newSpace(t, 1<<20, 1<<20)
	var erased []SlotID
	sp.SetEraser(func(s SlotID) { erased = append(erased, s) })
	c, err := sp.Class(256 << 10)
	if err != nil {
		t.Fatal(err)
	}
	var got []SlotID
	for i := 1; i <= 4; i++ {
		s, ok := o.store(t, c, key(i))
		if !ok {
			t.Fatalf("store %d", i)
		}
		got = append(got, s)
	}
	forget := func(s SlotID) {
		o.mu.Lock()
		defer o.mu.Unlock()
		for k, ks := range o.slot {
			if ks == s {
				delete(o.slot, k)
			}
		}
	}
	wantErased := func(want ...SlotID) {
		t.Helper()
		if !slices.Equal(erased, want) {
			t.Fatalf("erased %v, want %v", erased, want)
		}
	}

	// A reader holds s: voiding it erases nothing yet.
	s := got[0]
	sp.Pin(s)
	forget(s)
	sp.Void(s)
	wantErased()
	o.audit(t, map[SlotID]uint32{s: 1})
	// Its last pin drops: the eraser gets it, pinned; it is not reused.
	sp.Unpin(s)
	wantErased(s)
	o.audit(t, map[SlotID]uint32{s: 1})
	if x, ok := c.Alloc(); ok {
		t.Fatalf("slot %d handed out while a slot is being erased and the rest are used", x)
	}
	// Erased: freed.
	sp.Unpin(s)
	o.audit(t, nil)
	if x, ok := c.Alloc(); !ok || x != s {
		t.Fatalf("the erased slot was not freed: %d %v", x, ok)
	}
	sp.Unpin(s)
	sp.Release(s)

	// Unpinned: erased at once.
	s = got[1]
	forget(s)
	sp.Void(s)
	wantErased(got[0], s)
	o.audit(t, map[SlotID]uint32{s: 1})
	sp.Unpin(s)

	// Released while pinned, then void: erased when the pin drops.
	s = got[2]
	sp.Pin(s)
	forget(s)
	sp.Release(s)
	sp.Void(s)
	wantErased(got[0], got[1])
	sp.Unpin(s)
	wantErased(got[0], got[1], s)
	sp.Unpin(s)
	o.audit(t, nil)

	// Void, then its read fails with EIO: quarantined, never erased.
	s = got[3]
	sp.Pin(s)
	forget(s)
	sp.Void(s)
	sp.Quarantine(s)
	sp.Unpin(s)
	wantErased(got[0], got[1], got[2])
	if sp.Quarantined() != 1 {
		t.Fatalf("%d quarantined", sp.Quarantined())
	}
	o.audit(t, nil)

	// Without an eraser a void slot is freed like a released one.
	sp.SetEraser(nil)
	s2, ok := o.store(t, c, key(20))
	if !ok {
		t.Fatal("store")
	}
	sp.Pin(s2)
	forget(s2)
	sp.Void(s2)
	sp.Unpin(s2)
	o.audit(t, nil)
	if len(erased) != 3 {
		t.Fatalf("erased %v without an eraser", erased)
	}
}
