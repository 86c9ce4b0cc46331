package engine

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/workload"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// The engine answers its lookups from a mirror of the daemon's event
// stream, over a CPU tier that evicts to a disk tier, with loads failing
// now and then: every block it offered was one the engine stored, every
// load delivered the right bytes, and once the daemon is quiet a new
// mirror of the namespace answers every request's keys exactly as the
// daemon's Lookup does (tiers included).
func TestMirrorMatchesLookup(t *testing.T) {
	gate := testenv.NewGate()
	d := testenv.Start(t, testenv.Options{Quiet: true, CPUBytes: 4 << 20, ChunkBytes: 1 << 20, DiskDirs: []string{t.TempDir()}, DiskBytes: 16 << 20, Wrap: gate.Wrap})
	region, err := model.NewRegion("/dev/shm", tiny, 64)
	if err != nil {
		t.Fatal(err)
	}
	defer region.Close()
	plan, err := workload.Steps(workload.Default(7), 60, 64)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	fp := []byte(t.Name())
	res, err := Run(ctx, Config{Client: d.Client(t), MirrorClient: d.Client(t), Region: region, Fingerprint: fp, Steps: plan, Keep: true,
		BetweenSteps: func(step int) error {
			if step%5 == 4 {
				gate.FailNext(1)
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	m := res.Mirror
	t.Logf("mirror: %v; hits cpu %d disk %d of %d; load failed %v", m, res.HitCPU, res.HitDisk, res.LookedUp, res.LoadFailed)
	if m.Requests == 0 || m.Answered == 0 || m.Answered+m.NotLive+m.Recent+m.Remote != m.Requests || m.Offered == 0 {
		t.Fatalf("the mirror answered nothing, or its counts do not add up: %v", m)
	}
	if m.Unknown != 0 || res.CorruptDelivered != 0 {
		t.Errorf("the mirror offered %d blocks never stored; %d loads delivered wrong bytes (%s)", m.Unknown, res.CorruptDelivered, res.FirstCorrupt)
	}
	if res.HitDisk == 0 || m.MirrorOp.Calls != m.Requests || m.MapOp.Calls != m.Requests || res.Lookup.Calls != m.Requests {
		t.Errorf("no disk hits, or not every lookup timed: %v", m)
	}

	c := d.Client(t)
	ids, err := c.Resolve(ctx, fp)
	if err != nil || len(ids) != 1 {
		t.Fatalf("resolve: %v %v", ids, err)
	}
	mir := NewMirror(d.Client(t), ids, 1<<20)
	defer mir.Close()
	var diff string
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); {
		diff = ""
		for _, step := range plan {
			for _, r := range step {
				keys, _ := client.Keys(0, model.HashBytes, r.Keys...)
				lr, err := c.API.Lookup(ctx, &pb.LookupRequest{NamespaceIds: ids, Keys: keys, Peek: true})
				if err != nil {
					t.Fatal(err)
				}
				got, live := mir.Lookup(ids, 0, r.Keys, nil)
				if !live {
					diff = "not live"
				} else if !slices.Equal(got, lr.GetTiers()) {
					diff = fmt.Sprintf("request %s: mirror %v, daemon %v", r.ID, got, lr.GetTiers())
				}
			}
		}
		if diff == "" {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	if diff != "" {
		t.Fatalf("the mirror never matched the daemon's Lookup: %s", diff)
	}
	if n, streams, _, overflow, _ := mir.Counts(); n == 0 || streams != 1 || overflow {
		t.Errorf("mirror: %d blocks, %d streams, overflow %v", n, streams, overflow)
	}
}

// Past its most blocks the mirror stops for good and answers nothing.
func TestMirrorOverflow(t *testing.T) {
	d := testenv.Start(t, testenv.Options{Quiet: true})
	region, err := model.NewRegion("/dev/shm", tiny, 64)
	if err != nil {
		t.Fatal(err)
	}
	defer region.Close()
	plan, err := workload.Steps(workload.Default(3), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := Run(ctx, Config{Client: d.Client(t), MirrorClient: d.Client(t), MirrorMaxBlocks: 8, Region: region, Fingerprint: []byte(t.Name()), Steps: plan})
	if err != nil {
		t.Fatal(err)
	}
	m := res.Mirror
	if !m.Overflow || m.Blocks != 0 || m.NotLive == 0 {
		t.Fatalf("mirror %v", m)
	}
}
