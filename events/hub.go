// Package events owns the stream of what the cache holds: every time a
// block becomes ready in a tier or leaves one, the index tells the Hub
// (index.Observer), and each subscriber reads the changes of the
// namespaces it follows in order, after a snapshot of what was there when
// it came. KV-aware routers learn from it what this node holds (the vLLM
// KV event format is events/vllm's). docs/events.md is the contract.
//
// The changes go into one ring shared by every subscriber. A subscriber
// that falls further behind than the ring holds is told so (Lost) and
// starts over from a snapshot: it never silently misses a change.
package events

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// Kind is what an Event says.
type Kind uint8

// Kinds, numbered as the wire's EventKind.
const (
	// Stored: the block became ready in Tier.
	Stored Kind = 1
	// Removed: the block left Tier.
	Removed Kind = 2
	// Cleared: forget everything of the subscription's namespaces; a
	// snapshot follows (Stored events, then CaughtUp).
	Cleared Kind = 3
	// Lost: the subscriber fell behind and changes were lost; a Cleared
	// and a snapshot follow.
	Lost Kind = 4
	// CaughtUp: every change up to Seq has been delivered (the snapshot
	// is complete, or the subscriber has read all there is).
	CaughtUp Kind = 5
)

// Event is one change of one block's tiers, or a marker.
type Event struct {
	// Seq is the position in the daemon's sequence of changes the event
	// reflects: a change has its own, a snapshot's Stored events and a
	// marker carry the position they were taken at. Along one
	// subscription, Seq never decreases.
	Seq  uint64
	Kind Kind
	// Tier is one tier (index.InCPU or index.InDisk) for Stored and
	// Removed, 0 for markers.
	Tier    index.Tiers
	HashLen uint8     // bytes of Key.Hash that are the block hash
	Key     index.Key // NS, Group and Hash; zero for markers
}

// Hash is the block hash as the client sent it.
func (e *Event) Hash() []byte { return e.Key.Hash[:e.HashLen] }

// ErrTooMany is returned by Subscribe past Config.MaxSubscribers.
var ErrTooMany = errors.New("too many event subscriptions")

// Config sizes the hub.
type Config struct {
	// Buffer is the ring's length in changes, shared by every subscriber
	// (default DefaultBuffer). A subscriber more than Buffer changes
	// behind is told Lost.
	Buffer int
	// MaxSubscribers bounds the subscriptions (default
	// DefaultMaxSubscribers).
	MaxSubscribers int
}

// Defaults: the ring is 1<<16 changes of 56 bytes (3.5 MiB), allocated with
// the first subscription.
const (
	DefaultBuffer         = 1 << 16
	DefaultMaxSubscribers = 64
)

// scanMax bounds the ring entries one read looks at under the lock, so a
// subscriber of a quiet namespace skipping a busy one's changes does not
// hold up the writers.
const scanMax = 4096

// Hub fans the index's changes out to subscribers. Safe for concurrent use.
type Hub struct {
	ix  *index.Index
	cfg Config
	// active is the number of subscriptions: with none, a change costs
	// one atomic load.
	active atomic.Int32
	// hashLen is each namespace's hash length, copied on write (namespaces
	// come and go rarely; every change reads it).
	hashLen atomic.Pointer[map[uint32]uint8]
	hlMu    sync.Mutex
	// lost counts the times a subscriber fell behind the ring.
	lost atomic.Uint64

	// mu is a leaf: taken under an index shard's lock, never the other
	// way round.
	mu struct {
		sync.Mutex
		ring []Event
		seq  uint64 // the next change's Seq; the first is 1
		subs map[*Sub]struct{}
		// quiet counts, per namespace, the whole-namespace resets under
		// way: their changes are not recorded (EndReset records one
		// Cleared instead).
		quiet map[uint32]int
		last  map[uint32]uint64 // each namespace's last change
	}
}

// New makes a hub and makes ix report its changes to it.
func New(ix *index.Index, cfg Config) *Hub {
	if cfg.Buffer <= 0 {
		cfg.Buffer = DefaultBuffer
	}
	if cfg.MaxSubscribers <= 0 {
		cfg.MaxSubscribers = DefaultMaxSubscribers
	}
	h := &Hub{ix: ix, cfg: cfg}
	h.mu.seq = 1
	h.mu.subs = map[*Sub]struct{}{}
	h.mu.quiet = map[uint32]int{}
	h.mu.last = map[uint32]uint64{}
	m := map[uint32]uint8{}
	h.hashLen.Store(&m)
	ix.Observe(h)
	return h
}

// SetHashLen records namespace ns's hash length (n > 0) or forgets the
// namespace (n == 0, once it holds no block).
func (h *Hub) SetHashLen(ns uint32, n int) {
	h.hlMu.Lock()
	defer h.hlMu.Unlock()
	old := *h.hashLen.Load()
	m := make(map[uint32]uint8, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	if n > 0 {
		m[ns] = uint8(n)
	} else {
		delete(m, ns)
		h.mu.Lock()
		delete(h.mu.last, ns)
		h.mu.Unlock()
	}
	h.hashLen.Store(&m)
}

// Seq is the Seq of the last change recorded (0 before the first).
func (h *Hub) Seq() uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.mu.seq - 1
}

