package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Mirror is what the daemon holds for some namespaces, kept in kvbench's
// process from the daemon's WatchEvents stream, by the rules of the Python
// connector's LookupMirror (clients/python/kvoffload/mirror.py, issue 32):
// a reset and a snapshot, then every change; it answers lookups from memory
// only while live (caught up on the stream it follows, the stream not
// ended), and the caller asks the daemon otherwise. ALL_BLOCKS_CLEARED and
// EVENTS_LOST clear it until the next CAUGHT_UP; past maxBlocks entries,
// or against a daemon without WatchEvents, it stops for good. A stream
// that ended is followed again (the same namespaces: kvbench's engine keeps
// its registration for the run) after 0.2 s, doubling to 5 s while streams
// end before catching up.
//
// Close stops its goroutine and waits for it.
type Mirror struct {
	c         *client.Client
	ns        []uint32
	maxBlocks int

	mu sync.RWMutex
	// namespace -> group -> hash -> tier bits (1 CPU, 2 disk, 4 remote).
	maps     map[uint32]map[uint32]map[string]uint8
	n        int
	live     bool
	overflow bool
	streams  int
	resets   int
	lastErr  error

	cancel context.CancelFunc
	done   chan struct{}
}

// NewMirror follows namespaces over c (a connection of its own: the stream
// holds it) until Close.
func NewMirror(c *client.Client, namespaces []uint32, maxBlocks int) *Mirror {
	ctx, cancel := context.WithCancel(context.Background())
	m := &Mirror{c: c, ns: namespaces, maxBlocks: maxBlocks, maps: map[uint32]map[uint32]map[string]uint8{},
		cancel: cancel, done: make(chan struct{})}
	go m.run(ctx)
	return m
}

// Close stops following and waits for the goroutine.
func (m *Mirror) Close() {
	m.cancel()
	<-m.done
}

// Live says whether lookups are answered from memory now.
func (m *Mirror) Live() bool {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.live
}

// Counts reports the entries held, streams opened, resets (clears) seen,
// whether it stopped for good, and the last stream's end.
func (m *Mirror) Counts() (blocks, streams, resets int, overflow bool, lastErr error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.n, m.streams, m.resets, m.overflow, m.lastErr
}

// Lookup answers as the daemon's Lookup of keys in namespaces, group g
// would, from memory: the tier of each leading key every namespace holds
// (the slowest across namespaces). live is false when it cannot answer
// (the caller asks the daemon).
func (m *Mirror) Lookup(namespaces []uint32, g uint32, keys [][]byte, tiers []pb.Tier) (_ []pb.Tier, live bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if !m.live {
		return tiers, false
	}
	for _, ns := range namespaces {
		if !slices.Contains(m.ns, ns) {
			return tiers, false // not followed: only the daemon knows
		}
	}
	for _, k := range keys {
		worst := pb.Tier_TIER_NONE
		for _, ns := range namespaces {
			b := m.maps[ns][g][string(k)]
			if b == 0 {
				return tiers, true
			}
			if t := tierOf(b); rank(t) > rank(worst) || worst == pb.Tier_TIER_NONE {
				worst = t
			}
		}
		tiers = append(tiers, worst)
	}
	return tiers, true
}

// tierOf is a namespace's tier of a block from its bits, as the daemon's
// Lookup says it.
func tierOf(b uint8) pb.Tier {
	switch {
	case b&1 != 0 && b&2 != 0:
		return pb.Tier_TIER_CPU_AND_DISK
	case b&1 != 0:
		return pb.Tier_TIER_CPU
	case b&2 != 0:
		return pb.Tier_TIER_DISK
	}
	return pb.Tier_TIER_REMOTE
}

func rank(t pb.Tier) int {
	switch t {
	case pb.Tier_TIER_DISK:
		return 1
	case pb.Tier_TIER_REMOTE:
		return 2
	}
	return 0
}

