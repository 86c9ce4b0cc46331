//go:build cuda

package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"gorgonia.org/cu"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

const (
	pad       = 4096 // the first region starts this far into the allocation
	hashBytes = 16
	garbage   = 0xDEADBEEF // what device memory holds before a load
	stale     = 0x0BAD0BAD // what it holds before the fill a store must wait for
)

// benchCase is one shape of KV cache: Regions regions (layers x K/V) of
// RegionBlocks blocks of SegBytes, and transfers of Xfer blocks.
type benchCase struct {
	Name         string `json:"name"`
	Regions      int    `json:"regions"`
	SegBytes     int    `json:"segment_bytes"`
	RegionBlocks int    `json:"region_blocks"`
	Xfer         int    `json:"blocks_per_transfer"`
	Scattered    bool   `json:"scattered"`
}

// The consecutive case coalesces into a few large copies; the scattered one
// is vLLM after some churn: every (block, layer, K/V) segment of 32 KiB
// (16 tokens x 8 KV heads x 128 x bf16) is its own copy.
var benchCases = []benchCase{
	{Name: "consecutive", Regions: 8, SegBytes: 64 << 10, RegionBlocks: 1024, Xfer: 512},
	{Name: "scattered", Regions: 64, SegBytes: 32 << 10, RegionBlocks: 512, Xfer: 128, Scattered: true},
}

type benchConfig struct {
	socket   string
	device   int
	iters    int
	stall    time.Duration
	minRatio float64
	only     string
}

