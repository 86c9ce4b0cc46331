//go:build cuda

// Command gpucheck proves the CUDA path of a running kvoffloadd on a machine
// with a GPU, from the engine's side of the socket. It allocates device
// memory, exports it by CUDA IPC handle and registers it as the daemon's
// regions (several tensors of one allocation, at offsets inside it, as
// PyTorch hands them out). Then:
//
//  1. Correctness: it fills the blocks with a known pattern by host-to-device
//     copies queued behind a stall on its stream, records an IPC event after
//     them and stores the blocks with that ready event (so a daemon that does
//     not wait for the event stores stale bytes); overwrites device memory;
//     loads the blocks back into other, shuffled block ids; and compares every
//     byte, including those the load must not touch.
//  2. Throughput: store (device to arena) and load (arena to device) through
//     the daemon against plain cuMemcpyDtoHAsync/HtoDAsync of the same bytes
//     from pinned memory, in the same run.
//
// It prints one line per figure and exits 1 on any mismatch or failed call,
// 2 when a throughput ratio is below --min-ratio. scripts/gpu-check.sh builds
// and starts the daemon and runs it; see docs/cuda.md.
package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"time"

	"gorgonia.org/cu"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

const (
	pad       = 4096 // the first region starts this far into the allocation
	hashBytes = 16
	garbage   = 0xDEADBEEF // what device memory holds after the overwrite
	stale     = 0x0BAD0BAD // what it holds before the fill the store must wait for
)

type config struct {
	socket   string
	device   int
	regions  int
	segBytes int
	blocks   int
	iters    int
	stall    time.Duration
	minRatio float64
	timeout  time.Duration
}

func main() {
	// The CUDA context is current on one OS thread: keep main on it.
	runtime.LockOSThread()
	var cfg config
	flag.StringVar(&cfg.socket, "socket", "", "the daemon's unix socket (required)")
	flag.IntVar(&cfg.device, "device", 0, "CUDA device to allocate on")
	flag.IntVar(&cfg.regions, "regions", 8, "regions, i.e. segments per block (layers x K/V)")
	flag.IntVar(&cfg.segBytes, "segment-bytes", 64<<10, "bytes of one block in one region (a multiple of 4)")
	flag.IntVar(&cfg.blocks, "blocks", 512, "blocks per transfer; each region holds twice as many")
	flag.IntVar(&cfg.iters, "iters", 10, "timed transfers per throughput figure (after one warm-up)")
	flag.DurationVar(&cfg.stall, "stall", 300*time.Millisecond, "how long the fill waits on its stream before writing the blocks")
	flag.Float64Var(&cfg.minRatio, "min-ratio", 0, "exit 2 when daemon/plain throughput is below this (the target is 0.9; 0 only reports)")
	flag.DurationVar(&cfg.timeout, "timeout", 4*time.Minute, "give up after this long")
	flag.Parse()
	if cfg.socket == "" || cfg.regions < 1 || cfg.blocks < 2 || cfg.segBytes < 4 || cfg.segBytes%4 != 0 || cfg.iters < 1 {
		fmt.Fprintln(os.Stderr, "gpucheck: need --socket, --regions >= 1, --blocks >= 2, --segment-bytes a positive multiple of 4, --iters >= 1")
		os.Exit(1)
	}
	os.Exit(run(cfg))
}

func run(cfg config) int {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.timeout)
	defer cancel()
	c, err := setup(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gpucheck: FAIL setup:", err)
		return 1
	}
	defer c.teardown()
	if err := c.correctness(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "gpucheck: FAIL correctness:", err)
		return 1
	}
	ratios, err := c.throughput(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gpucheck: FAIL throughput:", err)
		return 1
	}
	for _, r := range ratios {
		if r < cfg.minRatio {
			fmt.Printf("gpucheck: FAIL a daemon/plain ratio is %.2f, below --min-ratio %.2f\n", r, cfg.minRatio)
			return 2
		}
	}
	fmt.Println("gpucheck: PASS")
	return 0
}

type checker struct {
	cfg     config
	ctx     cu.CUContext
	dev     cu.Device
	stream  cu.Stream
	mem     cu.DevicePtr
	total   int // bytes of the allocation
	regionB int // bytes of one region
	xfer    int // bytes of one transfer: blocks x regions x segment
	fill    *pinned
	back    *pinned
	cl      *client.Client
	regID   uint64
	nsID    uint32
	keys    *pb.KeyList
	nonce   uint64
}

