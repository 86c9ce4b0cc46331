package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// This file is the last stage of a batch: waiting for its completion events
// and running its Done.
//
// Each stream has a waiter: a goroutine on its own locked OS thread that
// waits for the stream's completion events one after the other, in the order
// they were recorded, which is the order they complete in. The events are
// made with CU_EVENT_BLOCKING_SYNC, so cuEventSynchronize sleeps in the
// kernel until the GPU signals the event: a batch is reported within
// microseconds of its last copy, with no polling and no timer (a Go timer
// asked for 5µs sleeps about a millisecond once the process is idle).

// inflight is a batch on its way through the engine.
type inflight struct {
	b     *dma.Batch
	devs  []*device // in order of first use; one in practice
	arena *arena
	bytes uint64

	mu   sync.Mutex
	err  error
	left int // holds on the batch: completion events not yet waited for, and the issuer's
}

// completion is one completion event of a batch, recorded on a stream.
type completion struct {
	f  *inflight
	ev event
}

// settle drops one hold on f, failing it with err; the last one finishes f.
// The issuer hands the finish to the finisher, never running Done itself.
func (e *Engine) settle(f *inflight, err error, fromIssuer bool) {
	f.mu.Lock()
	if err != nil && f.err == nil {
		f.err = fmt.Errorf("%w: %w", dma.ErrCopy, err)
	}
	f.left--
	last := f.left == 0
	f.mu.Unlock()
	switch {
	case !last:
	case fromIssuer:
		e.fin.add(f)
	default:
		e.finish(f)
	}
}

// queueList is a list one goroutine appends to without ever waiting, and
// another takes from in order, sleeping while it is empty.
type queueList[T any] struct {
	mu      sync.Mutex
	items   []T
	stopped bool
	wake    chan struct{}
}

func (q *queueList[T]) init() { q.wake = make(chan struct{}, 1) }

func (q *queueList[T]) add(v T) {
	q.mu.Lock()
	q.items = append(q.items, v)
	q.mu.Unlock()
	q.signal()
}

func (q *queueList[T]) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// stop lets next return false once the list is empty.
func (q *queueList[T]) stop() {
	q.mu.Lock()
	q.stopped = true
	q.mu.Unlock()
	q.signal()
}

// next returns the first item, waiting for one; false once stopped and empty.
func (q *queueList[T]) next() (T, bool) {
	for {
		q.mu.Lock()
		if len(q.items) > 0 {
			v := q.items[0]
			var zero T
			q.items[0] = zero
			q.items = q.items[1:]
			q.mu.Unlock()
			return v, true
		}
		stopped := q.stopped
		q.mu.Unlock()
		if stopped {
			var zero T
			return zero, false
		}
		<-q.wake
	}
}

// waiter waits for the completion events of one stream.
type waiter struct {
	queueList[completion]
	e      *Engine
	d      *device
	stream int
}

func newWaiter(e *Engine, d *device, stream int) *waiter {
	w := &waiter{e: e, d: d, stream: stream}
	w.init()
	return w
}

func (w *waiter) run() {
	e, d := w.e, w.d
	defer e.wg.Done()
	// Never unlocked: the device's context is current on this thread, which
	// ends with the goroutine.
	runtime.LockOSThread()
	bindErr := e.checkSticky(d.bind())
	for {
		c, ok := w.next()
		if !ok {
			return
		}
		err := bindErr
		if err == nil {
			err = d.wait(c.ev)
		}
		if err != nil {
			if err = w.failed(err); errors.Is(err, errUnsettled) {
				// The engine has failed and the daemon exits: leaving the
				// batch unfinished is the only way not to report copies
				// done that may still be writing.
				continue
			}
		}
		if derr := d.destroy(c.ev); derr != nil && e.Err() == nil {
			e.log.Warn("destroying a completion event failed", "device", d.ord, "err", derr)
		}
		e.settle(c.f, err, false)
	}
}

// errUnsettled marks a batch whose copies cannot be known to have stopped.
var errUnsettled = errors.New("cannot tell whether the batch's copies have stopped")

// failed decides what a failed wait means. A sticky error lost the context:
// nothing queued in it runs any more, so the batch may finish (failed). Any
// other error leaves that open, so the stream is synchronized: once that
// returns, the batch's copies have stopped. If that fails too and the
// context is not known lost, nothing can be said: the engine fails and the
// batch is never reported.
func (w *waiter) failed(err error) error {
	e := w.e
	var de *DriverError
	if errors.As(err, &de) && de.Sticky() {
		e.fail(err)
		return err
	}
	serr := w.d.sync(w.stream)
	if serr == nil {
		return err
	}
	if errors.As(serr, &de) && de.Sticky() {
		e.fail(serr)
		return errors.Join(err, serr)
	}
	e.fail(fmt.Errorf("%w: waiting for a completion event on device %d failed (%v), and so did synchronizing its stream (%v)", errUnsettled, w.d.ord, err, serr))
	return errUnsettled
}

// finisher runs Done for batches that never reached the GPU (refused,
// empty, timed out at their ready event) and for those the issuer released
// last, so that the issuer never runs a Done (which may call Submit, which
// may wait for the issuer).
type finisher struct {
	queueList[*inflight]
	e *Engine
}

func newFinisher(e *Engine) *finisher {
	f := &finisher{e: e}
	f.init()
	return f
}

func (f *finisher) run() {
	defer f.e.wg.Done()
	for {
		b, ok := f.next()
		if !ok {
			return
		}
		f.e.finish(b)
	}
}
