package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/bench/engine"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/bench/workload"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
)

// The hybrid scenario: each hybrid model shape (--hybrid-models) on a
// daemon of its own whose CPU tier holds the working set, driven by
// engine.RunHybrid under the windowed rule and, on the same trace in the
// same run, as all full attention.

// hybridShapes makes the shapes by name; the test under the race detector
// swaps in smaller ones.
var hybridShapes = model.HybridPresets

// hybridSteps is the scenario's steps: at most 24 (12 with --quick), as a
// hybrid-mamba block of every group is 7.4 MiB and the tier holds the
// whole working set.
func (o *options) hybridSteps(nsteps int) int {
	if o.quick {
		return min(nsteps, 12)
	}
	return min(nsteps, 24)
}

// hybrid runs the scenario for every model named.
func (b *bench) hybrid(ctx context.Context, nsteps int) error {
	var errs []error
	for _, name := range b.o.hybridModels {
		if err := b.hybridModel(ctx, name, b.o.hybridSteps(nsteps)); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			if ctx.Err() != nil {
				break
			}
		}
	}
	return errors.Join(errs...)
}

func (b *bench) hybridModel(ctx context.Context, name string, nsteps int) error {
	o := b.o
	h := hybridShapes[name]()
	wl := workload.Default(o.seed)
	E := wl.MaxBlocks()
	steps, err := workload.Steps(wl, nsteps, E)
	if err != nil {
		return err
	}
	steps, E = workload.Expand(steps, o.hybridExpand), E*o.hybridExpand
	unit := uint64(h.UnitBytes())
	D := uint64(workload.Distinct(steps)) * unit
	cpu := (uint64(o.hybridCPUShare*float64(D)) + 2*uint64(E)*unit + 64<<20 - 1) / (64 << 20) * (64 << 20)
	capped := ""
	if avail := memAvailable(); avail > 0 && cpu > avail/2 {
		cpu = avail / 2 / (64 << 20) * (64 << 20)
		capped = fmt.Sprintf(" (capped at half the available memory: the working set is %s)", model.FormatBytes(D))
	}
	desc := fmt.Sprintf("cpu tier %s%s, at most %d lookup rounds of %d probes", model.FormatBytes(cpu), capped, o.hybridRounds, o.hybridProbes)
	if o.hybridExpand > 1 {
		desc += fmt.Sprintf(", every workload block cut into %d", o.hybridExpand)
	}
	if o.hybridOneStore {
		desc += ", every group's stores in one Store per step"
	} else {
		desc += ", one Store per group per step"
	}
	b.prog.phase(fmt.Sprintf("scenario hybrid: %s, %d groups, %s", name, len(h.Groups), desc))
	region, err := model.NewHybridRegion("/dev/shm", h, E)
	if err != nil {
		return err
	}
	defer region.Close()
	dir, err := os.MkdirTemp(b.tmp, "hybrid-"+name+"-")
	if err != nil {
		return err
	}
	d, err := b.startDaemon(ctx, daemon.Options{Binary: b.binary, Dir: dir, CPUBytes: cpu, IOWorkers: o.ioWorkers})
	if err != nil {
		return err
	}
	defer d.Stop()
	b.meter.Track(d.Pid())
	defer b.meter.Untrack(d.Pid())
	c, err := client.Dial(d.Socket)
	if err != nil {
		return errors.Join(err, d.Stop())
	}
	defer c.Close()
	phase := "hybrid " + name
	end := b.meter.Start(phase + ": arena backed")
	err = waitArena(ctx, d, arenaWait)
	b.meter.End(end)
	if err != nil {
		b.prog.phase(fmt.Sprintf("scenario hybrid %s: %v; its timings include the arena's first-touch faults", name, err))
	}
	mk := b.meter.Start(phase + ": steps")
	res, runErr := engine.RunHybrid(ctx, engine.HybridConfig{
		Client: c, Region: region, Steps: steps,
		Fingerprint: fmt.Appendf(nil, "kvbench/%s/%s/seed=%d/pid=%d/%d", name, h.Kinds(), o.seed, os.Getpid(), time.Now().UnixNano()),
		Progress:    func(int, int) { b.prog.advance(1) },
		MaxRounds:   o.hybridRounds,
		Probes:      o.hybridProbes,
		OneStore:    o.hybridOneStore,
	})
	b.meter.End(mk)
	// Blocks dropped for any reason but the run's final Invalidate.
	evicted := -1.0
	if m, err := d.Metrics(ctx); err == nil {
		evicted = daemon.Sum(m, "kvoffload_evictions_total") - daemon.Sum(m, "kvoffload_evictions_total", `reason="invalidate"`)
	}
	stopErr := d.Stop()
	if res == nil {
		return errors.Join(runErr, stopErr)
	}
	share, flagged := b.phaseShare(phase + ": steps")
	hr := report.Hybrid{Model: name, About: h.About, BlockTokens: h.BlockTokens(), UnitBytes: h.UnitBytes(), FullBytes: h.FullBytes(),
		EngineBlocks: E, Steps: res.Steps, Daemon: desc, Interference: share, Flagged: flagged,
		Windowed: hybridTreatment(&res.Windowed, h.BlockTokens()), AllFull: hybridTreatment(&res.AllFull, h.BlockTokens())}
	if evicted >= 0 {
		hr.Evicted = report.F(evicted)
	}
	for _, g := range h.Groups {
		hr.Groups = append(hr.Groups, report.HybridGroup{Kind: g.Kind.String(), Layers: g.Layers, BlockBytes: g.BlockBytes(), WindowBlocks: g.WindowBlocks()})
	}
	w, f := &hr.Windowed, &hr.AllFull
	if f.BytesPerHitToken > 0 {
		hr.BytesPerHitTokenRatio = report.F(w.BytesPerHitToken / f.BytesPerHitToken)
	}
	if f.LoadBytes > 0 && w.HitTokens == f.HitTokens {
		hr.BoundRatio = report.F(float64(w.BoundBytes) / float64(f.LoadBytes))
	}
	if f.LoadSeconds > 0 {
		hr.LoadTimeRatio = report.F(w.LoadSeconds / f.LoadSeconds)
	}
	b.rep.Hybrid = append(b.rep.Hybrid, hr)
	return errors.Join(runErr, stopErr, hybridVerdict(&hr))
}

