package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// This file is the first two stages of a batch: the issuer checks it, holds
// it until the engine's ready event has completed (the gate), and queues its
// copies and a completion event on one stream per device. complete.go waits
// for the completion events.

// minRows2D is the fewest rows a run must have to stay one 2D copy when the
// driver batches copies: scattered blocks pair up into short runs by chance,
// and those rows are cheaper as entries of the one batched call than as a
// driver call each.
const minRows2D = 8

// batchMax bounds the copies of one cuMemcpyBatchAsync call, so that a huge
// batch does not become one huge driver call the driver might refuse.
const batchMax = 4096

// gate is a batch waiting for its ready event: the engine's kernels that
// write (store) or read (load) the batch's blocks have not all run yet.
type gate struct {
	f        *inflight
	d        *device // whose context opened the event
	ev       event
	deadline time.Time
}

// issuer checks and issues batches. It keeps one OS thread, on which the
// devices' contexts are made current, and polls the ready events of gated
// batches between batches. It stops once the queue is closed and no batch is
// gated.
//
// Why poll instead of cuStreamWaitEvent: a stream that waits on an event
// another process never records (it died, or faulted) waits forever, and
// with it every later copy on the stream, the unmapping of its memory and
// the daemon's shutdown. Polled, a dead engine's batch fails after
// ReadyTimeout and nothing else waits for it.
func (e *Engine) issuer() {
	defer e.wg.Done()
	// The thread is never unlocked: contexts are made current on it and its
	// timer slack is changed, so it ends with the goroutine rather than go
	// back to the scheduler's pool.
	runtime.LockOSThread()
	// Let a poll pause of microseconds be microseconds (the default slack
	// of 50µs would make every pause at least that).
	_ = unix.Prctl(unix.PR_SET_TIMERSLACK, 1000, 0, 0, 0)
	var (
		p      planner
		cur    *device
		gates  []*gate
		queue  = e.queue
		issued int
		pause  = e.cfg.ReadyPollMin
	)
	for queue != nil || len(gates) > 0 {
		var b *dma.Batch
		if len(gates) == 0 {
			var ok bool
			if b, ok = <-queue; !ok {
				queue = nil
				continue
			}
		} else if queue != nil {
			select {
			case nb, ok := <-queue:
				if ok {
					b = nb
				} else {
					queue = nil
				}
			default:
			}
		}
		progressed := false
		if b != nil {
			progressed = true
			if g := e.accept(b, &p, &cur, &issued); g != nil {
				gates = append(gates, g)
			}
		}
		n := len(gates)
		gates = e.pollGates(gates, &p, &cur, &issued)
		if progressed || len(gates) < n {
			pause = e.cfg.ReadyPollMin
			continue
		}
		if len(gates) > 0 {
			// A Go timer would sleep about a millisecond once the process
			// is idle; a nanosleep on this locked thread sleeps as asked.
			ts := unix.NsecToTimespec(pause.Nanoseconds())
			_ = unix.Nanosleep(&ts, nil)
			pause = min(2*pause, e.cfg.ReadyPollMax)
		}
	}
	e.stopWaiters()
}

// stopWaiters lets the stream waiters and the finisher stop once their
// lists are empty. The issuer calls it when it stops: nothing more can be
// added to them then.
func (e *Engine) stopWaiters() {
	e.mu.Lock()
	for _, d := range e.mu.devices {
		for _, w := range d.waiters {
			w.stop()
		}
	}
	e.mu.Unlock()
	e.fin.stop()
}

// bind makes d's context current on the calling engine goroutine's thread,
// where *cur is the device last bound there.
func bind(d *device, cur **device) error {
	if *cur == d {
		return nil
	}
	*cur = nil
	if err := d.bind(); err != nil {
		return err
	}
	*cur = d
	return nil
}

