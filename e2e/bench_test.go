package e2e

import (
	"context"
	"fmt"
	"testing"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// The benchmarks come in pairs measured in the same run: the daemon's figure
// and the limit it is held to. Compare with benchstat; argue with the ratio.

// 32 blocks of 2 MiB (32 layers x 64 KiB), one job, as a vLLM step might.
var roundTrip = testenv.Model{Layers: 32, SegBytes: 64 << 10, Blocks: 64}

const rtBlocks = 32

// BenchmarkRoundTrip stores 32 blocks of 2 MiB from engine memory and loads
// them back into other engine blocks through the daemon: 128 MiB copied per
// op, the same bytes BenchmarkCopyBaseline moves with copy().
func BenchmarkRoundTrip(b *testing.B) {
	d := testenv.Start(b, testenv.Options{CPUBytes: 256 << 20, Quiet: true})
	e := register(b, d, roundTrip, "bench")
	hs := e.hashes(1, rtBlocks)
	for i, h := range hs {
		e.m.Fill(e.r, i, h)
	}
	ctx := context.Background()
	storeJob := []*pb.Job{testenv.Job(1, hs, seq(0, rtBlocks))}
	loadJob := []*pb.Job{testenv.Job(2, hs, seq(rtBlocks, rtBlocks))}
	b.SetBytes(2 * rtBlocks * int64(roundTrip.Layers*roundTrip.SegBytes))
	b.ReportAllocs()
	for b.Loop() {
		res, err := e.c.Store(ctx, e.reg.RegistrationId, storeJob, true)
		if err != nil || !res[0].Ok || res[0].Bytes == 0 {
			b.Fatalf("store: %v %v", res, err)
		}
		res, err = e.c.Load(ctx, e.reg.RegistrationId, loadJob, true)
		if err != nil || !res[0].Ok {
			b.Fatalf("load: %v %v", res, err)
		}
		b.StopTimer()
		if _, err := e.c.Invalidate(ctx, []uint32{e.reg.NamespaceId}, nil); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.StopTimer()
	e.verify(b, &pb.JobResult{}, hs, seq(rtBlocks, rtBlocks))
}

// BenchmarkCopyBaseline is the memory limit of the same work: copy() of the
// same 32 blocks segment by segment from a /dev/shm region into an anonymous
// buffer and back into other blocks.
func BenchmarkCopyBaseline(b *testing.B) {
	m := roundTrip
	r := testenv.NewRegion(b, m.RegionBytes())
	arena := testenv.NewRegion(b, rtBlocks*m.Layers*m.SegBytes)
	b.SetBytes(2 * rtBlocks * int64(m.Layers*m.SegBytes))
	for b.Loop() {
		off := 0
		for blk := 0; blk < rtBlocks; blk++ {
			for l := 0; l < m.Layers; l++ {
				copy(arena.Mem[off:off+m.SegBytes], m.Segment(r, l, blk))
				off += m.SegBytes
			}
		}
		off = 0
		for blk := 0; blk < rtBlocks; blk++ {
			for l := 0; l < m.Layers; l++ {
				copy(m.Segment(r, l, rtBlocks+blk), arena.Mem[off:off+m.SegBytes])
				off += m.SegBytes
			}
		}
	}
}

// BenchmarkLookup512 is one Lookup of 512 ready keys (one namespace), with
// (peek=false) and without (peek=true) recording the accesses for the
// admission policy.
func BenchmarkLookup512(b *testing.B) {
	for _, peek := range []bool{false, true} {
		b.Run(fmt.Sprintf("peek=%v", peek), func(b *testing.B) { benchLookup(b, peek) })
	}
}

func benchLookup(b *testing.B, peek bool) {
	d := testenv.Start(b, testenv.Options{CPUBytes: 64 << 20, Quiet: true})
	m := testenv.Model{Layers: 1, SegBytes: 4096, Blocks: 512}
	e := register(b, d, m, "lookup")
	hs := e.hashes(3, 512)
	if res := e.store(b, 1, hs, seq(0, 512)); !res.Ok {
		b.Fatalf("store: %+v", res)
	}
	keys := testenv.Keys(hs...)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		r, err := e.c.API.Lookup(ctx, &pb.LookupRequest{NamespaceIds: []uint32{e.reg.NamespaceId}, Keys: keys, Peek: peek})
		if err != nil || r.Ready != 512 {
			b.Fatalf("lookup: %v %v", r, err)
		}
	}
}

// BenchmarkEmptyRPC is the control-path floor: a health check over the same
// kind of connection to the same server.
func BenchmarkEmptyRPC(b *testing.B) {
	d := testenv.Start(b, testenv.Options{CPUBytes: 64 << 20, Quiet: true})
	c := d.Client(b)
	h := healthpb.NewHealthClient(c.Conn())
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := h.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			b.Fatal(err)
		}
	}
}
