package events

import (
	"encoding/binary"
	"math/bits"
	"runtime"
	"sync/atomic"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// ring holds the last size changes, the change of Seq q in slot q mod
// size. Writers take no lock: each has reserved its own Seq (Hub.next),
// and a slot's version says which Seq it holds and whether it is whole.
// Every word is read and written atomically, so a reader racing a writer
// of the same slot sees a torn slot only as a version that does not match,
// never as a data race.
type ring struct {
	mask  uint64
	slots []slot
}

// slot is one change: ver is 2q+1 while the change of Seq q is written
// into it and 2q+2 once it is whole; w is the event without its Seq.
type slot struct {
	ver atomic.Uint64
	w   [6]atomic.Uint64 // kind, tier, hash length and namespace; group; the hash
}

func newRing(n int) *ring {
	size := uint64(1) << bits.Len64(uint64(n-1)) // a power of two, at least n
	return &ring{mask: size - 1, slots: make([]slot, size)}
}

func (r *ring) size() uint64 { return r.mask + 1 }

// put writes e into its Seq's slot.
func (r *ring) put(e *Event) {
	sl := &r.slots[e.Seq&r.mask]
	sl.ver.Store(2*e.Seq + 1)
	sl.w[0].Store(uint64(e.Kind) | uint64(e.Tier)<<8 | uint64(e.HashLen)<<16 | uint64(e.Key.NS)<<32)
	sl.w[1].Store(uint64(e.Key.Group))
	for i := range 4 {
		sl.w[2+i].Store(binary.LittleEndian.Uint64(e.Key.Hash[8*i:]))
	}
	sl.ver.Store(2*e.Seq + 2)
}

// get reads the change of Seq q (q < h.next: reserved). If its writer has
// not finished, it waits for it: a writer writes its slot right after
// reserving the Seq, under a shard lock, calling nothing that blocks. It
// reports false when the change is gone: the slot holds a later one, or
// may have begun to.
func (r *ring) get(h *Hub, q uint64) (Event, bool) {
	sl := &r.slots[q&r.mask]
	for {
		v := sl.ver.Load()
		if v > 2*q+2 {
			return Event{}, false
		}
		if v < 2*q+2 {
			runtime.Gosched()
			continue
		}
		w0, w1 := sl.w[0].Load(), sl.w[1].Load()
		e := Event{Seq: q, Kind: Kind(w0), Tier: index.Tiers(w0 >> 8), HashLen: uint8(w0 >> 16)}
		e.Key.NS, e.Key.Group = uint32(w0>>32), uint32(w1)
		for i := range 4 {
			binary.LittleEndian.PutUint64(e.Key.Hash[8*i:], sl.w[2+i].Load())
		}
		// Whole unless the writer of Seq q+size has reserved it since: only
		// that writer can touch the slot after this one finished.
		if h.next.Load() > q+r.size() {
			return Event{}, false
		}
		return e, true
	}
}
