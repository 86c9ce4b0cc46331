package cpu

import (
	"sync"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// ledger makes an Invalidate durable while the arena's recovery runs.
// Until recovery has filed a block (or dropped it), the block's record is
// valid in the arena file, and a stop (SIGTERM, kill -9) would let the next
// start bring it back. So recovery notes every record it keeps from its
// scan (unfiled), and Invalidating clears the records of the keys it names
// (or of whole namespaces) there, in the arena file, before it returns:
// the file forgets them at once, whatever becomes of the process. The
// tombstones then keep recovery, which still holds the records' contents,
// from filing them in this run (Settle).
//
// An Invalidate that comes while recovery is still reading the records
// waits for the scan to end (it reads only the records, not the payloads:
// 32 MiB per GiB of arena), since a record not scanned yet cannot be found.
//
// A recovery stopped before it was done (the daemon stops) keeps its
// ledger: an Invalidate answered while the daemon drains still clears its
// records.
type ledger struct {
	tombs   index.Tombstones
	scanned chan struct{} // closed once unfiled holds every record recovery keeps
	mu      struct {
		sync.Mutex
		unfiled map[uint32]map[index.Key]SlotID // by namespace
	}
	clear func(SlotID) // the tier's clearRecord
}

// begin starts the ledger of a recovery (before anything can invalidate).
func (l *ledger) begin(clear func(SlotID)) {
	l.clear = clear
	l.mu.Lock()
	l.mu.unfiled = map[uint32]map[index.Key]SlotID{}
	l.mu.Unlock()
	l.tombs.Start()
	l.scanned = make(chan struct{})
}

// scanDone publishes the records recovery's scan kept (by key: the newest
// of each).
func (l *ledger) scanDone(found map[index.Key]Recovered) {
	l.mu.Lock()
	for k, f := range found {
		m := l.mu.unfiled[k.NS]
		if m == nil {
			m = map[index.Key]SlotID{}
			l.mu.unfiled[k.NS] = m
		}
		m[k] = f.Slot
	}
	l.mu.Unlock()
	close(l.scanned)
}

// settled notes that recovery filed or dropped k's record: an Invalidate
// no longer needs to clear it (the owner's index, or nobody, owns the slot
// now).
func (l *ledger) settled(k *index.Key) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if m := l.mu.unfiled[k.NS]; m != nil {
		delete(m, *k)
	}
}

// settledAll is settled for each of found.
func (l *ledger) settledAll(found []Recovered) {
	for i := range found {
		l.settled(&found[i].Key)
	}
}

// invalidating clears the records of what an Invalidate drops that
// recovery has not filed yet, and records their tombstones.
func (l *ledger) invalidating(nss []uint32, keys []index.Key) {
	if l.scanned == nil { // no recovery
		return
	}
	<-l.scanned
	l.tombs.Add(nss, keys)
	l.mu.Lock()
	defer l.mu.Unlock()
	if keys == nil {
		for _, ns := range nss {
			for _, sl := range l.mu.unfiled[ns] {
				l.clear(sl)
			}
			delete(l.mu.unfiled, ns)
		}
		return
	}
	for _, k := range keys {
		m := l.mu.unfiled[k.NS]
		if sl, ok := m[k]; ok {
			l.clear(sl)
			delete(m, k)
		}
	}
}

// end forgets the ledger (recovery is done: every record is filed or gone).
func (l *ledger) end() {
	l.tombs.Stop()
	l.mu.Lock()
	l.mu.unfiled = nil
	l.mu.Unlock()
}

// Invalidating makes an Invalidate durable in the arena while recovery
// runs: the records of what it drops (keys, each naming its namespace, or
// keys nil: every block of the namespaces nss) that recovery has not filed
// yet are cleared in the arena file before it returns, and recovery will
// not file them (Settle reports them). Call it before the owner's index
// entries go. While recovery still reads the records it waits for that
// read to end; without a recovery it does nothing.
func (t *Tier) Invalidating(nss []uint32, keys []index.Key) {
	t.rec.ledger.invalidating(nss, keys)
}

// Settle is recovery's block of k being filed (Recoverer.File), under k's
// index lock: from here its record is the owner's (released with its slot),
// not the ledger's. It reports whether k was invalidated since recovery
// started: then the block must not be filed.
func (t *Tier) Settle(k *index.Key) (invalidated bool) {
	t.rec.ledger.settled(k)
	return t.rec.ledger.tombs.Has(k)
}
