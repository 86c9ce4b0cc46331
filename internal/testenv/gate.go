package testenv

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// Gate wraps a copy engine: while held, batches wait before they reach
// the engine, so a test can look at the daemon with copies in flight. It can
// also fail batches, as a faulting copy would.
type Gate struct {
	dma.Engine
	mu      sync.Mutex
	closed  bool
	held    []*dma.Batch
	fail    int
	arrived chan struct{} // gets a value for each batch submitted

	opens       chan struct{} // non-nil while Opens are held: closed to let them go
	openArrived chan struct{} // gets a value for each Open that arrives while held
	opened      atomic.Int64  // Opens that returned
}

// NewGate returns an open gate; use it as Options.Wrap.
func NewGate() *Gate {
	return &Gate{arrived: make(chan struct{}, 1<<16), openArrived: make(chan struct{}, 1<<10)}
}

// HoldOpens makes every region Open from now on wait until ReleaseOpens:
// a test can act while a Register is mapping its regions.
func (g *Gate) HoldOpens() {
	g.mu.Lock()
	g.opens = make(chan struct{})
	g.mu.Unlock()
}

// OpenArrived waits for an Open to arrive while held.
func (g *Gate) OpenArrived() { <-g.openArrived }

// ReleaseOpens lets held Opens, and every later one, through.
func (g *Gate) ReleaseOpens() {
	g.mu.Lock()
	if g.opens != nil {
		close(g.opens)
		g.opens = nil
	}
	g.mu.Unlock()
}

// Open implements dma.Engine.
func (g *Gate) Open(spec dma.RegionSpec, peer dma.Peer) (dma.Region, error) {
	g.mu.Lock()
	held := g.opens
	g.mu.Unlock()
	if held != nil {
		g.openArrived <- struct{}{}
		<-held
	}
	defer g.opened.Add(1)
	return g.Engine.Open(spec, peer)
}

// Opened reports how many Opens have returned.
func (g *Gate) Opened() int { return int(g.opened.Load()) }

// Wrap is an Options.Wrap.
func (g *Gate) Wrap(e dma.Engine) dma.Engine {
	g.Engine = e
	return g
}

// Hold holds every batch submitted from now on.
func (g *Gate) Hold() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

// FailNext makes the next n batches fail without copying.
func (g *Gate) FailNext(n int) {
	g.mu.Lock()
	g.fail += n
	g.mu.Unlock()
}

// Arrived waits for n batches to be submitted.
func (g *Gate) Arrived(n int) {
	for i := 0; i < n; i++ {
		<-g.arrived
	}
}

// Release lets held batches and every later one through.
func (g *Gate) Release() {
	g.mu.Lock()
	g.closed = false
	held := g.held
	g.held = nil
	g.mu.Unlock()
	for _, b := range held {
		g.Engine.Submit(b)
	}
}

// Submit implements dma.Engine.
func (g *Gate) Submit(b *dma.Batch) {
	defer func() { g.arrived <- struct{}{} }()
	g.mu.Lock()
	if g.fail > 0 {
		g.fail--
		g.mu.Unlock()
		go b.Done(fmt.Errorf("%w: injected by test", dma.ErrCopy))
		return
	}
	if g.closed {
		g.held = append(g.held, b)
		g.mu.Unlock()
		return
	}
	g.mu.Unlock()
	g.Engine.Submit(b)
}

// Close releases held batches and Opens, then closes the wrapped engine.
func (g *Gate) Close() error {
	g.ReleaseOpens()
	g.Release()
	return g.Engine.Close()
}
