package testenv

import (
	"fmt"
	"sync"

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
}

// NewGate returns an open gate; use it as Options.Wrap.
func NewGate() *Gate { return &Gate{arrived: make(chan struct{}, 1<<16)} }

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

// Close releases held batches, then closes the wrapped engine.
func (g *Gate) Close() error {
	g.Release()
	return g.Engine.Close()
}
