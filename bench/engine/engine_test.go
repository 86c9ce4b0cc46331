package engine

import (
	"context"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/workload"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
)

var tiny = model.Shape{Name: "tiny", Layers: 2, BlockTokens: 16, KVHeads: 2, HeadDim: 64, DTypeBytes: 2} // 4 segments of 4 KiB

func runOn(t *testing.T, d *testenv.Daemon, steps int, between func(int) error) *Result {
	t.Helper()
	region, err := model.NewRegion("/dev/shm", tiny, 64)
	if err != nil {
		t.Fatal(err)
	}
	defer region.Close()
	plan, err := workload.Steps(workload.Default(3), steps, 64)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := Run(ctx, Config{Client: d.Client(t), Region: region, Fingerprint: []byte(t.Name()), Steps: plan, LeaseMs: 5000, IdleLookups: 10, BetweenSteps: between})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// Against a healthy daemon every step hits, loads verify, nothing fails.
func TestRunHealthy(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true})
	res := runOn(t, d, 20, nil)
	if res.Steps != 20 || res.Load.Blocks == 0 || res.Store.Blocks == 0 || res.HitCPU == 0 || res.IdleLookup.Calls != 10 {
		t.Fatalf("result %+v", res)
	}
	if res.CorruptDelivered != 0 || res.FailedReoffered != 0 || len(res.LoadFailed) != 0 || len(res.StoreFailed) != 0 {
		t.Errorf("corrupt %d, reoffered %d, load failed %v, store failed %v", res.CorruptDelivered, res.FailedReoffered, res.LoadFailed, res.StoreFailed)
	}
	if res.Load.Bytes != uint64(res.Load.Blocks)*uint64(tiny.BlockBytes()) {
		t.Errorf("loaded %d bytes for %d blocks", res.Load.Bytes, res.Load.Blocks)
	}
}

// Copies that fail are reported per block; the engine recomputes and
// stores those blocks again, and never sees wrong bytes or a failed block
// offered again.
func TestRunFailedCopies(t *testing.T) {
	gate := testenv.NewGate()
	d := testenv.Start(t, testenv.Options{Quiet: true, Wrap: gate.Wrap})
	// Fail the next step's load (its first batch) every third step.
	res := runOn(t, d, 30, func(step int) error {
		if step%3 == 2 {
			gate.FailNext(1)
		}
		return nil
	})
	failed := 0
	for _, n := range res.LoadFailed {
		failed += n
	}
	for _, n := range res.StoreFailed {
		failed += n
	}
	if res.LoadFailed["DMA_ERROR"] == 0 || failed == 0 {
		t.Fatalf("no load failed (load %v, store %v); the gate did not reach the copies", res.LoadFailed, res.StoreFailed)
	}
	if res.CorruptDelivered != 0 {
		t.Errorf("%d wrong blocks delivered", res.CorruptDelivered)
	}
	if res.CheckLookups == 0 {
		t.Error("no Lookup checked the failed keys")
	}
	t.Logf("load failed %v, store failed %v, re-offered %d", res.LoadFailed, res.StoreFailed, res.FailedReoffered)
	if res.FailedReoffered != 0 {
		t.Fatalf("%d blocks whose load failed with DMA_ERROR were offered again (DESIGN.md §3.4: their entry goes)", res.FailedReoffered)
	}

}

// The same-window baselines: the Copier copies exactly the blocks each
// step loads and stores, the prober's Lookups and empty calls land while
// transfers are in flight, and every phase is reported.
func TestRunBaselines(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true})
	region, err := model.NewRegion("/dev/shm", tiny, 64)
	if err != nil {
		t.Fatal(err)
	}
	defer region.Close()
	own, err := baseline.NewSegmentCopier(region, 0, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer own.Close()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	copier, err := baseline.StartProcessCopier(exe, region, 0, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer copier.Close()
	plan, err := workload.Steps(workload.Default(3), 20, 64)
	if err != nil {
		t.Fatal(err)
	}
	var phases []string
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := Run(ctx, Config{Client: d.Client(t), Region: region, Fingerprint: []byte(t.Name()), Steps: plan, LeaseMs: 5000, IdleLookups: 10,
		Copier: copier, OwnCopier: own, Prober: d.Client(t), Wait: true,
		Phase: func(name string) func() {
			phases = append(phases, "start "+name)
			return func() { phases = append(phases, "end "+name) }
		}})
	if err != nil {
		t.Fatal(err)
	}
	if res.CorruptDelivered != 0 {
		t.Fatalf("%d wrong blocks delivered (a baseline copy landed in a loaded block after its check, or before the load)", res.CorruptDelivered)
	}
	if res.LoadCopy.Blocks != res.Load.Blocks || res.StoreCopy.Blocks != res.Store.Blocks || res.LoadCopy.Calls != res.Load.Calls || res.StoreCopy.Calls != res.Store.Calls {
		t.Errorf("copies %d/%d blocks in %d/%d calls, transfers %d/%d blocks in %d/%d calls",
			res.LoadCopy.Blocks, res.StoreCopy.Blocks, res.LoadCopy.Calls, res.StoreCopy.Calls, res.Load.Blocks, res.Store.Blocks, res.Load.Calls, res.Store.Calls)
	}
	if res.LoadCopyOwn.Blocks != res.Load.Blocks || res.StoreCopyOwn.Blocks != res.Store.Blocks || res.LoadCopyOwn.Calls != res.Load.Calls || res.StoreCopyOwn.Calls != res.Store.Calls {
		t.Errorf("own copies %d/%d blocks in %d/%d calls, transfers %d/%d blocks in %d/%d calls",
			res.LoadCopyOwn.Blocks, res.StoreCopyOwn.Blocks, res.LoadCopyOwn.Calls, res.StoreCopyOwn.Calls, res.Load.Blocks, res.Store.Blocks, res.Load.Calls, res.Store.Calls)
	}
	for name, op := range map[string]Op{"load copy": res.LoadCopy, "store copy": res.StoreCopy, "own load copy": res.LoadCopyOwn, "own store copy": res.StoreCopyOwn} {
		if op.Bytes != uint64(op.Blocks)*uint64(tiny.BlockBytes()) || op.Busy <= 0 {
			t.Errorf("%s: %+v", name, op)
		}
	}
	if res.Load.Completions != 0 || res.Store.Completions != 0 {
		t.Errorf("with Wait, %d and %d Completions calls", res.Load.Completions, res.Store.Completions)
	}
	if res.BusyLookup.Calls == 0 || res.BusyEmpty.Calls == 0 || res.BusyLookup.Calls < res.BusyEmpty.Calls {
		t.Errorf("prober: %d lookups, %d empty calls during transfers", res.BusyLookup.Calls, res.BusyEmpty.Calls)
	}
	want := []string{"start steps", "end steps", "start idle lookups", "end idle lookups"}
	if !slices.Equal(phases, want) {
		t.Errorf("phases %v, want %v", phases, want)
	}
}
