package slots

import "fmt"

// Void slots: a slot whose bytes must not outlive its block. The disk
// tier's slots outlive the daemon: a block the owner invalidated must not
// come back from its slot at the next start, so its header is erased
// before the slot is reused. The erase must not land while a reader still
// holds a pin on the slot (a load reading it, a lease), or that reader
// would find the block gone under it; so a void slot waits for its last
// pin, then goes to the eraser, pinned for it, and is freed when the
// eraser unpins it.

// SetEraser names the function that erases a void slot's bytes. It runs
// without the space's lock, on the goroutine that dropped the slot's last
// pin (or that voided an unpinned slot), with one pin taken for it: it
// must not block, and must Unpin the slot once the erase has landed (or
// failed). Set it before the first Void; without one a void slot is freed
// like a released one.
func (t *Space) SetEraser(erase func(SlotID)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.mu.eraser = erase
}

// Void is Release for a slot whose bytes must be erased before it is
// reused (its block was invalidated). It may also follow Release, by
// whoever holds a pin on the slot: the released slot's bytes become void
// too. The slot is erased, then freed, once its last pin drops.
func (t *Space) Void(s SlotID) {
	t.mu.Lock()
	pins, st := t.slotLocked(s)
	var erase func(SlotID)
	if *st == slotUsed {
		t.released(s)
	}
	switch {
	case *st == slotUsed && *pins == 0:
		// Held like a released slot while the eraser has it.
		t.heldLocked(uint64(s)/t.slotsPer, 1)
		erase = t.eraseLocked(s)
	case *st == slotUsed:
		*st = slotVoid
		t.heldLocked(uint64(s)/t.slotsPer, 1)
	case *st == slotReleased && *pins > 0:
		*st = slotVoid
	default:
		t.mu.Unlock()
		panic(fmt.Sprintf("slots: void of slot %d in state %d with %d pins", s, *st, *pins))
	}
	t.mu.Unlock()
	if erase != nil {
		erase(s)
	}
}

// eraseLocked hands s, held and without pins, to the eraser: pinned for
// it, released so its Unpin frees it. Without an eraser s is freed now and
// eraseLocked returns nil. The caller calls the eraser it returns once it
// has let go of the lock.
func (t *Space) eraseLocked(s SlotID) func(SlotID) {
	pins, st := t.slotLocked(s)
	if t.mu.eraser == nil {
		*st = slotReleased // for freeLocked's accounting
		t.heldLocked(uint64(s)/t.slotsPer, -1)
		t.freeLocked(s)
		return nil
	}
	*st = slotReleased
	*pins = 1
	t.mu.pinned++
	return t.mu.eraser
}
