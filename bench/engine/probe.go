package engine

import (
	"context"
	"time"

	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// probeGap is the pause between the prober's call pairs: it keeps the
// prober a scheduler's trickle of Lookups rather than a load of its own
// on a machine with few cores.
const probeGap = time.Millisecond

// probe is the prober at work during one transfer window.
type probe struct {
	quit chan struct{}
	done chan struct{}
}

// startProbe issues, on the prober's connection until stop, a peek Lookup
// of one of the next step's requests, then an empty call (a health
// Check), and again, one call at a time. Each call's latency is added to
// lookups and empties (nil: not recorded). nil without a prober.
func (d *driver) startProbe(lookups, empties *Op) *probe {
	if d.cfg.Prober == nil || len(d.probeKeys) == 0 {
		return nil
	}
	p := &probe{quit: make(chan struct{}), done: make(chan struct{})}
	ctx, cancel := context.WithTimeout(context.Background(), d.cfg.StepTimeout)
	go func() {
		defer close(p.done)
		defer cancel()
		c, keys := d.cfg.Prober, d.probeKeys
		record := func(op *Op, el time.Duration) {
			if op != nil {
				op.Calls++
				op.Busy += el
				op.Latencies = append(op.Latencies, el)
			}
		}
		gap := time.NewTimer(0)
		defer gap.Stop()
		for i := 0; ; i++ {
			select {
			case <-p.quit:
				return
			case <-gap.C:
			}
			t0 := time.Now()
			if _, err := c.API.Lookup(ctx, &pb.LookupRequest{NamespaceIds: []uint32{d.ns}, Keys: keys[i%len(keys)], Peek: true}); err != nil {
				return // the window is over or the daemon is going: the step reports its own errors
			}
			record(lookups, time.Since(t0))
			select {
			case <-p.quit:
				return
			default:
			}
			t0 = time.Now()
			if _, err := c.Healthy(ctx); err != nil {
				return
			}
			record(empties, time.Since(t0))
			gap.Reset(probeGap)
		}
	}()
	return p
}

// stop ends the window and waits for the prober; safe on nil and twice.
func (p *probe) stop() {
	if p == nil {
		return
	}
	select {
	case <-p.quit:
	default:
		close(p.quit)
	}
	<-p.done
}