func benchMain(args []string) int {
	fs := flags("bench")
	var cfg benchConfig
	jsonPath := fs.String("json", "", "write the result here")
	fs.StringVar(&cfg.socket, "socket", "", "the daemon's unix socket (required)")
	fs.IntVar(&cfg.device, "device", 0, "CUDA device to allocate on")
	fs.IntVar(&cfg.iters, "iters", 10, "timed transfers per throughput figure (after one warm-up)")
	fs.DurationVar(&cfg.stall, "stall", 300*time.Millisecond, "how long the engine's stream is busy before it writes (or reads) the blocks")
	fs.Float64Var(&cfg.minRatio, "min-ratio", 0.9, "exit 2 when a daemon/plain throughput ratio is below this (0: only report)")
	fs.StringVar(&cfg.only, "case", "", "run only this case (consecutive or scattered)")
	timeout := fs.Duration("timeout", 4*time.Minute, "give up after this long")
	fs.Parse(args)
	r := newResult("bench")
	defer r.write(*jsonPath)
	if cfg.socket == "" || cfg.iters < 1 {
		r.fail("need --socket and --iters >= 1")
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	g, err := newGPU(cfg.device)
	if err != nil {
		r.fail("device %d: %v", cfg.device, err)
		return 1
	}
	defer g.close()
	name, _ := g.dev.Name()
	uuid, _ := deviceUUID(cfg.device)
	r.Data["device"] = map[string]any{"ordinal": cfg.device, "name": name, "uuid": fmt.Sprintf("%x", uuid), "driver_version": cu.Version()}
	cl, err := client.Dial(cfg.socket)
	if err != nil {
		r.fail("%v", err)
		return 1
	}
	defer cl.Close()
	if err := waitHealthy(ctx, cl, cfg.socket); err != nil {
		r.fail("%v", err)
		return 1
	}
	var results []map[string]any
	low := false
	for _, bc := range benchCases {
		if cfg.only != "" && cfg.only != bc.Name {
			continue
		}
		out, lowRatio, err := runCase(ctx, r, g, cl, cfg, bc, uuid)
		results = append(results, out)
		if err != nil {
			r.fail("%s: %v", bc.Name, err)
		}
		low = low || lowRatio
	}
	r.Data["cases"] = results
	switch {
	case len(r.Failures) > 0 && !low:
		return 1
	case len(r.Failures) > 0:
		if len(r.Failures) == countLow(r) {
			return 2
		}
		return 1
	}
	r.say("PASS")
	return 0
}

func countLow(r *result) int {
	n := 0
	for _, f := range r.Failures {
		if bytes.Contains([]byte(f), []byte("below --min-ratio")) {
			n++
		}
	}
	return n
}

// gpu is the check's device context and one stream: the "engine's".
type gpu struct {
	dev    cu.Device
	ctx    cu.CUContext
	stream cu.Stream
}

func newGPU(ord int) (*gpu, error) {
	g := &gpu{}
	var err error
	if g.dev, err = cu.GetDevice(ord); err != nil {
		return nil, err
	}
	if g.ctx, err = g.dev.RetainPrimaryCtx(); err != nil {
		return nil, fmt.Errorf("retain primary context: %w", err)
	}
	if err := cu.SetCurrentContext(g.ctx); err != nil {
		return nil, fmt.Errorf("set context: %w", err)
	}
	if g.stream, err = cu.MakeStream(cu.NonBlocking); err != nil {
		return nil, fmt.Errorf("stream: %w", err)
	}
	return g, nil
}

func (g *gpu) close() {
	g.stream.Destroy()
	g.dev.ReleasePrimaryCtx()
}

func waitHealthy(ctx context.Context, cl *client.Client, socket string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok, err := cl.Healthy(ctx)
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the daemon at %s is not serving after 30s (last error: %v)", socket, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// kv is one registered allocation of a case.
type kv struct {
	bc     benchCase
	g      *gpu
	cl     *client.Client
	mem    cu.DevicePtr
	total  int
	regB   int // bytes of one region
	xferB  int // bytes of one transfer
	regID  uint64
	nsID   uint32
	keys   *pb.KeyList
	nonce  uint64
	src    []int // engine block ids stored, in key order
	dst    []int // engine block ids loaded into
	fill   *pinned
	back   *pinned
	jobSeq uint64
}

func (k *kv) blockOff(region, block int) int { return pad + region*k.regB + block*k.bc.SegBytes }

// hostOff is where segment (k-th block of the transfer, region) sits in a
// packed host buffer: block-major, as the daemon packs a slot.
func (k *kv) hostOff(i, region int) int { return (i*k.bc.Regions + region) * k.bc.SegBytes }

func (k *kv) free() {
	if k.regID != 0 {
		k.cl.Unregister(context.Background(), k.regID)
	}
	for _, p := range []*pinned{k.fill, k.back} {
		if p != nil {
			p.free()
		}
	}
	if k.mem != 0 {
		cu.MemFree(k.mem)
	}
}

func newKV(ctx context.Context, g *gpu, cl *client.Client, bc benchCase, uuid []byte) (*kv, error) {
	k := &kv{bc: bc, g: g, cl: cl, nonce: rand.Uint64()}
	k.regB = bc.RegionBlocks * bc.SegBytes
	k.total = pad + bc.Regions*k.regB
	k.xferB = bc.Regions * bc.Xfer * bc.SegBytes
	var err error
	if k.mem, err = cu.MemAlloc(int64(k.total)); err != nil {
		return k, fmt.Errorf("allocate %d bytes on the device: %w", k.total, err)
	}
	if k.fill, err = newPinned(k.xferB); err != nil {
		return k, err
	}
	if k.back, err = newPinned(k.total); err != nil {
		return k, err
	}
	handle, err := ipcMemHandle(k.mem)
	if err != nil {
		return k, err
	}
	layout := &pb.Layout{HashBytes: hashBytes}
	var regions []*pb.Region
	for i := range bc.Regions {
		layout.Segments = append(layout.Segments, &pb.Segment{Group: 0, Bytes: uint64(bc.SegBytes)})
		regions = append(regions, &pb.Region{
			// The device by UUID; the ordinal deliberately 0, as every
			// worker under its own CUDA_VISIBLE_DEVICES would say.
			Memory:      &pb.Region_Cuda{Cuda: &pb.CudaIpcMemory{Handle: handle, Device: 0, DeviceUuid: uuid, AllocSize: uint64(k.total)}},
			Offset:      uint64(k.blockOff(i, 0)),
			BlockStride: uint64(bc.SegBytes),
			NumBlocks:   uint32(bc.RegionBlocks),
		})
	}
	fp := fmt.Appendf(nil, "gpucheck/%s/%016x", bc.Name, k.nonce)
	reg, err := cl.Register(ctx, fp, layout, regions, "gpucheck "+bc.Name)
	if err != nil {
		return k, fmt.Errorf("Register: %w", err)
	}
	k.regID, k.nsID = reg.GetRegistrationId(), reg.GetNamespaceId()
	hashes := make([][]byte, bc.Xfer)
	for i := range hashes {
		hashes[i] = binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, k.nonce), uint64(i))
	}
	k.keys, _ = client.Keys(0, hashBytes, hashes...)
	half := bc.RegionBlocks / 2
	rng := rand.New(rand.NewPCG(k.nonce, 7))
	if bc.Scattered {
		k.src = rng.Perm(half)[:bc.Xfer]
		k.dst = rng.Perm(half)[:bc.Xfer]
		for i := range k.dst {
			k.dst[i] += half
		}
	} else {
		for i := range bc.Xfer {
			k.src = append(k.src, i)
			k.dst = append(k.dst, half+i)
		}
	}
	return k, nil
}