func setup(ctx context.Context, cfg config) (*checker, error) {
	c := &checker{cfg: cfg, nonce: rand.Uint64()}
	var err error
	if c.dev, err = cu.GetDevice(cfg.device); err != nil {
		return nil, fmt.Errorf("device %d: %w", cfg.device, err)
	}
	if c.ctx, err = c.dev.RetainPrimaryCtx(); err != nil {
		return nil, fmt.Errorf("retain primary context: %w", err)
	}
	if err := cu.SetCurrentContext(c.ctx); err != nil {
		return nil, fmt.Errorf("set context: %w", err)
	}
	if c.stream, err = cu.MakeStream(cu.NonBlocking); err != nil {
		return nil, fmt.Errorf("stream: %w", err)
	}
	seg, b, r := cfg.segBytes, cfg.blocks, cfg.regions
	c.regionB = 2 * b * seg
	c.total = pad + r*c.regionB
	c.xfer = r * b * seg
	if c.mem, err = cu.MemAlloc(int64(c.total)); err != nil {
		return nil, fmt.Errorf("allocate %d bytes on the device: %w", c.total, err)
	}
	if c.fill, err = newPinned(c.xfer); err != nil {
		return nil, err
	}
	if c.back, err = newPinned(c.total); err != nil {
		return nil, err
	}
	name, _ := c.dev.Name()
	fmt.Printf("gpucheck: device %d %s, driver %d; %d regions x %d blocks x %d bytes = %.1f MiB per transfer\n",
		cfg.device, name, cu.Version(), r, b, seg, float64(c.xfer)/(1<<20))

	if c.cl, err = client.Dial(cfg.socket); err != nil {
		return nil, err
	}
	if err := c.waitHealthy(ctx); err != nil {
		return nil, err
	}
	handle, err := ipcMemHandle(c.mem)
	if err != nil {
		return nil, err
	}
	layout := &pb.Layout{HashBytes: hashBytes}
	var regions []*pb.Region
	for i := range r {
		layout.Segments = append(layout.Segments, &pb.Segment{Group: 0, Bytes: uint64(seg)})
		regions = append(regions, &pb.Region{
			Memory:      &pb.Region_Cuda{Cuda: &pb.CudaIpcMemory{Handle: handle, Device: int32(cfg.device), AllocSize: uint64(c.total)}},
			Offset:      uint64(c.regionOff(i)),
			BlockStride: uint64(seg),
			NumBlocks:   uint32(2 * b),
		})
	}
	fp := fmt.Appendf(nil, "gpucheck/%016x", c.nonce)
	reg, err := c.cl.Register(ctx, fp, layout, regions, "gpucheck")
	if err != nil {
		return nil, fmt.Errorf("Register: %w", err)
	}
	c.regID, c.nsID = reg.GetRegistrationId(), reg.GetNamespaceId()
	hashes := make([][]byte, b)
	for i := range hashes {
		hashes[i] = binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, c.nonce), uint64(i))
	}
	c.keys, _ = client.Keys(0, hashBytes, hashes...)
	return c, nil
}

func (c *checker) waitHealthy(ctx context.Context) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok, err := c.cl.Healthy(ctx)
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the daemon at %s is not serving after 30s (last error: %v)", c.cfg.socket, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (c *checker) teardown() {
	if c.cl != nil {
		if c.regID != 0 {
			if err := c.cl.Unregister(context.Background(), c.regID); err != nil {
				fmt.Fprintln(os.Stderr, "gpucheck: Unregister:", err)
			}
		}
		c.cl.Close()
	}
	for _, p := range []*pinned{c.fill, c.back} {
		if p != nil {
			p.free()
		}
	}
	if c.mem != 0 {
		cu.MemFree(c.mem)
	}
	c.stream.Destroy()
	c.dev.ReleasePrimaryCtx()
}

func (c *checker) regionOff(i int) int { return pad + i*c.regionB }

func (c *checker) blockOff(i, b int) int { return c.regionOff(i) + b*c.cfg.segBytes }

// job moves the check's blocks 0..n-1 to or from engine blocks ids.
func (c *checker) job(id uint64, ids []uint32) *pb.Job {
	return &pb.Job{JobId: id, RequestId: "gpucheck", Keys: c.keys, BlockIds: ids}
}