func (m *Mirror) run(ctx context.Context) {
	defer close(m.done)
	fails := 0
	for {
		caught, err := m.follow(ctx)
		m.mu.Lock()
		m.live = false
		m.lastErr = err
		if status.Code(err) == codes.Unimplemented {
			m.overflow = true // no WatchEvents: every lookup goes to the daemon
		}
		stop := m.overflow
		m.mu.Unlock()
		if stop || ctx.Err() != nil {
			return
		}
		if caught {
			fails = 0
		} else {
			fails++
		}
		wait := min(5*time.Second, 200*time.Millisecond<<min(fails, 5))
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

func (m *Mirror) clear() {
	m.live = false
	m.maps = map[uint32]map[uint32]map[string]uint8{}
	m.n = 0
	m.resets++
}

// follow reads one stream until it ends; caught says it caught up once.
func (m *Mirror) follow(ctx context.Context) (caught bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := m.c.API.WatchEvents(sctx, &pb.WatchEventsRequest{NamespaceIds: m.ns, MaxEvents: 128})
	if err != nil {
		return false, err
	}
	m.mu.Lock()
	m.streams++
	m.clear()
	m.mu.Unlock()
	for {
		resp, err := st.Recv()
		if err != nil {
			return caught, err
		}
		m.mu.Lock()
		for _, e := range resp.GetEvents() {
			switch e.GetKind() {
			case pb.EventKind_EVENT_KIND_BLOCK_STORED, pb.EventKind_EVENT_KIND_BLOCK_REMOVED:
				var bit uint8
				switch e.GetTier() {
				case pb.Tier_TIER_CPU:
					bit = 1
				case pb.Tier_TIER_DISK:
					bit = 2
				case pb.Tier_TIER_REMOTE:
					bit = 4
				}
				byG := m.maps[e.GetNamespaceId()]
				if byG == nil {
					byG = map[uint32]map[string]uint8{}
					m.maps[e.GetNamespaceId()] = byG
				}
				hs := byG[e.GetGroup()]
				if hs == nil {
					hs = map[string]uint8{}
					byG[e.GetGroup()] = hs
				}
				old := hs[string(e.GetHash())]
				if e.GetKind() == pb.EventKind_EVENT_KIND_BLOCK_STORED {
					if old == 0 {
						m.n++
					}
					hs[string(e.GetHash())] = old | bit
				} else if old != 0 {
					if nb := old &^ bit; nb != 0 {
						hs[string(e.GetHash())] = nb
					} else {
						delete(hs, string(e.GetHash()))
						m.n--
					}
				}
			case pb.EventKind_EVENT_KIND_CAUGHT_UP:
				m.live, caught = true, true
			case pb.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED, pb.EventKind_EVENT_KIND_EVENTS_LOST:
				m.clear()
			}
		}
		if m.n > m.maxBlocks {
			m.overflow = true
			m.clear()
			m.mu.Unlock()
			return caught, errors.New("mirror: past its most blocks; lookups go to the daemon from now on")
		}
		m.mu.Unlock()
	}
}

// RecentStore is how long after the engine sent a block to a Store a
// mirror's hit that stops at it is not taken: its event may not have come
// yet, and the daemon may hold it (the Python connector's rule; no hit is
// lost to the stream's lag).
const RecentStore = time.Second

// MirrorResult is what an engine run with a mirror (Config.MirrorClient)
// did. Requests counts new requests; each was answered from the mirror
// in its step (Answered) or, as a connector would, by the daemon's Lookup,
// which costs a scheduler step: the mirror was not live (NotLive), its
// hit stopped at a block this engine sent to a Store less than RecentStore
// ago (Recent), or its hit was short of the request once the daemon had
// answered a block from the remote tier (Remote: other nodes' blocks are
// not all mirrored).
type MirrorResult struct {
	Requests, Answered, NotLive, Recent, Remote int
	// MirrorOp times each lookup in the mirror, MapOp a plain Go map
	// lookup of the same keys (the engine's own keys, no lock, no tiers:
	// the shape of vLLM's in-process CPU tier) right after it. The
	// daemon's round trip for the same request is Result.Lookup.
	MirrorOp, MapOp Op
	// MapHit counts the blocks the plain map found: every key ever sent
	// to a Store, none evicted (an upper bound of the hits).
	MapHit int
	// Offered counts the blocks the mirror's answers offered; Stale those
	// whose load then found them MISSING (the block left between the
	// answer and the load, or its removal had not come yet), FailedOther
	// those that failed otherwise (a disk read).
	Offered, Stale, FailedOther int
	// OfferedDisk counts the offered blocks the mirror said were in the
	// disk tier only.
	OfferedDisk int
	// Ahead and Behind compare each of the live mirror's answers with the
	// daemon's Lookup of the same keys right after it: blocks the mirror
	// offered past the daemon's hit, and blocks of the daemon's hit the
	// mirror did not offer (the fallbacks' included). RecentLonger counts
	// the fallbacks of a live mirror (Recent, Remote) whose daemon hit was
	// longer: the rules' gain.
	Ahead, Behind, RecentLonger int
	// Unknown counts offered blocks this engine never sent to a Store:
	// a wrong answer (0).
	Unknown int
	// The mirror at the end: entries held, streams opened, clears seen,
	// stopped for good.
	Blocks, Streams, Resets int
	Overflow                bool
}

// mirrorLookup asks the mirror for j's keys (timed, with the plain map
// of the same keys timed after it): live says it answered, use that its
// answer is taken (else the daemon's).
func (d *driver) mirrorLookup(j *job) (tiers []pb.Tier, live, use bool) {
	mr := d.res.Mirror
	mr.Requests++
	t0 := time.Now()
	tiers, live = d.mirror.Lookup([]uint32{d.ns}, 0, j.req.Keys, make([]pb.Tier, 0, len(j.req.Keys)))
	t1 := time.Now()
	hit := 0
	for _, k := range j.req.Keys {
		if _, ok := d.dict[string(k)]; !ok {
			break
		}
		hit++
	}
	t2 := time.Now()
	mr.MapHit += hit
	for _, x := range []struct {
		op *Op
		el time.Duration
	}{{&mr.MirrorOp, t1.Sub(t0)}, {&mr.MapOp, t2.Sub(t1)}} {
		x.op.Calls++
		x.op.Blocks += len(j.req.Keys)
		x.op.Busy += x.el
		x.op.Latencies = append(x.op.Latencies, x.el)
	}
	switch {
	case !live:
		mr.NotLive++
	case len(tiers) < len(j.req.Keys) && d.recent[string(j.req.Keys[len(tiers)])] != (time.Time{}):
		mr.Recent++
	case len(tiers) < len(j.req.Keys) && d.remoteSeen:
		mr.Remote++
	default:
		mr.Answered++
		use = true
	}
	return tiers, live, use
}

// String is the counts, without the latencies.
func (m *MirrorResult) String() string {
	return fmt.Sprintf("%d requests: %d answered, %d not live, %d recent (%d longer), %d remote; %d offered (%d disk), %d stale, %d failed otherwise; ahead %d behind %d; %d unknown; mirror %d blocks, %d streams, %d resets, overflow %v",
		m.Requests, m.Answered, m.NotLive, m.Recent, m.RecentLonger, m.Remote, m.Offered, m.OfferedDisk, m.Stale, m.FailedOther, m.Ahead, m.Behind, m.Unknown, m.Blocks, m.Streams, m.Resets, m.Overflow)
}