func (k *kv) job(ids []int) *pb.Job {
	k.jobSeq++
	b := make([]uint32, len(ids))
	for i, id := range ids {
		b[i] = uint32(id)
	}
	return &pb.Job{JobId: k.jobSeq, RequestId: "gpucheck", Keys: k.keys, BlockIds: b}
}

func allOK(op string, res []*pb.JobResult, err error) error {
	if err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	if len(res) != 1 {
		return fmt.Errorf("%s: %d results for 1 job", op, len(res))
	}
	if r := res[0]; !r.GetOk() {
		counts := map[pb.BlockStatus]int{}
		for _, f := range r.GetFailures() {
			counts[f.GetStatus()]++
		}
		return fmt.Errorf("%s: job failed: %d of %d blocks failed, by status %v", op, len(r.GetFailures()), r.GetBlocks(), counts)
	}
	return nil
}

// pattern fills the bytes of the i-th block of the transfer in region reg,
// distinct for every word, region, block and run.
func (k *kv) pattern(i, reg int, dst []byte) {
	x := k.nonce ^ uint64(reg)<<48 ^ uint64(i)<<24
	for w := 0; w < len(dst); w += 4 {
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		binary.LittleEndian.PutUint32(dst[w:], uint32(z^z>>31))
	}
}

// copies queues the transfer's segments between the packed host buffer and
// engine blocks ids on the engine's stream: per region one copy when the ids
// are consecutive, else one per segment (what an engine without the daemon
// would do).
func (k *kv) copies(h *pinned, ids []int, toHost bool) (calls int, err error) {
	bc := k.bc
	s := k.g.stream
	for reg := range bc.Regions {
		if !bc.Scattered {
			// Consecutive ids: region reg's segments are one run on the
			// device, copied as one to a region-major host span.
			dev := k.mem + cu.DevicePtr(k.blockOff(reg, ids[0]))
			host := h.ptr(reg * bc.Xfer * bc.SegBytes)
			n := int64(bc.Xfer * bc.SegBytes)
			if toHost {
				err = cu.MemcpyDtoHAsync(host, dev, n, s)
			} else {
				err = cu.MemcpyHtoDAsync(dev, host, n, s)
			}
			calls++
			if err != nil {
				return calls, err
			}
			continue
		}
		for i, id := range ids {
			dev := k.mem + cu.DevicePtr(k.blockOff(reg, id))
			host := h.ptr(k.hostOff(i, reg))
			if toHost {
				err = cu.MemcpyDtoHAsync(host, dev, int64(bc.SegBytes), s)
			} else {
				err = cu.MemcpyHtoDAsync(dev, host, int64(bc.SegBytes), s)
			}
			calls++
			if err != nil {
				return calls, err
			}
		}
	}
	return calls, nil
}