// accept checks a batch and issues it, or returns it gated when its ready
// event has not completed yet. A batch that fails a check touches no memory
// and finishes through the finisher.
func (e *Engine) accept(b *dma.Batch, p *planner, cur **device, issued *int) *gate {
	f := &inflight{b: b}
	if err := e.check(f); err != nil {
		f.err = err
		e.fin.add(f)
		return nil
	}
	if len(b.Copies) == 0 {
		e.fin.add(f)
		return nil
	}
	if err := e.Err(); err != nil {
		f.err = fmt.Errorf("%w: the CUDA context is lost: %w", dma.ErrCopy, err)
		e.fin.add(f)
		return nil
	}
	if len(b.ReadyEvent) > 0 {
		d := f.devs[0]
		ev, err := e.openEvent(d, b.ReadyEvent, cur)
		if err != nil {
			f.err = fmt.Errorf("%w: %w", dma.ErrCopy, err)
			e.fin.add(f)
			return nil
		}
		g := &gate{f: f, d: d, ev: ev, deadline: time.Now().Add(e.cfg.ReadyTimeout)}
		if !e.opened(g, cur, p, issued) {
			e.stats.readyWaits.Add(1)
			return g
		}
		return nil
	}
	e.issue(f, p, cur, issued)
	return nil
}

func (e *Engine) openEvent(d *device, h []byte, cur **device) (event, error) {
	if err := bind(d, cur); err != nil {
		return nil, e.checkSticky(err)
	}
	ev, err := d.openEvent(h)
	return ev, e.checkSticky(err)
}

// pollGates checks each gated batch's ready event once and issues the
// batches whose event completed; it returns those still waiting.
func (e *Engine) pollGates(gates []*gate, p *planner, cur **device, issued *int) []*gate {
	kept := gates[:0]
	for _, g := range gates {
		if !e.opened(g, cur, p, issued) {
			kept = append(kept, g)
		}
	}
	clear(gates[len(kept):])
	return kept
}

// opened checks g's ready event. When it has completed, or failed, or its
// deadline has passed, g's batch goes on (issued, or finished with an error)
// and opened reports true.
func (e *Engine) opened(g *gate, cur **device, p *planner, issued *int) bool {
	f := g.f
	var done bool
	err := e.Err()
	if err == nil {
		if err = bind(g.d, cur); err == nil {
			done, err = g.d.query(g.ev)
		}
		e.checkSticky(err)
	}
	switch {
	case err != nil:
		f.err = fmt.Errorf("%w: the ready event: %w", dma.ErrCopy, err)
	case done && f.b.Abandoned != nil && f.b.Abandoned():
		e.stats.readyAbandoned.Add(1)
		f.err = fmt.Errorf("%w: the requester's connection closed while the batch waited for its ready event (its engine may have died mid-forward): "+
			"the batch's %d copies were never issued", dma.ErrCopy, len(f.b.Copies))
	case done:
	case time.Now().After(g.deadline):
		e.stats.readyTimeouts.Add(1)
		f.err = fmt.Errorf("%w: the engine's ready event did not complete within %v (the engine died, faulted or never recorded it): "+
			"the batch's %d copies were never issued", dma.ErrCopy, e.cfg.ReadyTimeout, len(f.b.Copies))
	default:
		return false
	}
	// The event has served its purpose (or never will): the copies are
	// issued after it completed, with nothing on the GPU waiting for it.
	if derr := g.d.destroy(g.ev); derr != nil && e.Err() == nil {
		e.log.Warn("destroying an opened IPC event failed", "device", g.d.ord, "err", derr)
	}
	if f.err != nil {
		e.fin.add(f)
	} else {
		e.issue(f, p, cur, issued)
	}
	return true
}

// check validates a batch before any driver call is made for it, and notes
// the devices it touches.
func (e *Engine) check(f *inflight) error {
	b := f.b
	if len(b.Copies) == 0 {
		return nil
	}
	a := e.arena.Load()
	if a == nil {
		return fmt.Errorf("%w: the arena is not registered (SetArena, or no region opened yet)", dma.ErrCopy)
	}
	if err := ValidateEventHandle(b.ReadyEvent); err != nil {
		return fmt.Errorf("%w: %v", dma.ErrCopy, err)
	}
	f.arena = a
	for i, c := range b.Copies {
		r, ok := c.Region.(*region)
		if !ok || r.e != e {
			return fmt.Errorf("%w: copy %d: the region was not opened by this copy engine", dma.ErrCopy, i)
		}
		if r.closed.Load() {
			return fmt.Errorf("%w: copy %d: the region is closed", dma.ErrCopy, i)
		}
		if err := checkCopy(c, r.size, uint64(len(a.mem))); err != nil {
			return fmt.Errorf("%w: copy %d: %v", dma.ErrCopy, i, err)
		}
		if d := r.m.dev; !slices.Contains(f.devs, d) {
			f.devs = append(f.devs, d)
		}
		f.bytes += c.Len
	}
	return nil
}

