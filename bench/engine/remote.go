package engine

import (
	"context"
	"fmt"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/workload"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// RemoteLoads is the second node of the remote scenario: a daemon with an
// empty local cache, registered under the fingerprint another node ran the
// steps with. It looks up every distinct request of the steps once (timed:
// Lookup with the remote tier's check; the hit rate is the share of the
// first node's prefixes this node finds), then loads every block offered
// from the remote tier, perLoad blocks per Load in jobs of perJob (timed
// as RemoteLoad, every block checked byte for byte, failed ones checked not
// to be offered again).
func RemoteLoads(ctx context.Context, cfg Config, perLoad, perJob int) (*Result, error) {
	c, reg := cfg.Client, cfg.Region
	if perLoad <= 0 || perJob <= 0 || perLoad > reg.Blocks {
		return nil, fmt.Errorf("remote loads: %d blocks per load in jobs of %d, region of %d blocks", perLoad, perJob, reg.Blocks)
	}
	rctx, cancel := context.WithTimeout(ctx, cfg.StepTimeout)
	r, err := c.Register(rctx, cfg.Fingerprint, reg.Shape.Layout(), reg.Wire(), "kvbench remote")
	cancel()
	if err != nil {
		return nil, fmt.Errorf("register: %w", err)
	}
	d := &driver{cfg: cfg, c: c, reg: reg, id: r.RegistrationId, ns: r.NamespaceId, failed: map[string]failure{}, res: newResult()}
	runErr := d.warm(ctx)
	var remote [][]byte
	if runErr == nil {
		remote, runErr = d.remoteLookups(ctx)
	}
	for runErr == nil && len(remote) > 0 {
		n := min(len(remote), perLoad)
		batch := remote[:n]
		remote = remote[n:]
		var jobs []*job
		for base := 0; base < n; base += perJob {
			keys := batch[base:min(base+perJob, n)]
			jobs = append(jobs, &job{req: &workload.Request{ID: fmt.Sprintf("remote-load-%d", base), Keys: keys}, base: base, ready: len(keys), redo: len(keys)})
		}
		bctx, cancel := context.WithTimeout(ctx, cfg.StepTimeout)
		runErr = d.loadJobs(bctx, jobs, &d.res.RemoteLoad, d.res.RemoteLoadFailed)
		cancel()
		if cfg.Progress != nil {
			cfg.Progress(0, 0)
		}
	}
	return d.finish(runErr)
}

// remoteLookups looks up each distinct request chain of the steps once and
// returns the blocks offered from the remote tier, each once, in order.
func (d *driver) remoteLookups(ctx context.Context) ([][]byte, error) {
	var out [][]byte
	chains, found := map[string]bool{}, map[string]bool{}
	op := &d.res.Lookup
	for _, step := range d.cfg.Steps {
		lctx, cancel := context.WithTimeout(ctx, d.cfg.StepTimeout)
		for _, r := range step {
			last := string(r.Keys[len(r.Keys)-1])
			if chains[last] {
				continue
			}
			chains[last] = true
			keys, _ := client.Keys(0, model.HashBytes, r.Keys...)
			t0 := time.Now()
			lr, err := d.c.Lookup(lctx, []uint32{d.ns}, keys, 0)
			el := time.Since(t0)
			if err != nil {
				cancel()
				return nil, fmt.Errorf("remote lookups: %w", err)
			}
			op.Calls++
			op.Busy += el
			op.Latencies = append(op.Latencies, el)
			d.res.LookedUp += len(r.Keys)
			d.res.KindLookedUp[r.Kind] += len(r.Keys)
			d.res.KindHit[r.Kind] += int(lr.GetReady())
			for i, t := range lr.GetTiers() {
				switch t {
				case pb.Tier_TIER_REMOTE:
					d.res.HitRemote++
					if k := r.Keys[i]; !found[string(k)] {
						found[string(k)] = true
						out = append(out, k)
					}
				case pb.Tier_TIER_DISK:
					d.res.HitDisk++
				default:
					d.res.HitCPU++
				}
			}
		}
		cancel()
	}
	return out, nil
}
