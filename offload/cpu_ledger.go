package offload

import (
	"sync"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
)

// cpuLedger makes an Invalidate durable while the CPU tier's recovery runs.
// Until recovery has filed a block (or dropped it), the block's record is
// valid in the arena file, and a stop (SIGTERM, kill -9) would let the next
// start bring it back. So recovery notes every record it keeps from its
// scan (unfiled), and an Invalidate clears the records of the keys it names
// (or of whole namespaces) there, in the arena file, before it answers: the
// file forgets them at once, whatever becomes of the process. The
// tombstones then keep recovery, which still holds the records' contents,
// from filing them in this run.
//
// An Invalidate that comes while recovery is still reading the records
// waits for the scan to end (it reads only the records, not the payloads:
// 32 MiB per GiB of arena), since a record not scanned yet cannot be found.
//
// A recovery stopped before it was done (the daemon stops) keeps its
// ledger: an Invalidate answered while the daemon drains still clears its
// records.
type cpuLedger struct {
	tombstones
	scanned chan struct{} // closed once unfiled holds every record recovery keeps
	mu      struct {
		sync.Mutex
		unfiled map[uint32]map[index.Key]cpu.SlotID // by namespace id
	}
	clear func(cpu.SlotID) // the tier's ClearRecord
}

// begin starts the ledger of a recovery (before anything can invalidate).
func (l *cpuLedger) begin(clear func(cpu.SlotID)) {
	l.clear = clear
	l.scanned = make(chan struct{})
	l.mu.unfiled = map[uint32]map[index.Key]cpu.SlotID{}
	l.tombstones.start()
}

// scanDone publishes the records recovery's scan kept (by key: the newest
// of each).
func (l *cpuLedger) scanDone(found map[index.Key]cpuFound) {
	l.mu.Lock()
	for k, f := range found {
		m := l.mu.unfiled[k.NS]
		if m == nil {
			m = map[index.Key]cpu.SlotID{}
			l.mu.unfiled[k.NS] = m
		}
		m[k] = f.Slot
	}
	l.mu.Unlock()
	close(l.scanned)
}

// settled notes that recovery filed or dropped k's record: an Invalidate
// no longer needs to clear it (the index, or nobody, owns the slot now).
func (l *cpuLedger) settled(k *index.Key) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if m := l.mu.unfiled[k.NS]; m != nil {
		delete(m, *k)
	}
}

// invalidating clears the records of what an Invalidate drops (keys nil:
// whole namespaces) that recovery has not filed yet, and records their
// tombstones. Call it before the index entries go.
func (l *cpuLedger) invalidating(nss []*Namespace, keys *Keys) {
	if l.scanned == nil { // no recovery
		return
	}
	<-l.scanned
	l.tombstones.invalidating(nss, keys)
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, ns := range nss {
		m := l.mu.unfiled[ns.ID]
		if len(m) == 0 {
			continue
		}
		if keys == nil {
			for _, sl := range m {
				l.clear(sl)
			}
			delete(l.mu.unfiled, ns.ID)
			continue
		}
		hb := ns.Layout.HashBytes
		for i := 0; i+hb <= len(keys.Hashes); i += hb {
			k := makeKey(ns.ID, keys.Group, keys.Hashes[i:i+hb])
			if sl, ok := m[k]; ok {
				l.clear(sl)
				delete(m, k)
			}
		}
	}
}

// end forgets the ledger (recovery is done: every record is filed or gone).
func (l *cpuLedger) end() {
	l.tombstones.stop()
	l.mu.Lock()
	l.mu.unfiled = nil
	l.mu.Unlock()
}

// settledAll is settled for each of found.
func (l *cpuLedger) settledAll(found []cpuFound) {
	for i := range found {
		l.settled(&found[i].key)
	}
}