// TiersChanged implements index.Observer: it runs under k's shard lock, so
// the changes of a key are recorded in the order they happened.
func (h *Hub) TiersChanged(k *index.Key, before, after index.Tiers) {
	if h.active.Load() == 0 {
		return
	}
	hl := (*h.hashLen.Load())[k.NS]
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.mu.quiet) > 0 && h.mu.quiet[k.NS] > 0 {
		return
	}
	// The new tier first: a block moving from CPU to disk is never in
	// no tier along the way.
	for _, t := range [...]index.Tiers{index.InCPU, index.InDisk} {
		if after&t != 0 && before&t == 0 {
			h.recordLocked(Event{Kind: Stored, Tier: t, HashLen: hl, Key: *k})
		}
	}
	for _, t := range [...]index.Tiers{index.InCPU, index.InDisk} {
		if before&t != 0 && after&t == 0 {
			h.recordLocked(Event{Kind: Removed, Tier: t, HashLen: hl, Key: *k})
		}
	}
	h.wakeLocked(k.NS)
}

func (h *Hub) recordLocked(e Event) {
	e.Seq = h.mu.seq
	h.mu.ring[e.Seq%uint64(len(h.mu.ring))] = e
	h.mu.last[e.Key.NS] = e.Seq
	h.mu.seq++
}

// LastSeq is the Seq of namespace ns's last change (0 if none was
// recorded): a subscriber of ns has every change of it once it is told
// CaughtUp at that Seq or later.
func (h *Hub) LastSeq(ns uint32) uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.mu.last[ns]
}

// BeginReset starts a whole-namespace reset of namespaces nss (an
// Invalidate of all their blocks): their changes are not recorded until
// EndReset, which records one Cleared change per namespace instead. A
// subscriber of the namespace that reads it starts over from a snapshot: a
// router is told one reset, not a removal per block.
func (h *Hub) BeginReset(nss []uint32) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, ns := range nss {
		h.mu.quiet[ns]++
	}
}

// EndReset ends what BeginReset(nss) began.
func (h *Hub) EndReset(nss []uint32) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, ns := range nss {
		if h.mu.quiet[ns]--; h.mu.quiet[ns] <= 0 {
			delete(h.mu.quiet, ns)
		}
		if h.mu.ring != nil {
			h.recordLocked(Event{Kind: Cleared, Key: index.Key{NS: ns}})
		}
	}
	h.wakeLocked(nss...)
}

func (h *Hub) wakeLocked(nss ...uint32) {
	for s := range h.mu.subs {
		for _, ns := range nss {
			if s.follows(ns) {
				s.wake()
				break
			}
		}
	}
}

// Subscribe follows the namespaces nss (nil: every namespace). With
// snapshot, the subscription starts with Cleared, a Stored event for every
// tier of every block there now, and CaughtUp; without, with the next
// change. Close it when done.
func (h *Hub) Subscribe(nss []uint32, snapshot bool) (*Sub, error) {
	s := &Sub{h: h, nss: append([]uint32(nil), nss...), wakeC: make(chan struct{}, 1)}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.mu.subs) >= h.cfg.MaxSubscribers {
		return nil, ErrTooMany
	}
	if h.mu.ring == nil {
		h.mu.ring = make([]Event, h.cfg.Buffer)
	}
	h.mu.subs[s] = struct{}{}
	h.active.Store(int32(len(h.mu.subs)))
	s.next = h.mu.seq
	s.resync = snapshot
	return s, nil
}

// Subscribers is the number of subscriptions open.
func (h *Hub) Subscribers() int { return int(h.active.Load()) }

// Lost is how many times a subscriber fell behind the ring and was told
// Lost.
func (h *Hub) Lost() uint64 { return h.lost.Load() }

// Sub is one subscription. Its Next is for one goroutine at a time.
type Sub struct {
	h     *Hub
	nss   []uint32 // followed namespaces; empty: all
	wakeC chan struct{}

	// Guarded by h.mu.
	next   uint64 // the next change to read
	resync bool   // start over from a snapshot at the next read
	closed bool

	// The reader's own.
	lost     bool // the last read found changes gone: say so first
	snapping bool // a snapshot is being sent
	shard    int  // the shard being snapshotted
	loaded   bool // snap holds shard's entries, taken at snapAt
	snap     []Event
	snapAt   uint64 // the Seq the shard was scanned at (the next change's)
	sent     bool   // events were sent since the last CaughtUp
}

func (s *Sub) follows(ns uint32) bool {
	if len(s.nss) == 0 {
		return true
	}
	for _, n := range s.nss {
		if n == ns {
			return true
		}
	}
	return false
}

func (s *Sub) wake() {
	select {
	case s.wakeC <- struct{}{}:
	default:
	}
}

// Close ends the subscription.
func (s *Sub) Close() {
	h := s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	delete(h.mu.subs, s)
	h.active.Store(int32(len(h.mu.subs)))
}

