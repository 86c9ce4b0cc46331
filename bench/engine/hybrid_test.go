package engine

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/workload"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// tinyHybrids are the presets' kinds and groups in small blocks: a
// full-attention group beside three 128-token-window groups, and a
// full-attention group beside six Mamba state groups.
func tinyHybrids() []model.Hybrid {
	att := []int{4096, 4096}
	swa := model.Hybrid{Name: "tiny-swa", About: "test"}
	swa.Groups = append(swa.Groups, model.Group{Kind: model.FullAttention, Layers: 1, BlockTokens: 16, Segments: att})
	for range 3 {
		swa.Groups = append(swa.Groups, model.Group{Kind: model.SlidingWindow, Layers: 1, BlockTokens: 16, WindowTokens: 128, Segments: att})
	}
	mamba := model.Hybrid{Name: "tiny-mamba", About: "test"}
	mamba.Groups = append(mamba.Groups, model.Group{Kind: model.FullAttention, Layers: 1, BlockTokens: 16, Segments: att})
	for range 6 {
		mamba.Groups = append(mamba.Groups, model.Group{Kind: model.MambaState, Layers: 1, BlockTokens: 16, Segments: []int{1536, 6144}})
	}
	return []model.Hybrid{swa, mamba}
}

func runHybrid(t *testing.T, d *testenv.Daemon, h model.Hybrid, steps int, between func(context.Context, int, uint32) error) *HybridResult {
	t.Helper()
	region, err := model.NewHybridRegion("/dev/shm", h, 64)
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
	res, err := RunHybrid(ctx, HybridConfig{Client: d.Client(t), Region: region, Fingerprint: []byte(t.Name() + h.Name), Steps: plan, BetweenSteps: between})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// Both hybrids through the daemon with room for the working set: every
// loaded block verifies, the windowed treatment hits exactly as often as
// the all-full one, looks up no windowed key outside a hit's window, moves
// exactly the rule's bytes (at most full layers' + window bytes per hit),
// and fewer bytes and keys than the all-full treatment.
func TestHybridHealthy(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true, CPUBytes: 256 << 20})
	for _, h := range tinyHybrids() {
		res := runHybrid(t, d, h, 20, nil)
		w, f := &res.Windowed, &res.AllFull
		t.Logf("%s: windowed hit rate %.3f, %d keys, %d bytes loaded (bound %d); all-full %.3f, %d keys, %d bytes",
			h.Name, w.HitRate(), w.KeysLookedUp, w.Load.Bytes, w.Bound, f.HitRate(), f.KeysLookedUp, f.Load.Bytes)
		for _, tr := range []*Treatment{w, f} {
			if tr.CorruptDelivered != 0 || tr.FailedReoffered != 0 || len(tr.LoadFailed) != 0 || len(tr.StoreFailed) != 0 {
				t.Errorf("%s %s: corrupt %d (%s), reoffered %d, load failed %v, store failed %v", h.Name, tr.Name,
					tr.CorruptDelivered, tr.FirstCorrupt, tr.FailedReoffered, tr.LoadFailed, tr.StoreFailed)
			}
			if tr.Load.Bytes != tr.Expected {
				t.Errorf("%s %s: the daemon moved %d bytes, the hits need %d", h.Name, tr.Name, tr.Load.Bytes, tr.Expected)
			}
		}
		if res.Steps != 20 || w.HitUnits == 0 || w.HitUnits != f.HitUnits || w.Hits != f.Hits {
			t.Errorf("%s: %d steps; windowed hit %d units in %d requests, all-full %d in %d", h.Name, res.Steps, w.HitUnits, w.Hits, f.HitUnits, f.Hits)
		}
		if w.OutsideWindow != 0 || w.Retries != 0 {
			t.Errorf("%s: %d windowed keys looked up outside a hit's window, %d retried rounds", h.Name, w.OutsideWindow, w.Retries)
		}
		if w.Load.Bytes > w.Bound || w.Load.Bytes >= f.Load.Bytes || w.KeysLookedUp >= f.KeysLookedUp {
			t.Errorf("%s: windowed moved %d bytes (bound %d), all-full %d; keys %d vs %d", h.Name, w.Load.Bytes, w.Bound, f.Load.Bytes, w.KeysLookedUp, f.KeysLookedUp)
		}
	}
}

// Early windowed blocks dropped (as an eviction would) do not cut the
// hits whose window is past them; the all-full treatment loses those hits,
// and no wrong byte is loaded either way.
func TestHybridEarlyWindowBlocksDropped(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true, CPUBytes: 256 << 20})
	h := tinyHybrids()[0]
	plan, err := workload.Steps(workload.Default(3), 20, 64)
	if err != nil {
		t.Fatal(err)
	}
	c := d.Client(t)
	res := runHybrid(t, d, h, 20, func(ctx context.Context, step int, ns uint32) error {
		// Drop block 0 of every sliding-window group of this step's requests.
		var hashes [][]byte
		for _, r := range plan[step] {
			hashes = append(hashes, r.Keys[0])
		}
		for g := 1; g < len(h.Groups); g++ {
			keys, _ := client.Keys(uint32(g), model.HashBytes, hashes...)
			if _, err := c.Invalidate(ctx, []uint32{ns}, keys); err != nil {
				return err
			}
		}
		return nil
	})
	w, f := &res.Windowed, &res.AllFull
	t.Logf("windowed: %d hit units in %d hits, %d retries, %d keys outside; all-full: %d hit units in %d hits", w.HitUnits, w.Hits, w.Retries, w.OutsideWindow, f.HitUnits, f.Hits)
	if w.CorruptDelivered != 0 || f.CorruptDelivered != 0 {
		t.Errorf("wrong bytes: %s %s", w.FirstCorrupt, f.FirstCorrupt)
	}
	if w.HitUnits <= f.HitUnits || w.Load.Bytes > w.Bound || w.Load.Bytes != w.Expected {
		t.Errorf("windowed hit %d units, all-full %d; windowed moved %d bytes, bound %d, expected %d", w.HitUnits, f.HitUnits, w.Load.Bytes, w.Bound, w.Expected)
	}
}

