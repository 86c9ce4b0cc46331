package index

// KeysOf appends to into every key filed under hash h (HashKey): one, or
// none, but for a collision of 64-bit hashes. A holder of hashes only (the
// tiers' policies, which keep 8 bytes per block rather than its 40-byte
// key) finds the keys through it.
func (ix *Index) KeysOf(h uint64, into []Key) []Key {
	s := ix.shardOf(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	mask := len(s.table) - 1
	for i := int(h) & mask; s.table[i] != 0; i = (i + 1) & mask {
		if r := s.rec(s.table[i] - 1); hashKey(&r.key) == h {
			into = append(into, r.key)
		}
	}
	return into
}
