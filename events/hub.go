// Package events owns the stream of what the cache holds: every time a
// block becomes ready in a tier or leaves one, the index tells the Hub
// (index.Observer), and each subscriber reads the changes of the
// namespaces it follows in order, after a snapshot of what was there when
// it came. KV-aware routers learn from it what this node holds (the vLLM
// KV event format is events/vllm's). docs/events.md is the contract.
//
// The changes go into one ring shared by every subscriber (ring.go). A
// subscriber that falls further behind than the ring holds is told so
// (Lost) and starts over from a snapshot: it never silently misses a
// change.
package events

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

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
	// Tier is one tier (index.InCPU, index.InDisk or Remote) for Stored
	// and Removed, 0 for markers.
	Tier    index.Tiers
	HashLen uint8     // bytes of Key.Hash that are the block hash
	Key     index.Key // NS, Group and Hash; zero for markers
}

// Remote is the shared remote tier as an Event's Tier: not one of the
// index's tiers (the index holds this node's copies only), the value of
// the wire's TIER_REMOTE. Its events are what this node saw of the remote
// tier (RemoteChanged), never part of a snapshot.
const Remote index.Tiers = 1 << 2

// Hash is the block hash as the client sent it.
func (e *Event) Hash() []byte { return e.Key.Hash[:e.HashLen] }

// ErrTooMany is returned by Subscribe past Config.MaxSubscribers.
var ErrTooMany = errors.New("too many event subscriptions")