func ids(from int, perm []int) []uint32 {
	out := make([]uint32, len(perm))
	for i, p := range perm {
		out[i] = uint32(from + p)
	}
	return out
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

// pattern fills the bytes of block b of region i, distinct for every word,
// region, block and run.
func (c *checker) pattern(i, b int, dst []byte) {
	x := c.nonce ^ uint64(i)<<48 ^ uint64(b)<<24
	for w := 0; w < len(dst); w += 4 {
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		binary.LittleEndian.PutUint32(dst[w:], uint32(z^z>>31))
	}
}

func (c *checker) correctness(ctx context.Context) error {
	seg, nb, nr := c.cfg.segBytes, c.cfg.blocks, c.cfg.regions
	for i := range nr {
		for b := range nb {
			c.pattern(i, b, c.fill.b[(i*nb+b)*seg:][:seg])
		}
	}
	if err := cu.MemsetD32(c.mem, stale, int64(c.total/4)); err != nil {
		return fmt.Errorf("cuMemsetD32: %w", err)
	}
	if err := cu.Synchronize(); err != nil {
		return err
	}
	// The "engine": its stream is busy for a while, then writes the blocks,
	// then records the event the store must wait for.
	ev, err := newIPCEvent()
	if err != nil {
		return err
	}
	defer ev.destroy()
	if err := stall(c.stream, c.cfg.stall); err != nil {
		return err
	}
	for i := range nr {
		if err := cu.MemcpyHtoDAsync(c.mem+cu.DevicePtr(c.regionOff(i)), c.fill.ptr(i*nb*seg), int64(nb*seg), c.stream); err != nil {
			return fmt.Errorf("cuMemcpyHtoDAsync: %w", err)
		}
	}
	if err := ev.record(c.stream); err != nil {
		return err
	}
	inOrder := make([]int, nb)
	for i := range inOrder {
		inOrder[i] = i
	}
	start := time.Now()
	res, err := c.cl.API.Store(ctx, &pb.TransferRequest{
		RegistrationId: c.regID, Jobs: []*pb.Job{c.job(1, ids(0, inOrder))}, Wait: true, ReadyEvent: ev.handle,
	})
	took := time.Since(start)
	if err := allOK("Store with ready event", res.GetResults(), err); err != nil {
		return err
	}
	if err := c.stream.Synchronize(); err != nil {
		return err
	}
	fmt.Printf("gpucheck: store behind the ready event took %v (the engine's stream stalled %v first)\n", took.Round(time.Millisecond), c.cfg.stall)

	look, err := c.cl.Lookup(ctx, []uint32{c.nsID}, c.keys, 0)
	if err != nil {
		return fmt.Errorf("Lookup: %w", err)
	}
	if int(look.GetReady()) != nb {
		return fmt.Errorf("Lookup: %d of %d stored blocks ready", look.GetReady(), nb)
	}

	if err := cu.MemsetD32(c.mem, garbage, int64(c.total/4)); err != nil {
		return fmt.Errorf("cuMemsetD32: %w", err)
	}
	if err := cu.Synchronize(); err != nil {
		return err
	}
	// Load into the second half, shuffled: copies that do not coalesce.
	perm := rand.New(rand.NewPCG(c.nonce, 1)).Perm(nb)
	res2, err := c.cl.API.Load(ctx, &pb.TransferRequest{RegistrationId: c.regID, Jobs: []*pb.Job{c.job(2, ids(nb, perm))}, Wait: true})
	if err := allOK("Load", res2.GetResults(), err); err != nil {
		return err
	}
	if err := cu.MemcpyDtoH(c.back.ptr(0), c.mem, int64(c.total)); err != nil {
		return fmt.Errorf("cuMemcpyDtoH: %w", err)
	}

	var bad []string
	mismatch := func(format string, a ...any) {
		if len(bad) < 10 {
			bad = append(bad, fmt.Sprintf(format, a...))
		} else if len(bad) == 10 {
			bad = append(bad, "...")
		}
	}
	mismatches := 0
	for i := range nr {
		for b := range nb {
			want := c.fill.b[(i*nb+b)*seg:][:seg]
			dst := nb + perm[b]
			got := c.back.b[c.blockOff(i, dst):][:seg]
			if !bytes.Equal(got, want) {
				mismatches++
				at := firstDiff(got, want)
				mismatch("region %d block %d (stored from block %d): byte %d is %#02x, want %#02x", i, dst, b, at, got[at], want[at])
			}
		}
		// The load must not write the first half, nor between regions.
		if at := notFilled(c.back.b[c.regionOff(i):][:nb*seg], garbage); at >= 0 {
			mismatches++
			mismatch("region %d: byte %d of blocks 0..%d changed, and the load must not write there", i, at, nb-1)
		}
	}
	if at := notFilled(c.back.b[:pad], garbage); at >= 0 {
		mismatches++
		mismatch("byte %d of the allocation, before every region, changed", at)
	}
	if mismatches > 0 {
		for _, s := range bad {
			fmt.Println("gpucheck: MISMATCH", s)
		}
		return fmt.Errorf("%d mismatches", mismatches)
	}
	fmt.Printf("gpucheck: correctness ok: %d blocks x %d regions stored behind a ready event, overwritten, loaded into shuffled other blocks, %d bytes compared\n",
		nb, nr, c.total)
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

// throughput prints the four figures and returns the daemon/plain ratios.
func (c *checker) throughput(ctx context.Context) ([]float64, error) {
	seg, nb, nr := c.cfg.segBytes, c.cfg.blocks, c.cfg.regions
	plain := func(toHost bool) func() error {
		return func() error {
			for i := range nr {
				dev := c.mem + cu.DevicePtr(c.regionOff(i))
				host := c.fill.ptr(i * nb * seg)
				var err error
				if toHost {
					err = cu.MemcpyDtoHAsync(host, dev, int64(nb*seg), c.stream)
				} else {
					err = cu.MemcpyHtoDAsync(dev, host, int64(nb*seg), c.stream)
				}
				if err != nil {
					return err
				}
			}
			return c.stream.Synchronize()
		}
	}
	inOrder := make([]int, nb)
	for i := range inOrder {
		inOrder[i] = i
	}
	jobID := uint64(100)
	store := func() error {
		jobID++
		res, err := c.cl.Store(ctx, c.regID, []*pb.Job{c.job(jobID, ids(0, inOrder))}, true)
		return allOK("Store", res, err)
	}
	dropAll := func() error {
		_, err := c.cl.Invalidate(ctx, []uint32{c.nsID}, nil)
		return err
	}
	load := func() error {
		jobID++
		res, err := c.cl.Load(ctx, c.regID, []*pb.Job{c.job(jobID, ids(nb, inOrder))}, true)
		return allOK("Load", res, err)
	}

	d2h, err := c.rate(plain(true), nil)
	if err != nil {
		return nil, fmt.Errorf("plain cuMemcpyDtoHAsync: %w", err)
	}
	st, err := c.rate(store, dropAll)
	if err != nil {
		return nil, err
	}
	h2d, err := c.rate(plain(false), nil)
	if err != nil {
		return nil, fmt.Errorf("plain cuMemcpyHtoDAsync: %w", err)
	}
	ld, err := c.rate(load, nil)
	if err != nil {
		return nil, err
	}
	mib := float64(c.xfer) / (1 << 20)
	fmt.Printf("gpucheck: plain cuMemcpyDtoHAsync into pinned memory: %6.2f GB/s (%.0f MiB, median of %d)\n", d2h, mib, c.cfg.iters)
	fmt.Printf("gpucheck: daemon store, device to arena:              %6.2f GB/s = %.2f of plain\n", st, st/d2h)
	fmt.Printf("gpucheck: plain cuMemcpyHtoDAsync from pinned memory: %6.2f GB/s (%.0f MiB, median of %d)\n", h2d, mib, c.cfg.iters)
	fmt.Printf("gpucheck: daemon load, arena to device:               %6.2f GB/s = %.2f of plain\n", ld, ld/h2d)
	return []float64{st / d2h, ld / h2d}, nil
}

// rate runs f once to warm up and then iters times, calling before (not
// timed) ahead of each run, and returns the median rate in GB/s.
func (c *checker) rate(f, before func() error) (float64, error) {
	var secs []float64
	for i := 0; i <= c.cfg.iters; i++ {
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
	return float64(c.xfer) / med / 1e9, nil
}
