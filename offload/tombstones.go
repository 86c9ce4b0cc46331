package offload

import (
	"sync"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// tombstones record, while a tier's recovery runs, the keys an Invalidate
// drops (or whole namespaces), so that copies recovery has not reached yet
// are dropped instead of coming back. The disk tier's recovery and the CPU
// arena's each keep their own.
type tombstones struct {
	mu struct {
		sync.Mutex
		running bool
		keys    map[index.Key]struct{} // invalidated while running
		ns      map[uint32]bool        // namespaces invalidated whole
	}
}

// start begins recording (recovery starts).
func (t *tombstones) start() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.mu.running = true
	t.mu.keys = map[index.Key]struct{}{}
	t.mu.ns = map[uint32]bool{}
}

// stop forgets what was recorded (recovery ended).
func (t *tombstones) stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.mu.running = false
	t.mu.keys, t.mu.ns = nil, nil
}

// invalidating records the keys an Invalidate drops (keys nil: the whole
// namespaces). Call it before the index entries go.
func (t *tombstones) invalidating(nss []*Namespace, keys *Keys) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.mu.running {
		return
	}
	for _, ns := range nss {
		if keys == nil {
			t.mu.ns[ns.ID] = true
			continue
		}
		if t.mu.ns[ns.ID] {
			continue
		}
		hb := ns.Layout.HashBytes
		for i := 0; i+hb <= len(keys.Hashes); i += hb {
			if len(t.mu.keys) >= maxTombstones {
				// More of the tier's blocks dropped than were
				// invalidated, never fewer.
				t.mu.ns[ns.ID] = true
				break
			}
			t.mu.keys[makeKey(ns.ID, keys.Group, keys.Hashes[i:i+hb])] = struct{}{}
		}
	}
}

// invalidated reports whether k was invalidated since recording started.
func (t *tombstones) invalidated(k *index.Key) bool {
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
