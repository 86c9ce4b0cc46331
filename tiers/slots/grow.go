package slots

// Grow gives the class chunks until it has n free slots or no free chunk is
// left (taking one from another slot size when the class has none at all),
// as Admit does before a store allocates. A load that stages blocks no
// policy has seen yet (fetched from the remote tier) calls it before
// Alloc, so the first block of a namespace finds a slot.
func (c *Class) Grow(n int) {
	c.pmu.RLock()
	defer c.pmu.RUnlock()
	c.amu.Lock()
	defer c.amu.Unlock()
	c.grow(n)
}