// segment returns where the pattern of the transfer's i-th block in region
// reg sits in k.fill (the layout copies uses).
func (k *kv) segment(i, reg int) []byte {
	bc := k.bc
	if !bc.Scattered {
		return k.fill.b[(reg*bc.Xfer+i)*bc.SegBytes:][:bc.SegBytes]
	}
	return k.fill.b[k.hostOff(i, reg):][:bc.SegBytes]
}

func runCase(ctx context.Context, r *result, g *gpu, cl *client.Client, cfg benchConfig, bc benchCase, uuid []byte) (map[string]any, bool, error) {
	out := map[string]any{"case": bc}
	k, err := newKV(ctx, g, cl, bc, uuid)
	defer k.free()
	if err != nil {
		return out, false, err
	}
	out["transfer_bytes"] = k.xferB
	out["segments_per_transfer"] = bc.Regions * bc.Xfer
	r.say("%s: %d regions x %d blocks x %d bytes = %.0f MiB per transfer, %d segments",
		bc.Name, bc.Regions, bc.Xfer, bc.SegBytes, float64(k.xferB)/(1<<20), bc.Regions*bc.Xfer)
	if err := k.correctness(ctx, r, cfg, out); err != nil {
		out["correct"] = false
		return out, false, err
	}
	out["correct"] = true
	low, err := k.throughput(ctx, r, cfg, out)
	return out, low, err
}

func (k *kv) memset(word uint32) error {
	if err := cu.MemsetD32(k.mem, word, int64(k.total/4)); err != nil {
		return fmt.Errorf("cuMemsetD32: %w", err)
	}
	return cu.Synchronize()
}

