package e2e

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// TestRandomStepsKeepInvariants runs a seeded mix of stores, lookups with
// and without leases, loads (some through leases, some failing in the copy
// engine), invalidations and re-registrations on tiny CPU and disk tiers of
// two block sizes, so eviction, demotion and chunk moves never stop; after
// every step (once its results are in and the disk is flushed) the
// service's bookkeeping must check out and every loaded block must hold its
// key's bytes.
func TestRandomStepsKeepInvariants(t *testing.T) {
	steps := 150
	if raceEnabled {
		steps = 60
	}
	for seed := uint64(1); seed <= 3; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 11))
			copies := testenv.NewGate()
			o := testenv.Options{CPUBytes: 6 << 20, ChunkBytes: 1 << 20, DiskDirs: []string{t.TempDir()}, DiskBytes: 6 << 20, DiskChunkBytes: 1 << 20,
				Wrap: copies.Wrap, NamespaceLinger: -1, Quiet: true}
			d := testenv.Start(t, o)
			models := []testenv.Model{
				{Layers: 2, SegBytes: 64 << 10, Blocks: 48},
				{Layers: 3, SegBytes: 32 << 10, Blocks: 48},
				{Layers: 1, SegBytes: 64 << 10, Blocks: 48},
				{Layers: 1, SegBytes: 160 << 10, Blocks: 48},
				{Layers: 2, SegBytes: 40 << 10, Blocks: 48},
				{Layers: 4, SegBytes: 48 << 10, Blocks: 48},
			}
			// Two engines at a time; a re-registration may bring another
			// block size, which takes chunks from the others.
			engines := make([]*engine, 2)
			for i := range engines {
				engines[i] = register(t, d, models[i], fmt.Sprintf("rand-%d", i))
			}
			job := uint64(0)
			for step := 0; step < steps; step++ {
				i := r.IntN(len(engines))
				e := engines[i]
				n := 1 + r.IntN(6)
				first := r.IntN(120)
				hs := make([][]byte, n)
				for j := range hs {
					hs[j] = e.m.Hash(uint64(e.reg.NamespaceId), first+j)
				}
				job++
				switch op := r.IntN(10); {
				case op < 4:
					e.lookup(t, hs) // an access: admitted more often
					e.store(t, job, hs, seq(0, n))
				case op < 7:
					lease := uint32(0)
					if r.IntN(2) == 0 {
						lease = 10_000
					}
					lr, err := e.c.Lookup(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(hs...), lease)
					if err != nil {
						t.Fatal(err)
					}
					if lr.Ready == 0 {
						continue
					}
					ready := hs[:lr.Ready]
					if r.IntN(4) == 0 {
						copies.FailNext(1)
					}
					jb := testenv.Job(job, ready, seq(20, len(ready)))
					jb.LeaseId = lr.LeaseId
					out, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{jb}, true)
					if err != nil {
						t.Fatal(err)
					}
					e.verify(t, out[0], ready, seq(20, len(ready)))
				case op < 8:
					keys := testenv.Keys(hs...)
					if r.IntN(8) == 0 {
						keys = nil // the whole namespace
					}
					if _, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, keys); err != nil {
						t.Fatal(err)
					}
				case op < 9:
					lr, err := e.c.Lookup(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(hs...), 10_000)
					if err != nil {
						t.Fatal(err)
					}
					_ = lr // a lease left to expire, or to go with its connection
				default:
					e.c.Close()
					waitFor(t, "the registration to go", func() bool { _, err := d.Svc.Registration(e.reg.RegistrationId); return err != nil })
					m := r.IntN(len(models))
					engines[i] = register(t, d, models[m], fmt.Sprintf("rand-%d", m))
				}
				flush(t, d)
				if err := d.Svc.CheckInvariants(); err != nil {
					t.Fatalf("seed %d step %d: %v", seed, step, err)
				}
			}
			t.Logf("evictions: policy %v, rebalance %v, invalidate %v; demotions %v",
				counter(t, d.Registry, "kvoffload_evictions_total", map[string]string{"reason": "policy"}),
				counter(t, d.Registry, "kvoffload_evictions_total", map[string]string{"reason": "rebalance"}),
				counter(t, d.Registry, "kvoffload_evictions_total", map[string]string{"reason": "invalidate"}),
				demotions(t, d.Registry))
		})
	}
}