// ErrStopped is returned by Next once stop is closed.
var ErrStopped = errors.New("event stream stopped")

// Next appends to out (up to cap(out), at least 8) the next events of the
// subscription, waiting for a change when there is none, until ctx ends or
// stop is closed.
func (s *Sub) Next(ctx context.Context, stop <-chan struct{}, out []Event) ([]Event, error) {
	out = out[:0]
	room := max(cap(out), 8)
	for {
		if s.startOver() {
			at := s.cursor() - 1
			if s.lost {
				out = append(out, Event{Seq: at, Kind: Lost})
				s.lost = false
			}
			out = append(out, Event{Seq: at, Kind: Cleared})
			s.snapping, s.shard, s.loaded, s.snap = true, 0, false, s.snap[:0]
			s.sent = true
			return out, nil
		}
		if s.snapping {
			if !s.loaded {
				s.scan()
			}
			// The changes the shard's scan already reflects go first.
			var ok, behind bool
			if out, behind, ok = s.read(out, room, s.snapAt); !ok {
				continue
			}
			if len(out) > 0 {
				return out, nil
			}
			if behind {
				continue
			}
			n := min(len(s.snap), room)
			out = append(out, s.snap[:n]...)
			s.snap = s.snap[n:]
			if len(s.snap) == 0 {
				s.loaded = false
				if s.shard++; s.shard == index.Shards {
					s.snapping = false
					out = append(out, s.caughtUp(s.snapAt-1))
				}
			}
			if len(out) > 0 {
				return out, nil
			}
			continue
		}
		var ok, behind bool
		if out, behind, ok = s.read(out, room, ^uint64(0)); !ok {
			continue
		}
		if len(out) > 0 {
			s.sent = true
			return out, nil
		}
		if behind {
			continue
		}
		if s.sent {
			// Idle: every change up to here is delivered.
			return append(out, s.caughtUp(s.cursor()-1)), nil
		}
		select {
		case <-s.wakeC:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-stop:
			return nil, ErrStopped
		}
	}
}

func (s *Sub) caughtUp(at uint64) Event {
	s.sent = false
	return Event{Seq: at, Kind: CaughtUp}
}

// startOver reports whether the subscription must start over from a
// snapshot (asked for, forced by a reset, or after a loss), and if so
// moves its cursor to now.
func (s *Sub) startOver() bool {
	h := s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if !s.resync && !s.lost {
		return false
	}
	s.resync = false
	s.next = h.mu.seq
	return true
}

func (s *Sub) cursor() uint64 {
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	return s.next
}

// read appends the followed changes from the cursor up to (not including)
// upTo, at most room events in out; behind reports that it stopped short
// of upTo and the last change (out is full, or it looked at scanMax
// changes). It reports ok false when the subscriber must start over from a
// snapshot: changes past the cursor are gone from the ring (it lost
// them), or it reached a reset of a namespace it follows.
func (s *Sub) read(out []Event, room int, upTo uint64) (_ []Event, behind, ok bool) {
	h := s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	ring := uint64(len(h.mu.ring))
	if h.mu.seq > ring && s.next < h.mu.seq-ring {
		s.lost = true
		h.lost.Add(1)
		return out, false, false
	}
	limit := min(upTo, h.mu.seq)
	end := min(limit, s.next+scanMax)
	for ; s.next < end && len(out) < room; s.next++ {
		e := &h.mu.ring[s.next%ring]
		if !s.follows(e.Key.NS) {
			continue
		}
		if e.Kind == Cleared {
			// A whole-namespace reset: start over from a snapshot.
			s.resync = true
			return out, false, false
		}
		out = append(out, *e)
	}
	return out, s.next < limit, true
}

// scan takes the next shard's part of the snapshot: its followed blocks'
// tiers as Stored events, and the Seq of the next change, all under the
// shard's lock, so the changes before snapAt are in the scan and those
// from it on are not.
func (s *Sub) scan() {
	hl := *s.h.hashLen.Load()
	s.snap = s.snap[:0]
	s.h.ix.ScanShard(s.shard, func(k *index.Key, t index.Tiers) {
		if !s.follows(k.NS) {
			return
		}
		for _, tier := range [...]index.Tiers{index.InCPU, index.InDisk} {
			if t&tier != 0 {
				s.snap = append(s.snap, Event{Kind: Stored, Tier: tier, HashLen: hl[k.NS], Key: *k})
			}
		}
	}, func() {
		s.h.mu.Lock()
		s.snapAt = s.h.mu.seq
		s.h.mu.Unlock()
	})
	for i := range s.snap {
		s.snap[i].Seq = s.snapAt - 1
	}
	// One moment of the shard, in any order: grouped by namespace, group
	// and tier, a vLLM event carries many hashes (VLLM.AppendBatch).
	slices.SortStableFunc(s.snap, func(a, b Event) int {
		return cmp.Or(cmp.Compare(a.Key.NS, b.Key.NS), cmp.Compare(a.Key.Group, b.Key.Group), cmp.Compare(a.Tier, b.Tier))
	})
	s.loaded = true
}