// correctness: a store behind the engine's still-writing stream must store
// what the stream wrote; a load behind the engine's still-reading stream
// must not change what the stream read; every byte is compared.
func (k *kv) correctness(ctx context.Context, r *result, cfg benchConfig, out map[string]any) error {
	bc := k.bc
	for i := range bc.Xfer {
		for reg := range bc.Regions {
			k.pattern(i, reg, k.segment(i, reg))
		}
	}
	if err := k.memset(stale); err != nil {
		return err
	}
	// The engine: busy for a while, then writes the blocks, then records
	// the event the store must wait for.
	ev, err := newIPCEvent()
	if err != nil {
		return err
	}
	defer ev.destroy()
	if err := stall(k.g.stream, cfg.stall); err != nil {
		return err
	}
	if _, err := k.copies(k.fill, k.src, false); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	if err := ev.record(k.g.stream); err != nil {
		return err
	}
	start := time.Now()
	res, err := k.cl.API.Store(ctx, &pb.TransferRequest{RegistrationId: k.regID, Jobs: []*pb.Job{k.job(k.src)}, Wait: true, ReadyEvent: ev.handle})
	took := time.Since(start)
	if err := allOK("Store behind the ready event", res.GetResults(), err); err != nil {
		return err
	}
	if err := k.g.stream.Synchronize(); err != nil {
		return err
	}
	out["store_behind_event_ms"] = took.Milliseconds()
	r.say("%s: store behind the ready event took %v (the engine's stream was busy %v first)", bc.Name, took.Round(time.Millisecond), cfg.stall)
	look, err := k.cl.Lookup(ctx, []uint32{k.nsID}, k.keys, 0)
	if err != nil {
		return fmt.Errorf("Lookup: %w", err)
	}
	if int(look.GetReady()) != bc.Xfer {
		return fmt.Errorf("Lookup: %d of %d stored blocks ready", look.GetReady(), bc.Xfer)
	}

	if err := k.memset(garbage); err != nil {
		return err
	}
	// The engine: busy, then reads the destination blocks (a preempted
	// request's forward still attending to them), then records the event
	// the load must wait for. What it read must be the old bytes.
	ev2, err := newIPCEvent()
	if err != nil {
		return err
	}
	defer ev2.destroy()
	if err := stall(k.g.stream, cfg.stall); err != nil {
		return err
	}
	if _, err := k.copies(k.fill, k.dst, true); err != nil {
		return fmt.Errorf("the engine's read: %w", err)
	}
	if err := ev2.record(k.g.stream); err != nil {
		return err
	}
	start = time.Now()
	res, err = k.cl.API.Load(ctx, &pb.TransferRequest{RegistrationId: k.regID, Jobs: []*pb.Job{k.job(k.dst)}, Wait: true, ReadyEvent: ev2.handle})
	took = time.Since(start)
	if err := allOK("Load behind the ready event", res.GetResults(), err); err != nil {
		return err
	}
	if err := k.g.stream.Synchronize(); err != nil {
		return err
	}
	out["load_behind_event_ms"] = took.Milliseconds()
	r.say("%s: load behind the ready event took %v", bc.Name, took.Round(time.Millisecond))
	if at := notFilled(k.fill.b[:k.xferB], garbage); at >= 0 {
		out["load_raced_the_engine"] = true
		return fmt.Errorf("the engine's read of the destination blocks saw new bytes (at byte %d): the load did not wait for the ready event", at)
	}
	if err := cu.MemcpyDtoH(k.back.ptr(0), k.mem, int64(k.total)); err != nil {
		return fmt.Errorf("cuMemcpyDtoH: %w", err)
	}
	// Rebuild the pattern (k.fill was overwritten by the engine's read).
	want := make([]byte, bc.SegBytes)
	loaded := make(map[[2]int]bool)
	var bad []string
	for i, id := range k.dst {
		for reg := range bc.Regions {
			loaded[[2]int{reg, id}] = true
			k.pattern(i, reg, want)
			got := k.back.b[k.blockOff(reg, id):][:bc.SegBytes]
			if !bytes.Equal(got, want) {
				at := firstDiff(got, want)
				bad = append(bad, fmt.Sprintf("region %d block %d (key %d): byte %d is %#02x, want %#02x", reg, id, i, at, got[at], want[at]))
			}
		}
	}
	// Nothing else may change: the padding and every block not loaded.
	if at := notFilled(k.back.b[:pad], garbage); at >= 0 {
		bad = append(bad, fmt.Sprintf("byte %d before every region changed", at))
	}
	for reg := range bc.Regions {
		for b := range bc.RegionBlocks {
			if loaded[[2]int{reg, b}] {
				continue
			}
			if at := notFilled(k.back.b[k.blockOff(reg, b):][:bc.SegBytes], garbage); at >= 0 {
				bad = append(bad, fmt.Sprintf("region %d block %d, not loaded, changed at byte %d", reg, b, at))
			}
		}
	}
	if len(bad) > 0 {
		out["mismatches"] = len(bad)
		for _, s := range bad[:min(len(bad), 10)] {
			r.say("%s: MISMATCH %s", bc.Name, s)
		}
		return fmt.Errorf("%d mismatches", len(bad))
	}
	r.say("%s: correctness ok: %d blocks x %d regions stored behind a writing stream, loaded behind a reading stream into other blocks, %d bytes compared",
		bc.Name, bc.Xfer, bc.Regions, k.total)
	return nil
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

func notFilled(p []byte, word uint32) int {
	var w [4]byte
	binary.LittleEndian.PutUint32(w[:], word)
	for i := range p {
		if p[i] != w[i%4] {
			return i
		}
	}
	return -1
}

// throughput measures, median of iters after a warm-up: plain pinned copies
// of the same segments, daemon store, plain copies back, daemon load; and
// for the scattered case also one contiguous plain copy per region of the
// same byte count (the bound). It reports whether a ratio is below the floor.
func (k *kv) throughput(ctx context.Context, r *result, cfg benchConfig, out map[string]any) (bool, error) {
	bc := k.bc
	plain := func(toHost bool) func() error {
		return func() error {
			if _, err := k.copies(k.fill, k.src, toHost); err != nil {
				return err
			}
			return k.g.stream.Synchronize()
		}
	}
	contiguous := func() error {
		// The same bytes as one run per region: the hardware's bound.
		n := bc.Xfer * bc.SegBytes
		for reg := range bc.Regions {
			if err := cu.MemcpyDtoHAsync(k.fill.ptr(reg*n), k.mem+cu.DevicePtr(k.blockOff(reg, 0)), int64(n), k.g.stream); err != nil {
				return err
			}
		}
		return k.g.stream.Synchronize()
	}
	store := func() error {
		res, err := k.cl.Store(ctx, k.regID, []*pb.Job{k.job(k.src)}, true)
		return allOK("Store", res, err)
	}
	dropAll := func() error {
		_, err := k.cl.Invalidate(ctx, []uint32{k.nsID}, nil)
		return err
	}
	load := func() error {
		res, err := k.cl.Load(ctx, k.regID, []*pb.Job{k.job(k.dst)}, true)
		return allOK("Load", res, err)
	}
	d2h, err := k.rate(cfg, plain(true), nil)
	if err != nil {
		return false, fmt.Errorf("plain cuMemcpyDtoHAsync: %w", err)
	}
	st, err := k.rate(cfg, store, dropAll)
	if err != nil {
		return false, err
	}
	h2d, err := k.rate(cfg, plain(false), nil)
	if err != nil {
		return false, fmt.Errorf("plain cuMemcpyHtoDAsync: %w", err)
	}
	ld, err := k.rate(cfg, load, nil)
	if err != nil {
		return false, err
	}
	mib := float64(k.xferB) / (1 << 20)
	how := "one copy per region"
	if bc.Scattered {
		how = fmt.Sprintf("one cuMemcpy*Async per segment, %d", bc.Regions*bc.Xfer)
	}
	out["plain_d2h_gbps"], out["daemon_store_gbps"], out["store_ratio"] = d2h, st, st/d2h
	out["plain_h2d_gbps"], out["daemon_load_gbps"], out["load_ratio"] = h2d, ld, ld/h2d
	out["plain_copies"] = how
	r.say("%s: plain DtoH into pinned memory (%s): %6.2f GB/s (%.0f MiB, median of %d)", bc.Name, how, d2h, mib, cfg.iters)
	r.say("%s: daemon store, device to arena:        %6.2f GB/s = %.2f of plain", bc.Name, st, st/d2h)
	r.say("%s: plain HtoD from pinned memory (%s): %6.2f GB/s", bc.Name, how, h2d)
	r.say("%s: daemon load, arena to device:         %6.2f GB/s = %.2f of plain", bc.Name, ld, ld/h2d)
	if bc.Scattered {
		bound, err := k.rate(cfg, contiguous, nil)
		if err != nil {
			return false, fmt.Errorf("contiguous bound: %w", err)
		}
		out["contiguous_d2h_gbps"] = bound
		out["store_of_contiguous"] = st / bound
		r.say("%s: the same bytes as %d contiguous DtoH copies: %6.2f GB/s; daemon store = %.2f of it", bc.Name, bc.Regions, bound, st/bound)
	}
	low := false
	for _, x := range []struct {
		name  string
		ratio float64
	}{{"store", st / d2h}, {"load", ld / h2d}} {
		if cfg.minRatio > 0 && x.ratio < cfg.minRatio {
			r.fail("%s: daemon %s is %.2f of plain copies of the same bytes, below --min-ratio %.2f", bc.Name, x.name, x.ratio, cfg.minRatio)
			low = true
		}
	}
	return low, nil
}

// rate runs f once to warm up and then iters times, calling before (not
// timed) ahead of each run, and returns the median rate in GB/s.
func (k *kv) rate(cfg benchConfig, f, before func() error) (float64, error) {
	var secs []float64
	for i := 0; i <= cfg.iters; i++ {
		if before != nil {
			if err := before(); err != nil {
				return 0, err
			}
		}
		start := time.Now()
		if err := f(); err != nil {
			return 0, err
		}
		if i > 0 {
			secs = append(secs, time.Since(start).Seconds())
		}
	}
	slices.Sort(secs)
	med := secs[len(secs)/2]
	if med <= 0 {
		return 0, errors.New("a transfer took no measurable time")
	}
	return float64(k.xferB) / med / 1e9, nil
}