// issue queues f's copies, and after them a completion event, on one stream
// of each device f touches, and hands the events to the streams' waiters. A
// batch that fails partway still records its event (or waits for its
// stream) so that its Done never comes while one of its copies could still
// be running.
func (e *Engine) issue(f *inflight, p *planner, cur **device, issued *int) {
	b := f.b
	maxPitch := ^uint64(0)
	for _, d := range f.devs {
		maxPitch = min(maxPitch, d.maxPitch())
	}
	runs := p.plan(b.Copies, maxPitch)
	e.stats.copies.Add(uint64(len(b.Copies)))
	*issued++
	f.left = 1 // the issuer's own hold, dropped below
	var ierr error
	for _, d := range f.devs {
		if ierr = e.checkSticky(bind(d, cur)); ierr != nil {
			break
		}
		s := d.stream(b.ToArena)
		var err error
		if e.cfg.FaultAfterBatches > 0 && *issued == e.cfg.FaultAfterBatches+1 {
			e.log.Warn("FAULT INJECTION: queueing a trapping kernel before this batch's copies", "device", d.ord, "stream", s)
			err = d.injectFault(s)
		}
		if err == nil {
			err = e.queueCopies(d, s, runs, f)
		}
		// Whether or not every copy went in, mark the end of those that did.
		ev, rerr := d.record(s)
		if rerr == nil {
			f.mu.Lock()
			f.left++
			f.mu.Unlock()
			d.waiters[s].add(completion{f: f, ev: ev})
		} else {
			// Without an event, wait here rather than report early.
			err = errors.Join(err, rerr, d.sync(s))
		}
		if err != nil {
			ierr = e.checkSticky(err)
			break
		}
	}
	e.settle(f, ierr, true)
}

// queueCopies queues the runs on device d: a run of several rows as one 2D
// copy; one-row runs (scattered blocks) in batched calls where the driver
// has them, else one call each.
func (e *Engine) queueCopies(d *device, s int, runs []Run, f *inflight) error {
	a := f.arena
	batched := d.batchCopies() && !e.cfg.NoBatchCopies
	var spans []span
	flush := func() error {
		if len(spans) == 0 {
			return nil
		}
		var err error
		if len(spans) == 1 {
			// One copy is cheaper as the plain call.
			r := Run{Width: uint64(len(spans[0].host)), Rows: 1, RegionPitch: uint64(len(spans[0].host)), ArenaPitch: uint64(len(spans[0].host))}
			err = d.copy(s, r, spans[0].dev, spans[0].host, f.b.ToArena)
		} else {
			err = d.copyBatch(s, spans, f.b.ToArena)
			e.stats.batched.Add(uint64(len(spans)))
		}
		e.stats.driverCopies.Add(1)
		clear(spans)
		spans = spans[:0]
		return err
	}
	for _, r := range runs {
		m := r.Region.(*region).m
		if m.dev != d {
			continue
		}
		last := r.ArenaOff + (r.Rows-1)*r.ArenaPitch + r.Width
		host := a.mem[r.ArenaOff:last:last]
		if batched && r.Rows < minRows2D {
			for row := range r.Rows {
				a := row * r.ArenaPitch
				spans = append(spans, span{dev: m.addr + r.RegionOff + row*r.RegionPitch, host: host[a : a+r.Width : a+r.Width]})
				if len(spans) == batchMax {
					if err := flush(); err != nil {
						return err
					}
				}
			}
			continue
		}
		e.stats.driverCopies.Add(1)
		if err := d.copy(s, r, m.addr+r.RegionOff, host, f.b.ToArena); err != nil {
			return err
		}
	}
	return flush()
}