// Config sizes the hub.
type Config struct {
	// Buffer is the ring's length in changes, shared by every subscriber
	// (default DefaultBuffer, rounded up to a power of two). A subscriber
	// more than Buffer changes behind is told Lost.
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

// scanMax bounds the ring entries one read looks at, so a subscriber of a
// quiet namespace skipping a busy one's changes hands control back now and
// then.
const scanMax = 4096

// Hub fans the index's changes out to subscribers. Safe for concurrent use.
//
// The data path (TiersChanged, under a shard lock of the index) pays for no
// subscriber: it reserves each change's Seq with one atomic add, writes the
// change into the ring's slot for that Seq, and at most once per round of
// the hub's fan-out goroutine hands it a notice. That goroutine, running
// while there are subscriptions, reads the new changes and wakes the
// subscribers of the namespaces they touched (per-namespace lists, copied
// on write when a subscription comes or goes). Each subscriber reads the
// ring itself, from its own cursor.
type Hub struct {
	ix  *index.Index
	cfg Config
	// active is the number of subscriptions: with none, a change costs
	// one atomic load.
	active atomic.Int32
	// ns is each namespace's state, the map copied on write under nsMu
	// (namespaces come and go rarely; every change reads it).
	ns   atomic.Pointer[map[uint32]*nsState]
	nsMu sync.Mutex
	// lost counts the times a subscriber fell behind the ring.
	lost atomic.Uint64
	// demand counts the requests served that wait on the daemon's CPU
	// (Lookups): a snapshot paces itself while it moves (Sub.pace).
	demand atomic.Uint64
	// paused is the time snapshots paused for Lookups, in nanoseconds.
	paused atomic.Int64

	// next is the Seq the next change takes (the first is 1). A change
	// of a key reserves its Seq under the key's shard lock, so one key's
	// changes are in the order they happened, and a shard's scan taken
	// under the lock sees exactly the changes before the next Seq.
	next atomic.Uint64
	ring atomic.Pointer[ring] // allocated with the first subscription

	// kick carries the data path's notice to the fan-out goroutine;
	// kicked is set while one is pending, so a change sends at most one.
	kick   chan struct{}
	kicked atomic.Bool
	// follow is who follows what, for the fan-out goroutine; replaced
	// under mu.
	follow atomic.Pointer[followers]

	mu struct {
		sync.Mutex
		subs map[*Sub]struct{}
		fan  *fanout // running while there are subscriptions
	}
}

// nsState is what the data path needs of a namespace.
type nsState struct {
	hashLen atomic.Uint32
	// quiet counts the whole-namespace resets under way: their changes
	// are not recorded (EndReset records one Cleared instead).
	quiet atomic.Int32
	last  atomic.Uint64 // the namespace's last change
}

// followers lists the subscriptions to wake for a namespace's change.
type followers struct {
	all  []*Sub            // those following every namespace
	byNS map[uint32][]*Sub // the others, by followed namespace
}

// New makes a hub and makes ix report its changes to it.
func New(ix *index.Index, cfg Config) *Hub {
	if cfg.Buffer <= 0 {
		cfg.Buffer = DefaultBuffer
	}
	if cfg.MaxSubscribers <= 0 {
		cfg.MaxSubscribers = DefaultMaxSubscribers
	}
	h := &Hub{ix: ix, cfg: cfg, kick: make(chan struct{}, 1)}
	h.next.Store(1)
	h.mu.subs = map[*Sub]struct{}{}
	m := map[uint32]*nsState{}
	h.ns.Store(&m)
	h.follow.Store(&followers{})
	ix.Observe(h)
	return h
}

// nsLocked returns namespace ns's state, made if create and it has none
// (nil otherwise); the caller holds nsMu.
func (h *Hub) nsLocked(ns uint32, create bool) *nsState {
	old := *h.ns.Load()
	if st := old[ns]; st != nil || !create {
		return st
	}
	m := make(map[uint32]*nsState, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	st := &nsState{}
	m[ns] = st
	h.ns.Store(&m)
	return st
}

// SetHashLen records namespace ns's hash length (n > 0) or forgets the
// namespace (n == 0, once it holds no block).
func (h *Hub) SetHashLen(ns uint32, n int) {
	h.nsMu.Lock()
	defer h.nsMu.Unlock()
	if n > 0 {
		h.nsLocked(ns, true).hashLen.Store(uint32(n))
		return
	}
	st := h.nsLocked(ns, false)
	if st == nil {
		return
	}
	if st.quiet.Load() > 0 {
		// A reset under way ends with its Cleared.
		st.hashLen.Store(0)
		st.last.Store(0)
		return
	}
	old := *h.ns.Load()
	m := make(map[uint32]*nsState, len(old))
	for k, v := range old {
		if k != ns {
			m[k] = v
		}
	}
	h.ns.Store(&m)
}

// Demand tells the hub a request that waits on the daemon (a Lookup) is
// being served: a snapshot streamed meanwhile takes at most a share of
// the CPU (snapPace). One atomic add.
func (h *Hub) Demand() { h.demand.Add(1) }

// Paused is how long snapshots paused in all, leaving the CPU to Lookups.
func (h *Hub) Paused() time.Duration { return time.Duration(h.paused.Load()) }

// Seq is the Seq of the last change recorded (0 before the first).
func (h *Hub) Seq() uint64 { return h.next.Load() - 1 }

// TiersChanged implements index.Observer: it runs under k's shard lock, so
// the changes of a key are recorded in the order they happened. It takes
// no lock and its cost does not depend on the subscribers.
func (h *Hub) TiersChanged(k *index.Key, before, after index.Tiers) {
	if h.active.Load() == 0 {
		return
	}
	r := h.ring.Load()
	st := (*h.ns.Load())[k.NS]
	if st == nil {
		// A namespace SetHashLen has not named (once per namespace).
		h.nsMu.Lock()
		st = h.nsLocked(k.NS, true)
		h.nsMu.Unlock()
	}
	if st.quiet.Load() > 0 {
		return
	}
	hl := uint8(st.hashLen.Load())
	// The new tier first: a block moving from CPU to disk is never in
	// no tier along the way.
	for _, t := range [...]index.Tiers{index.InCPU, index.InDisk} {
		if after&t != 0 && before&t == 0 {
			h.record(r, st, Event{Kind: Stored, Tier: t, HashLen: hl, Key: *k})
		}
	}
	for _, t := range [...]index.Tiers{index.InCPU, index.InDisk} {
		if before&t != 0 && after&t == 0 {
			h.record(r, st, Event{Kind: Removed, Tier: t, HashLen: hl, Key: *k})
		}
	}
	h.notify()
}

// RemoteChanged records what this node saw of k in the remote tier: the
// store acknowledged holding it (stored) or it is gone from there (this
// node invalidated it, deleted it as corrupt or stale, or a load found it
// missing). It runs under no lock of the index: the caller orders one
// key's remote changes itself (the publisher's acknowledgements against
// the Cancel of an Invalidate), and a remote change is in no snapshot, so
// no scan has to see it. Like TiersChanged, it takes no lock and pays for
// no subscriber. A namespace the hub does not know (never registered, or
// forgotten) has nothing to say.
func (h *Hub) RemoteChanged(k *index.Key, stored bool) {
	if h.active.Load() == 0 {
		return
	}
	st := (*h.ns.Load())[k.NS]
	if st == nil || st.quiet.Load() > 0 {
		return
	}
	hl := uint8(st.hashLen.Load())
	if hl == 0 {
		return
	}
	kind := Removed
	if stored {
		kind = Stored
	}
	h.record(h.ring.Load(), st, Event{Kind: kind, Tier: Remote, HashLen: hl, Key: *k})
	h.notify()
}

// record gives e the next Seq and writes it into the ring.
func (h *Hub) record(r *ring, st *nsState, e Event) {
	e.Seq = h.next.Add(1) - 1
	r.put(&e)
	for {
		last := st.last.Load()
		if last >= e.Seq || st.last.CompareAndSwap(last, e.Seq) {
			break
		}
	}
}

// notify tells the fan-out goroutine there are changes, unless a notice
// is already pending: it has not started its next round, which reads
// every change recorded before it starts.
func (h *Hub) notify() {
	if !h.kicked.Load() && h.kicked.CompareAndSwap(false, true) {
		select {
		case h.kick <- struct{}{}:
		default:
		}
	}
}

// LastSeq is the Seq of namespace ns's last change (0 if none was
// recorded): a subscriber of ns has every change of it once it is told
// CaughtUp at that Seq or later.
func (h *Hub) LastSeq(ns uint32) uint64 {
	if st := (*h.ns.Load())[ns]; st != nil {
		return st.last.Load()
	}
	return 0
}

// BeginReset starts a whole-namespace reset of namespaces nss (an
// Invalidate of all their blocks): their changes are not recorded until
// EndReset, which records one Cleared change per namespace instead. A
// subscriber of the namespace that reads it starts over from a snapshot: a
// router is told one reset, not a removal per block.
func (h *Hub) BeginReset(nss []uint32) {
	h.nsMu.Lock()
	defer h.nsMu.Unlock()
	for _, ns := range nss {
		h.nsLocked(ns, true).quiet.Add(1)
	}
}

// EndReset ends what BeginReset(nss) began.
func (h *Hub) EndReset(nss []uint32) {
	h.nsMu.Lock()
	defer h.nsMu.Unlock()
	r := h.ring.Load()
	for _, ns := range nss {
		st := h.nsLocked(ns, true)
		if st.quiet.Add(-1) < 0 {
			st.quiet.Store(0)
		}
		if r != nil {
			h.record(r, st, Event{Kind: Cleared, Key: index.Key{NS: ns}})
		}
	}
	if r != nil {
		h.notify()
	}
}

// fanout is one run of the fan-out goroutine.
type fanout struct {
	stop, done chan struct{}
}

// fanMax bounds the changes one round of the fan-out goroutine reads; past
// it (or past the ring) it wakes every subscriber instead.
const fanMax = 1 << 14

// fan wakes the subscribers of the namespaces each round's changes touched,
// from Seq at on, until stop is closed (the last subscription closed).
func (h *Hub) fan(f *fanout, r *ring, at uint64) {
	defer close(f.done)
	changed := map[uint32]struct{}{}
	for {
		select {
		case <-h.kick:
		case <-f.stop:
			return
		}
		h.kicked.Store(false)
		end := h.next.Load()
		fl := h.follow.Load()
		all := end-at > min(fanMax, r.size())
		clear(changed)
		last, any := uint32(0), false
		for ; !all && at < end; at++ {
			e, ok := r.get(h, at)
			if !ok {
				all = true
				break
			}
			if !any || e.Key.NS != last {
				changed[e.Key.NS] = struct{}{}
				last, any = e.Key.NS, true
			}
		}
		if all {
			at = end
			for _, subs := range fl.byNS {
				for _, s := range subs {
					s.wake()
				}
			}
		}
		for ns := range changed {
			for _, s := range fl.byNS[ns] {
				s.wake()
			}
		}
		if all || any {
			for _, s := range fl.all {
				s.wake()
			}
		}
	}
}

// followLocked rebuilds the followers from the subscriptions; the caller
// holds mu.
func (h *Hub) followLocked() {
	fl := &followers{byNS: map[uint32][]*Sub{}}
	for s := range h.mu.subs {
		if len(s.nss) == 0 {
			fl.all = append(fl.all, s)
			continue
		}
		for _, ns := range s.nss {
			fl.byNS[ns] = append(fl.byNS[ns], s)
		}
	}
	h.follow.Store(fl)
	h.active.Store(int32(len(h.mu.subs)))
}

// Subscribe follows the namespaces nss (nil: every namespace). With
// snapshot, the subscription starts with Cleared, a Stored event for every
// tier of every block there now, and CaughtUp; without, with the next
// change. Close it when done.
func (h *Hub) Subscribe(nss []uint32, snapshot bool) (*Sub, error) {
	s := &Sub{h: h, nss: slices.Compact(slices.Sorted(slices.Values(nss))), wakeC: make(chan struct{}, 1), demand: h.demand.Load()}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.mu.subs) >= h.cfg.MaxSubscribers {
		return nil, ErrTooMany
	}
	r := h.ring.Load()
	if r == nil {
		r = newRing(h.cfg.Buffer)
		h.ring.Store(r)
	}
	if h.mu.fan == nil {
		// From before the subscription's cursor: it is woken for every
		// change past it.
		f := &fanout{stop: make(chan struct{}), done: make(chan struct{})}
		h.mu.fan = f
		go h.fan(f, r, h.next.Load())
	}
	h.mu.subs[s] = struct{}{}
	h.followLocked()
	s.next = h.next.Load()
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
	nss   []uint32 // followed namespaces, sorted; empty: all
	wakeC chan struct{}

	closed bool // guarded by h.mu

	// The reader's own.
	next     uint64  // the next change to read
	resync   bool    // start over from a snapshot at the next read
	lost     bool    // the last read found changes gone: say so first
	snapping bool    // a snapshot is being sent
	shard    int     // the shard being snapshotted
	pos      int     // the shard's next record position to scan
	final    bool    // snap is the snapshot's last chunk
	loaded   bool    // snap holds a chunk's entries, taken at snapAt
	snap     []Event // what is left to send of them
	snapBuf  []Event // snap's array, from its start: reused chunk after chunk
	snapAt   uint64  // the Seq the chunk was scanned at (the next change's)
	sent     bool    // events were sent since the last CaughtUp
	// Pacing the snapshot (pace).
	replyAt time.Time   // when the current snapshot reply began
	demand  uint64      // the hub's demand when last looked at
	busyAt  time.Time   // when it was last seen to move
	timer   *time.Timer // the pause's, reused
}

func (s *Sub) follows(ns uint32) bool {
	if len(s.nss) == 0 {
		return true
	}
	_, ok := slices.BinarySearch(s.nss, ns)
	return ok
}

func (s *Sub) wake() {
	select {
	case s.wakeC <- struct{}{}:
	default:
	}
}

// Close ends the subscription. The last one stops the hub's fan-out
// goroutine and waits for it.
func (s *Sub) Close() {
	h := s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	delete(h.mu.subs, s)
	h.followLocked()
	if f := h.mu.fan; f != nil && len(h.mu.subs) == 0 {
		// Waited for under mu: a Subscribe starts the next one only once
		// this one no longer takes notices.
		close(f.stop)
		<-f.done
		h.mu.fan = nil
	}
}

// ErrStopped is returned by Next once stop is closed.
var ErrStopped = errors.New("event stream stopped")

// Next appends to out (up to cap(out), at least 8; at most snapBusyReply
// during a snapshot while Lookups are served) the next events of the
// subscription, waiting for a change when there is none, until ctx ends or
// stop is closed. During a snapshot, it first pauses while Lookups are
// served (pace).
func (s *Sub) Next(ctx context.Context, stop <-chan struct{}, out []Event) ([]Event, error) {
	out = out[:0]
	room := max(cap(out), 8)
	if s.snapping {
		busy, err := s.pace(ctx, stop)
		if err != nil {
			return nil, err
		}
		if busy {
			room = min(room, snapBusyReply)
		}
	}
	for {
		if s.startOver() {
			at := s.cursor() - 1
			if s.lost {
				out = append(out, Event{Seq: at, Kind: Lost})
				s.lost = false
			}
			out = append(out, Event{Seq: at, Kind: Cleared})
			s.snapping, s.shard, s.pos, s.final, s.loaded, s.snap = true, 0, 0, false, false, s.snap[:0]
			s.sent, s.replyAt = true, time.Time{}
			return out, nil
		}
		if s.snapping {
			if !s.loaded {
				s.scan()
			}
			// The changes the chunk's scan already reflects go first.
			var ok, behind bool
			if out, behind, ok = s.read(out, room, s.snapAt); !ok {
				continue
			}
			if behind {
				if len(out) >= room {
					return out, nil
				}
				continue
			}
			n := min(len(s.snap), room-len(out))
			out = append(out, s.snap[:n]...)
			s.snap = s.snap[n:]
			if len(s.snap) == 0 {
				s.loaded = false
				if s.final {
					s.snapping = false
					return append(out, s.caughtUp(s.snapAt-1)), nil
				}
			}
			// Chunk after chunk into one reply, until it is full: a
			// reply per chunk (64 records) cost the daemon and its
			// reader a message, a write and a wakeup per 64 blocks.
			if len(out) >= room {
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

// While Lookups are served (busy: one came in the last snapBusyFor), a
// snapshot paces itself: before each reply it pauses snapPace times as long
// as the previous reply took (from its first scan to the next reply's
// start: the scan, and the caller's encoding and sending), so it works at
// most 1/(1+snapPace) of the time; snapPauseMax bounds one pause (a reply
// that took long waited on its reader, not on the CPU). A busy reply holds
// at most snapBusyReply events: the CPU one reply takes at once (encoding
// it here, decoding it at a router on the same host) is what a Lookup
// coming meanwhile may wait for.
//
// The pace is set for a router that decodes on the engine's host: the
// daemon's own work per event is a fraction of what a reader spends on it,
// so the time left to Lookups is what the reader takes too. kvbench's scale
// scenario (docs/benchmarks.md) measured the choices on 2 cores at 10^5
// blocks: a pace of 3 with 256-event replies kept the Lookups' p99 at
// 3.1-3.7 times idle; 10 with 128, at 1.7-2.3 times, the snapshot taking
// twice as long while Lookups come (none of it when they do not).
//
// Busy lasts snapBusyFor after a Lookup, not only the reply after it: an
// engine's Lookups come every few hundred microseconds, a reply is cut
// every few tens, and a pace that looked only at the Lookups since the last
// reply ran at full speed most of the time.
const (
	snapPace      = 10
	snapPauseMax  = 20 * time.Millisecond
	snapBusyReply = 128
)

// snapBusyFor is how long a snapshot stays paced after a Lookup (a var for
// tests).
var snapBusyFor = 100 * time.Millisecond

// pace starts the next reply of a snapshot: if a Lookup was served in the
// last snapBusyFor (busy), it first pauses snapPace times as long as the
// previous reply took. Idle, a snapshot runs at full speed.
func (s *Sub) pace(ctx context.Context, stop <-chan struct{}) (busy bool, _ error) {
	now := s.demandSeen(time.Now())
	busy = !s.busyAt.IsZero() && now.Sub(s.busyAt) < snapBusyFor
	if !s.replyAt.IsZero() && busy {
		wait := min(now.Sub(s.replyAt)*snapPace, snapPauseMax)
		if s.timer == nil {
			s.timer = time.NewTimer(wait)
		} else {
			s.timer.Reset(wait)
		}
		select {
		case <-s.timer.C:
		case <-ctx.Done():
			s.timer.Stop()
			return busy, ctx.Err()
		case <-stop:
			s.timer.Stop()
			return busy, ErrStopped
		}
		s.h.paused.Add(int64(wait))
		now = s.demandSeen(time.Now())
	}
	s.replyAt = now
	return busy, nil
}

// demandSeen notes at now whether Lookups came since the last look (the
// hub's demand moved) and returns now.
func (s *Sub) demandSeen(now time.Time) time.Time {
	if d := s.h.demand.Load(); d != s.demand {
		s.demand, s.busyAt = d, now
	}
	return now
}

// take is scan's callback, under the shard's lock: it adds a followed
// block's Stored events to the chunk.
func (s *Sub) take(k *index.Key, t index.Tiers) {
	if !s.follows(k.NS) {
		return
	}
	var hl uint8
	if st := (*s.h.ns.Load())[k.NS]; st != nil {
		hl = uint8(st.hashLen.Load())
	}
	for _, tier := range [...]index.Tiers{index.InCPU, index.InDisk} {
		if t&tier != 0 {
			s.snap = append(s.snap, Event{Kind: Stored, Tier: tier, HashLen: hl, Key: *k})
		}
	}
}

// taken ends a chunk's scan, under the shard's lock: the next change is
// not in it.
func (s *Sub) taken() { s.snapAt = s.h.next.Load() }

func (s *Sub) caughtUp(at uint64) Event {
	s.sent = false
	return Event{Seq: at, Kind: CaughtUp}
}

// startOver reports whether the subscription must start over from a
// snapshot (asked for, forced by a reset, or after a loss), and if so
// moves its cursor to now.
func (s *Sub) startOver() bool {
	if !s.resync && !s.lost {
		return false
	}
	s.resync = false
	s.next = s.h.next.Load()
	return true
}

func (s *Sub) cursor() uint64 { return s.next }

// read appends the followed changes from the cursor up to (not including)
// upTo, at most room events in out; behind reports that it stopped short
// of upTo and the last change (out is full, or it looked at scanMax
// changes). It reports ok false when the subscriber must start over from a
// snapshot: changes past the cursor are gone from the ring (it lost
// them), or it reached a reset of a namespace it follows.
func (s *Sub) read(out []Event, room int, upTo uint64) (_ []Event, behind, ok bool) {
	h := s.h
	r := h.ring.Load()
	now := h.next.Load()
	if now-s.next > r.size() {
		s.lost = true
		h.lost.Add(1)
		return out, false, false
	}
	limit := min(upTo, now)
	end := min(limit, s.next+scanMax)
	for ; s.next < end && len(out) < room; s.next++ {
		e, ok := r.get(h, s.next)
		if !ok {
			s.lost = true
			h.lost.Add(1)
			return out, false, false
		}
		if !s.follows(e.Key.NS) {
			continue
		}
		if e.Kind == Cleared {
			// A whole-namespace reset: start over from a snapshot.
			s.resync = true
			return out, false, false
		}
		out = append(out, e)
	}
	return out, s.next < limit, true
}

// snapChunk bounds the records one step of a snapshot scans under a
// shard's lock (a few µs): Lookups and stores of that shard wait at
// most that long, and the subscription holds at most twice as many
// events, whatever the number of blocks.
const snapChunk = 64

// scan takes the next chunk of the snapshot: the followed blocks' tiers
// among snapChunk records of a shard as Stored events, and the Seq of the
// next change, all under the shard's lock, so the changes before snapAt
// are in the scan and those from it on are not. Between chunks the lock
// is released: a change meanwhile is in the ring, read before the next
// chunk's entries (those before its snapAt) or after them, so each key's
// last word is its state (index.ScanChunk visits every key that stays
// put; one that changes is told by its changes).
func (s *Sub) scan() {
	s.snap = s.snapBuf[:0]
	next, more := s.h.ix.ScanChunk(s.shard, s.pos, snapChunk, s.take, s.taken)
	s.snapBuf = s.snap[:0] // sending moves snap's start: keep the array's
	if s.pos = next; !more {
		s.shard, s.pos = s.shard+1, 0
	}
	s.final = s.shard == index.Shards
	for i := range s.snap {
		s.snap[i].Seq = s.snapAt - 1
	}
	// One moment of the chunk, in any order: grouped by namespace, group
	// and tier, a vLLM event carries many hashes (VLLM.AppendBatch).
	slices.SortStableFunc(s.snap, func(a, b Event) int {
		return cmp.Or(cmp.Compare(a.Key.NS, b.Key.NS), cmp.Compare(a.Key.Group, b.Key.Group), cmp.Compare(a.Tier, b.Tier))
	})
	s.loaded = true
}