func hybridTreatment(t *engine.Treatment, blockTokens int) report.HybridTreatment {
	out := report.HybridTreatment{Requests: t.Requests, Hits: t.Hits, HitRate: t.HitRate(), HitTokens: t.HitUnits * blockTokens,
		Lookups: t.Lookups, KeysLookedUp: t.KeysLookedUp, WindowKeys: t.WindowKeys, OutsideWindow: t.OutsideWindow, Retries: t.Retries,
		LoadBytes: t.Load.Bytes, ExpectedBytes: t.Expected, BoundBytes: t.Bound, LoadBlocks: t.Load.Blocks,
		LoadSeconds: t.Load.Busy.Seconds(), LoadGBps: t.Load.GBps(), StoreBlocks: t.Store.Blocks, StoreBytes: t.Store.Bytes,
		StoreSkipped: t.StoreSkipped, LoadFailed: t.LoadFailed, StoreFailed: t.StoreFailed,
		CorruptBlocksDelivered: t.CorruptDelivered, FailedBlocksReoffered: t.FailedReoffered}
	if out.HitTokens > 0 {
		out.BytesPerHitToken = float64(t.Load.Bytes) / float64(out.HitTokens)
	}
	return out
}

// hybridVerdict fails the run on a broken promise: wrong bytes, a failed
// block offered again, a Load that moved other than the hits need, a
// windowed Load past the ceiling. With nothing evicted and every store
// taken, the two treatments must hit alike and the windowed one must look
// up no key outside a hit's window; otherwise they are only reported.
func hybridVerdict(h *report.Hybrid) error {
	var errs []error
	for _, x := range []struct {
		name string
		t    *report.HybridTreatment
	}{{"windowed", &h.Windowed}, {"all-full", &h.AllFull}} {
		if x.t.CorruptBlocksDelivered > 0 || x.t.FailedBlocksReoffered > 0 {
			errs = append(errs, fmt.Errorf("%s treatment: %d loaded blocks held wrong bytes, %d failed blocks offered again", x.name, x.t.CorruptBlocksDelivered, x.t.FailedBlocksReoffered))
		}
		if x.t.LoadBytes != x.t.ExpectedBytes {
			errs = append(errs, fmt.Errorf("%s treatment: the daemon moved %d bytes for hits that need %d", x.name, x.t.LoadBytes, x.t.ExpectedBytes))
		}
	}
	if h.Windowed.LoadBytes > h.Windowed.BoundBytes {
		errs = append(errs, fmt.Errorf("windowed treatment moved %d bytes, more than full layers' + window bytes per hit (%d)", h.Windowed.LoadBytes, h.Windowed.BoundBytes))
	}
	evicting := h.Evicted == nil || *h.Evicted > 0 || len(h.Windowed.StoreFailed)+len(h.AllFull.StoreFailed) > 0
	if !evicting && h.Windowed.HitTokens != h.AllFull.HitTokens {
		errs = append(errs, fmt.Errorf("windowed hit %d tokens, all full attention %d, on the same trace and cache", h.Windowed.HitTokens, h.AllFull.HitTokens))
	}
	if !evicting && h.Windowed.OutsideWindow > 0 {
		errs = append(errs, fmt.Errorf("windowed lookups asked %d keys outside a hit's window", h.Windowed.OutsideWindow))
	}
	return errors.Join(errs...)
}
