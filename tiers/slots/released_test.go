package slots

import (
	"slices"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// TestReleasedHook: Config.Released hears of every slot its owner lets go
// of (Release, pinned or not; a ReleaseIdle that released; Void;
// Quarantine of a slot in use) before the slot can be handed out again,
// and of nothing else (a ReleaseIdle refused, a pin dropped).
func TestReleasedHook(t *testing.T) {
	var heard []SlotID
	var sp *Space
	sp, err := New(Config{Name: "test", Bytes: 1 << 20, ChunkBytes: 1 << 20, Released: func(s SlotID) {
		// Under the space's lock, before the slot is free again.
		if _, st := sp.slotLocked(s); *st != slotUsed {
			t.Errorf("slot %d reported in state %d, want it still in use", s, *st)
		}
		heard = append(heard, s)
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer sp.Close()
	c, err := sp.Class(64 << 10)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Drop()
	c.Admit([]index.Key{key(0), key(1), key(2), key(3), key(4)})
	alloc := func() SlotID {
		s, ok := c.Alloc()
		if !ok {
			t.Fatal("no slot")
		}
		return s
	}
	a, b, d, e, f := alloc(), alloc(), alloc(), alloc(), alloc()
	for _, s := range []SlotID{a, b, d, e, f} {
		sp.Unpin(s) // the writers' pins
	}
	sp.Release(a)
	sp.Pin(b)
	if sp.ReleaseIdle(b) {
		t.Fatal("ReleaseIdle released a pinned slot")
	}
	sp.Release(b) // pinned: freed at the Unpin, reported now
	sp.Unpin(b)
	if !sp.ReleaseIdle(d) {
		t.Fatal("ReleaseIdle kept an idle slot")
	}
	sp.Void(e)
	sp.Quarantine(f)
	if want := []SlotID{a, b, d, e, f}; !slices.Equal(heard, want) {
		t.Fatalf("Released heard %v, want %v", heard, want)
	}
}