// The daemon's Lookup with keys in reverse order (windows.md: the window's
// trailing run): ready counts the keys present from the list's start,
// whatever their order, and a lease pins them for the Load.
func TestLookupReversedKeys(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true})
	h := tinyHybrids()[0]
	region, err := model.NewHybridRegion("/dev/shm", h, 16)
	if err != nil {
		t.Fatal(err)
	}
	defer region.Close()
	c := d.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := c.Register(ctx, []byte(t.Name()), h.Layout(), region.Wire(), "test")
	if err != nil {
		t.Fatal(err)
	}
	plan, err := workload.Steps(workload.Default(3), 1, 64)
	if err != nil {
		t.Fatal(err)
	}
	var hashes [][]byte
	for _, q := range plan[0] {
		if len(q.Keys) >= 10 {
			hashes = q.Keys[:10]
			break
		}
	}
	if hashes == nil {
		t.Fatal("no request of 10 blocks")
	}
	// Store blocks 3..7 of group 1 only.
	var ids []uint32
	for i := 3; i < 8; i++ {
		region.Fill(1, i, hashes[i])
		ids = append(ids, uint32(i))
	}
	keys, _ := client.Keys(1, model.HashBytes, hashes[3:8]...)
	if _, err := c.Store(ctx, r.RegistrationId, []*pb.Job{{JobId: 1, Keys: keys, BlockIds: ids}}, true); err != nil {
		t.Fatal(err)
	}
	rev := func(from, to int) [][]byte {
		s := slices.Clone(hashes[from:to])
		slices.Reverse(s)
		return s
	}
	for _, c0 := range []struct {
		from, to, want int
	}{{0, 8, 5}, {3, 8, 5}, {0, 10, 0}, {4, 8, 4}, {0, 6, 3}} {
		keys, _ := client.Keys(1, model.HashBytes, rev(c0.from, c0.to)...)
		lr, err := c.Lookup(ctx, []uint32{r.NamespaceId}, keys, 5000)
		if err != nil {
			t.Fatal(err)
		}
		if int(lr.GetReady()) != c0.want {
			t.Errorf("blocks %d..%d reversed: ready %d, want %d (blocks 3..7 stored)", c0.from, c0.to-1, lr.GetReady(), c0.want)
		}
		if c0.want == 0 {
			continue
		}
		// The lease's Load moves the run, last block first.
		var lids []uint32
		for i := range c0.want {
			lids = append(lids, uint32(c0.to-1-i))
			region.Poison(1, c0.to-1-i)
		}
		keys, _ = client.Keys(1, model.HashBytes, rev(c0.from, c0.to)[:c0.want]...)
		res, err := c.Load(ctx, r.RegistrationId, []*pb.Job{{JobId: uint64(10 + c0.from*10 + c0.to), Keys: keys, BlockIds: lids, LeaseId: lr.GetLeaseId()}}, true)
		if err != nil || len(res) != 1 || !res[0].GetOk() {
			t.Fatalf("load of the run: %v %v", res, err)
		}
		for _, b := range lids {
			if err := region.Check(1, int(b), hashes[b]); err != nil {
				t.Error(err)
			}
		}
	}
}

// Copies that fail fail their request: it is computed and stored again in
// full, no wrong byte is taken for a hit, and no failed block is offered
// again before it is stored again.
func TestHybridFailedCopies(t *testing.T) {
	gate := testenv.NewGate()
	d := testenv.Start(t, testenv.Options{Quiet: true, CPUBytes: 256 << 20, Wrap: gate.Wrap})
	for _, h := range tinyHybrids() {
		res := runHybrid(t, d, h, 30, func(_ context.Context, step int, _ uint32) error {
			if step%3 == 2 {
				gate.FailNext(1)
			}
			return nil
		})
		failed := 0
		for _, tr := range []*Treatment{&res.Windowed, &res.AllFull} {
			failed += tr.LoadFailed["DMA_ERROR"]
			if tr.CorruptDelivered != 0 || tr.FailedReoffered != 0 {
				t.Errorf("%s %s: %d wrong blocks (%s), %d failed blocks offered again (%s)", h.Name, tr.Name, tr.CorruptDelivered, tr.FirstCorrupt, tr.FailedReoffered, tr.FirstReoffer)
			}
		}
		t.Logf("%s: load failures windowed %v, all-full %v; stores %v %v", h.Name, res.Windowed.LoadFailed, res.AllFull.LoadFailed, res.Windowed.StoreFailed, res.AllFull.StoreFailed)
		if failed == 0 {
			t.Errorf("%s: no load failed DMA_ERROR: the gate did not reach the copies", h.Name)
		}
	}
}
