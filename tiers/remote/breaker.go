package remote

import (
	"sync"
	"time"
)

// breaker remembers cluster nodes that just timed out or refused a
// connection, so the next batches do not wait on them again: a key such a
// node serves is answered "unavailable" at once, without a command, until
// its back-off ends (1 s, doubling to 8 s while it keeps failing) or a
// health check (Ping) reaches it. A Lookup thus waits on a hung node once,
// not once per call; the first batch after the back-off tries the node
// again.
type breaker struct {
	mu    sync.Mutex
	nodes map[string]*tripped
	now   func() time.Time
}

type tripped struct {
	until   time.Time
	backoff time.Duration
}

const (
	breakerMin = time.Second
	breakerMax = 8 * time.Second
)

func newBreaker() *breaker { return &breaker{nodes: map[string]*tripped{}, now: time.Now} }

// open reports whether addr is in its back-off.
func (b *breaker) open(addr string) bool {
	if addr == "" {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	t := b.nodes[addr]
	return t != nil && b.now().Before(t.until)
}

// trip starts or lengthens addr's back-off.
func (b *breaker) trip(addr string) {
	if addr == "" {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	t := b.nodes[addr]
	if t == nil {
		t = &tripped{}
		b.nodes[addr] = t
	}
	now := b.now()
	if now.Before(t.until) {
		return // failures of one batch, or of batches in flight together
	}
	t.backoff = min(max(2*t.backoff, breakerMin), breakerMax)
	t.until = now.Add(t.backoff)
}

// reset forgets addr's failures: it answered.
func (b *breaker) reset(addr string) {
	b.mu.Lock()
	delete(b.nodes, addr)
	b.mu.Unlock()
}

// tripped lists the nodes in their back-off, for tests and logs.
func (b *breaker) tripped() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for a, t := range b.nodes {
		if b.now().Before(t.until) {
			out = append(out, a)
		}
	}
	return out
}
