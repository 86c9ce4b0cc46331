package index

import "sync"

// MaxTombstones bounds the keys invalidated during a recovery that a
// Tombstones remembers (48 bytes each with the map's overhead, ~50 MiB).
// Past it a namespace's further invalidations count as invalidating the
// whole namespace for what recovery has not reached yet: more of the
// tier's blocks are dropped than were asked, never fewer.
const MaxTombstones = 1 << 20

// Tombstones record, while a tier's recovery runs, the keys an Invalidate
// drops (or whole namespaces), so that copies recovery has not reached yet
// are dropped instead of coming back. The disk tier's recovery (package
// offload) and the CPU arena's (package tiers/cpu) each keep their own.
type Tombstones struct {
	mu struct {
		sync.Mutex
		running bool
		keys    map[Key]struct{} // invalidated while running
		ns      map[uint32]bool  // namespaces invalidated whole
	}
}

// Start begins recording (recovery starts).
func (t *Tombstones) Start() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.mu.running = true
	t.mu.keys = map[Key]struct{}{}
	t.mu.ns = map[uint32]bool{}
}

// Stop forgets what was recorded (recovery ended).
func (t *Tombstones) Stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.mu.running = false
	t.mu.keys, t.mu.ns = nil, nil
}

// Add records what an Invalidate drops: keys (each names its namespace)
// or, keys nil, the whole namespaces nss. Call it before the index
// entries go.
func (t *Tombstones) Add(nss []uint32, keys []Key) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.mu.running {
		return
	}
	if keys == nil {
		for _, ns := range nss {
			t.mu.ns[ns] = true
		}
		return
	}
	for _, k := range keys {
		switch {
		case t.mu.ns[k.NS]:
		case len(t.mu.keys) >= MaxTombstones:
			t.mu.ns[k.NS] = true
		default:
			t.mu.keys[k] = struct{}{}
		}
	}
}

// Has reports whether k was invalidated since recording started.
func (t *Tombstones) Has(k *Key) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.mu.running {
		return false
	}
	if t.mu.ns[k.NS] {
		return true
	}
	_, ok := t.mu.keys[*k]
	return ok
}
