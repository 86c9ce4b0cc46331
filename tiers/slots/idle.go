package slots

// ReleaseIdle releases slot s if no pin holds it, so that it is free for
// the next Alloc, and reports whether it did. A pinned slot (a load or a
// disk write is reading it) is left as it was: Release would only mark it,
// and the room would come back at the last Unpin, too late for a caller
// that needs a slot now. The owner calls it as it would Release, holding
// the block's index entry, and clears its reference only on true.
func (t *Space) ReleaseIdle(s SlotID) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	pins, st := t.slotLocked(s)
	if *st != slotUsed || *pins > 0 {
		return false
	}
	t.released(s)
	t.freeLocked(s)
	return true
}
