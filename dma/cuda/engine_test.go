package cuda

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// These tests run the engine over fakeDriver: what they check is the
// engine's contract (Done only after the completion event, stores wait for
// the ready event, errors named and counted, nothing leaks), not CUDA.
// scripts/gpu-check.sh checks the real driver on a GPU.

const (
	segBytes = 256
	nBlocks  = 32
	slotSize = 2 * segBytes // K and V of a block, packed
)

type harness struct {
	t      *testing.T
	drv    *fakeDriver
	e      *Engine
	arena  []byte
	dev    []byte // the exported allocation: K region then V region
	handle []byte
	k, v   dma.Region

	mu     sync.Mutex
	onErrs []string
}

func newHarness(t *testing.T, cfg Config) *harness {
	t.Helper()
	h := &harness{t: t, drv: newFakeDriver(2)}
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg.OnError = func(op, name string) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.onErrs = append(h.onErrs, op+" "+name)
	}
	e, err := newEngine(h.drv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.e = e
	t.Cleanup(func() {
		h.drv.releaseAll() // a failed test must not leave Close waiting
		if err := e.Close(); err != nil && e.Err() == nil {
			t.Errorf("Close: %v", err)
		}
		goleak.VerifyNone(t)
	})
	h.arena = make([]byte, nBlocks*slotSize)
	if err := e.SetArena(h.arena); err != nil {
		t.Fatal(err)
	}
	// One allocation holding two tensors, as PyTorch exports them; V sits
	// at an offset inside it.
	h.handle, h.dev = h.drv.export(1, 0, 1024+2*nBlocks*segBytes)
	for i := range h.dev {
		h.dev[i] = byte(i*7 + i/251)
	}
	h.k = h.open(1024)
	h.v = h.open(1024 + nBlocks*segBytes)
	return h
}

func (h *harness) spec(offset uint64) dma.RegionSpec {
	return dma.RegionSpec{
		CUDA:   &dma.IPCMemory{Handle: h.handle, Device: 1, AllocSize: uint64(len(h.dev))},
		Offset: offset, BlockStride: segBytes, NumBlocks: nBlocks, SegmentBytes: segBytes,
	}
}

func (h *harness) open(offset uint64) dma.Region {
	h.t.Helper()
	r, err := h.e.Open(h.spec(offset), dma.Peer{PID: 42})
	if err != nil {
		h.t.Fatal(err)
	}
	return r
}

// copies moves engine blocks to or from slots, block-major as the layout
// package lists them.
func (h *harness) copies(blocks, slots []uint64) []dma.Copy {
	var cs []dma.Copy
	for i, b := range blocks {
		cs = append(cs,
			dma.Copy{Region: h.k, RegionOff: 1024 + b*segBytes, ArenaOff: slots[i] * slotSize, Len: segBytes},
			dma.Copy{Region: h.v, RegionOff: 1024 + nBlocks*segBytes + b*segBytes, ArenaOff: slots[i]*slotSize + segBytes, Len: segBytes},
		)
	}
	return cs
}

func (h *harness) submit(toArena bool, cs []dma.Copy, ready []byte) chan error {
	done := make(chan error, 1)
	h.e.Submit(&dma.Batch{ToArena: toArena, Copies: cs, ReadyEvent: ready, Done: func(err error) { done <- err }})
	return done
}

func wait(t *testing.T, done chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("the batch never finished")
		return nil
	}
}

// polled returns once the engine has queried completion events n more
// times: it has been looking, and found them not complete.
func (h *harness) polled(n int) {
	h.t.Helper()
	for range n {
		select {
		case <-h.drv.queried:
		case <-time.After(10 * time.Second):
			h.t.Fatal("the engine stopped polling")
		}
	}
}

func notDone(t *testing.T, done chan error) {
	t.Helper()
	select {
	case err := <-done:
		t.Fatalf("Done(%v) came before the batch's copies drained", err)
	default:
	}
}

func seq(from, n uint64) []uint64 {
	s := make([]uint64, n)
	for i := range s {
		s[i] = from + uint64(i)
	}
	return s
}

// block returns engine block b's K and V bytes.
func (h *harness) block(b uint64) []byte {
	k := h.dev[1024+b*segBytes:][:segBytes]
	v := h.dev[1024+nBlocks*segBytes+b*segBytes:][:segBytes]
	return append(bytes.Clone(k), v...)
}

func (h *harness) slot(s uint64) []byte { return h.arena[s*slotSize:][:slotSize] }

func TestEngineStoreThenLoad(t *testing.T) {
	h := newHarness(t, Config{})
	var want [][]byte
	for b := uint64(0); b < 8; b++ {
		want = append(want, h.block(b))
	}
	if err := wait(t, h.submit(true, h.copies(seq(0, 8), seq(4, 8)), nil)); err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if !bytes.Equal(h.slot(4+uint64(i)), want[i]) {
			t.Fatalf("slot %d does not hold block %d", 4+i, i)
		}
	}
	if err := wait(t, h.submit(false, h.copies(seq(16, 8), seq(4, 8)), nil)); err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if got := h.block(16 + uint64(i)); !bytes.Equal(got, want[i]) {
			t.Fatalf("block %d after the load differs from block %d", 16+i, i)
		}
	}
	h.drv.locked(func() {
		// 8 blocks x (K, V) per batch: one strided copy per region each.
		if len(h.drv.copyCalls) != 4 {
			t.Errorf("%d driver copies, want 4 (one 2D copy per region and batch): %v", len(h.drv.copyCalls), h.drv.copyCalls)
		}
		for _, r := range h.drv.copyCalls {
			if r.Rows != 8 || r.RegionPitch != segBytes || r.ArenaPitch != slotSize {
				t.Errorf("copy %+v, want 8 rows, pitches %d/%d", r, segBytes, slotSize)
			}
		}
		if h.drv.opens != 1 {
			t.Errorf("the allocation was opened %d times, want once for both regions", h.drv.opens)
		}
		if h.drv.recorded != 2 || h.drv.destroyed != 2 {
			t.Errorf("%d events recorded, %d destroyed, want 2 and 2", h.drv.recorded, h.drv.destroyed)
		}
		// Completion is a blocking wait per event, in the kernel: no
		// polling, no timer.
		if h.drv.waits != 2 || h.drv.polls != 0 {
			t.Errorf("%d waits and %d polls of completion events, want 2 waits and no poll", h.drv.waits, h.drv.polls)
		}
	})
	want2 := Stats{Batches: 2, Copies: 32, DriverCopies: 4, BytesToArena: 8 * slotSize, BytesToDevice: 8 * slotSize}
	if s := h.e.Stats(); s != want2 {
		t.Errorf("stats %+v, want %+v", s, want2)
	}
	if d := h.e.QueueDepth(); d != 0 {
		t.Errorf("queue depth %d after every batch finished", d)
	}
}

func TestEngineDoneWaitsForCompletionEvent(t *testing.T) {
	h := newHarness(t, Config{})
	h.drv.setHold(true) // the GPU is busy: copies queued, not run
	want := h.block(3)
	done := h.submit(true, h.copies([]uint64{3}, []uint64{0}), nil)
	h.polled(1)
	notDone(t, done)
	if !bytes.Equal(h.slot(0), make([]byte, slotSize)) {
		t.Fatal("the slot changed while the copies were held")
	}
	h.drv.setHold(false)
	if err := wait(t, done); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(h.slot(0), want) {
		t.Fatal("slot 0 does not hold block 3")
	}
}

func TestEngineStoreWaitsForReadyEvent(t *testing.T) {
	h := newHarness(t, Config{})
	ready := h.drv.exportEvent()
	want := h.block(5)
	done := h.submit(true, h.copies([]uint64{5}, []uint64{1}), ready)
	h.polled(3)
	notDone(t, done)
	if !bytes.Equal(h.slot(1), make([]byte, slotSize)) {
		t.Fatal("the store copied before the engine's ready event")
	}
	h.drv.signal(ready) // the engine's kernels that wrote block 5 are done
	if err := wait(t, done); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(h.slot(1), want) {
		t.Fatal("slot 1 does not hold block 5")
	}
}

// TestEngineLoadWaitsForReadyEvent: a load must not overwrite engine blocks
// before the engine's kernels that still read them (a request preempted
// while its forward runs) have finished.
func TestEngineLoadWaitsForReadyEvent(t *testing.T) {
	h := newHarness(t, Config{})
	for i := range h.arena {
		h.arena[i] = byte(i*13 + 5)
	}
	ready := h.drv.exportEvent()
	before := h.block(7)
	done := h.submit(false, h.copies([]uint64{7}, []uint64{2}), ready)
	h.polled(3)
	notDone(t, done)
	if !bytes.Equal(h.block(7), before) {
		t.Fatal("the load wrote block 7 before the engine's ready event")
	}
	h.drv.signal(ready)
	if err := wait(t, done); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(h.block(7), h.slot(2)) {
		t.Fatal("block 7 does not hold slot 2 after the load")
	}
	if s := h.e.Stats(); s.ReadyWaits != 1 || s.ReadyTimeouts != 0 {
		t.Errorf("stats %+v, want one ready wait and no timeout", s)
	}
}

func TestEngineDriverErrors(t *testing.T) {
	tests := []struct {
		name   string
		inject func(*fakeDriver)
		ready  bool
		want   string // the DriverError
		syncs  int    // streams synchronized to make sure the copies stopped
	}{
		{
			name:   "second copy call fails: the first drains before Done",
			inject: func(d *fakeDriver) { d.failCopyAt, d.noBatch = 2, true },
			want:   "cuMemcpy2DAsync CUDA_ERROR_INVALID_VALUE",
		},
		{
			name:   "the completion wait fails: the stream is synchronized before Done",
			inject: func(d *fakeDriver) { d.faultWait, d.faultCode = "CUDA_ERROR_INVALID_HANDLE", 400 },
			want:   "cuEventSynchronize CUDA_ERROR_INVALID_HANDLE",
			syncs:  1,
		},
		{
			name:   "no completion event: the engine waits for the stream",
			inject: func(d *fakeDriver) { d.failRecord = true },
			want:   "cuEventRecord CUDA_ERROR_INVALID_HANDLE",
			syncs:  1,
		},
		{
			name:  "ready event unknown to the driver",
			ready: true,
			want:  "cuIpcOpenEventHandle CUDA_ERROR_INVALID_VALUE",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, Config{})
			if tt.inject != nil {
				h.drv.locked(func() { tt.inject(h.drv) })
			}
			var ready []byte
			if tt.ready {
				ready = bytes.Repeat([]byte{9}, IPCHandleBytes)
			}
			err := wait(t, h.submit(true, h.copies(seq(0, 4), seq(0, 4)), ready))
			if !errors.Is(err, dma.ErrCopy) {
				t.Fatalf("err = %v, want one wrapping dma.ErrCopy", err)
			}
			var de *DriverError
			if !errors.As(err, &de) || de.Op+" "+de.Name != tt.want {
				t.Fatalf("err = %v, want a DriverError %q", err, tt.want)
			}
			if name := strings.Fields(tt.want)[1]; !strings.Contains(err.Error(), name) {
				t.Errorf("error %q does not name %s", err, name)
			}
			h.mu.Lock()
			if len(h.onErrs) != 1 || h.onErrs[0] != tt.want {
				t.Errorf("OnError calls %q, want [%q]", h.onErrs, tt.want)
			}
			h.mu.Unlock()
			if s := h.e.Stats(); s.FailedBatches != 1 || s.DriverErrors != 1 || s.BytesToArena != 0 {
				t.Errorf("stats %+v, want one failed batch counted as a driver error", s)
			}
			h.drv.locked(func() {
				for _, g := range h.drv.gpus {
					for i, s := range g.streams {
						if len(s) != 0 && tt.inject != nil {
							t.Errorf("stream %d still has %d operations queued when Done came", i, len(s))
						}
					}
				}
				if h.drv.syncs != tt.syncs {
					t.Errorf("%d stream synchronizations, want %d", h.drv.syncs, tt.syncs)
				}
			})
			if err := h.e.Err(); err != nil {
				t.Errorf("a non-sticky error failed the engine: %v", err)
			}
		})
	}
}

// TestEngineFailedCopyHeldUntilDrained holds the copies that did go in
// before a failed call, and checks that the failure waits for them.
func TestEngineFailedCopyHeldUntilDrained(t *testing.T) {
	h := newHarness(t, Config{})
	h.drv.locked(func() { h.drv.hold, h.drv.failCopyAt, h.drv.noBatch = true, 2, true })
	done := h.submit(true, h.copies(seq(0, 4), seq(0, 4)), nil)
	h.polled(1)
	notDone(t, done)
	h.drv.setHold(false)
	if err := wait(t, done); !errors.Is(err, dma.ErrCopy) {
		t.Fatalf("err = %v, want a copy failure", err)
	}
}

func TestEngineRefusesBadBatches(t *testing.T) {
	tests := []struct {
		name    string
		batch   func(h *harness) *dma.Batch
		wantErr string
	}{
		{
			name: "region offset past the allocation",
			batch: func(h *harness) *dma.Batch {
				return &dma.Batch{ToArena: true, Copies: []dma.Copy{{Region: h.k, RegionOff: uint64(len(h.dev)) - 10, Len: 11}}}
			},
			wantErr: "overruns the region",
		},
		{
			name: "arena offset past the arena",
			batch: func(h *harness) *dma.Batch {
				return &dma.Batch{Copies: []dma.Copy{{Region: h.k, ArenaOff: uint64(len(h.arena)), Len: 1}}}
			},
			wantErr: "overruns the arena",
		},
		{
			name: "a region of another engine",
			batch: func(h *harness) *dma.Batch {
				return &dma.Batch{Copies: []dma.Copy{{Region: &fakeRegion{size: 1 << 20}, Len: 1}}}
			},
			wantErr: "not opened by this copy engine",
		},
		{
			name: "a closed region",
			batch: func(h *harness) *dma.Batch {
				r := h.open(0)
				if err := r.Close(); err != nil {
					h.t.Fatal(err)
				}
				return &dma.Batch{Copies: []dma.Copy{{Region: r, Len: 1}}}
			},
			wantErr: "region is closed",
		},
		{
			name: "a ready event of the wrong size",
			batch: func(h *harness) *dma.Batch {
				return &dma.Batch{ToArena: true, ReadyEvent: []byte{1, 2, 3}, Copies: h.copies([]uint64{0}, []uint64{0})}
			},
			wantErr: "ready event handle is 3 bytes",
		},
		{
			name: "a load's ready event of the wrong size",
			batch: func(h *harness) *dma.Batch {
				return &dma.Batch{ReadyEvent: make([]byte, IPCHandleBytes), Copies: h.copies([]uint64{0}, []uint64{0})}
			},
			wantErr: "ready event handle is all zeros",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, Config{})
			b := tt.batch(h)
			done := make(chan error, 1)
			b.Done = func(err error) { done <- err }
			h.e.Submit(b)
			err := wait(t, done)
			if !errors.Is(err, dma.ErrCopy) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want dma.ErrCopy and %q", err, tt.wantErr)
			}
			var de *DriverError
			if errors.As(err, &de) {
				t.Errorf("a refused batch blamed the driver: %v", err)
			}
			h.drv.locked(func() {
				if len(h.drv.copyCalls) != 0 {
					t.Errorf("a refused batch made %d driver copies", len(h.drv.copyCalls))
				}
			})
		})
	}
}

func TestEngineNoArena(t *testing.T) {
	drv := newFakeDriver(1)
	e, err := newEngine(drv, Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer goleak.VerifyNone(t)
	defer e.Close()
	h, _ := drv.export(0, 1, 4096)
	r, err := e.Open(dma.RegionSpec{CUDA: &dma.IPCMemory{Handle: h, AllocSize: 4096}, BlockStride: 4096, NumBlocks: 1, SegmentBytes: 4096}, dma.Peer{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	e.Submit(&dma.Batch{Copies: []dma.Copy{{Region: r, Len: 1}}, Done: func(err error) { done <- err }})
	if err := wait(t, done); !errors.Is(err, dma.ErrCopy) || !strings.Contains(err.Error(), "SetArena") {
		t.Fatalf("err = %v, want a copy failure naming SetArena", err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestEngineOpen(t *testing.T) {
	h := newHarness(t, Config{})
	unknown := bytes.Repeat([]byte{0x77}, IPCHandleBytes)
	tests := []struct {
		name       string
		spec       func() dma.RegionSpec
		wantErr    string
		wantDriver string
	}{
		{
			name: "malformed handle",
			spec: func() dma.RegionSpec {
				s := h.spec(0)
				s.CUDA = &dma.IPCMemory{Handle: []byte{1}, Device: 1, AllocSize: 1 << 20}
				return s
			},
			wantErr: "handle is 1 bytes",
		},
		{
			name: "handle the driver does not know",
			spec: func() dma.RegionSpec {
				s := h.spec(0)
				s.CUDA = &dma.IPCMemory{Handle: unknown, Device: 1, AllocSize: s.CUDA.AllocSize}
				return s
			},
			wantErr:    "open the CUDA IPC memory handle of pid 42 on device 1",
			wantDriver: "CUDA_ERROR_INVALID_HANDLE",
		},
		{
			name: "alloc_size larger than the exported allocation",
			spec: func() dma.RegionSpec {
				s := h.spec(0)
				s.CUDA = &dma.IPCMemory{Handle: s.CUDA.Handle, Device: 1, AllocSize: s.CUDA.AllocSize + 1}
				return s
			},
			wantErr: "but the exported allocation is",
		},
		{
			name: "device this process does not see",
			spec: func() dma.RegionSpec {
				s := h.spec(0)
				s.CUDA = &dma.IPCMemory{Handle: h.handle, Device: 2, AllocSize: 1 << 20}
				return s
			},
			wantErr: "device 2: this process sees 2 CUDA devices",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := h.e.Open(tt.spec(), dma.Peer{PID: 42})
			if err == nil {
				r.Close()
				t.Fatal("accepted")
			}
			if !errors.Is(err, dma.ErrBadRegion) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want dma.ErrBadRegion and %q", err, tt.wantErr)
			}
			var de *DriverError
			if got := errors.As(err, &de); got != (tt.wantDriver != "") || (got && de.Name != tt.wantDriver) {
				t.Fatalf("err = %v, want driver error %q", err, tt.wantDriver)
			}
		})
	}
	h.drv.locked(func() {
		if h.drv.opens != 1 || h.drv.closes != 0 {
			t.Errorf("opens %d closes %d: refused regions must leave the shared mapping alone", h.drv.opens, h.drv.closes)
		}
	})
}

func TestEngineMappingRefcount(t *testing.T) {
	h := newHarness(t, Config{})
	third := h.open(0)
	closes := func() (n int) {
		h.drv.locked(func() { n = h.drv.closes })
		return n
	}
	for i, r := range []dma.Region{h.k, third, h.k} { // the second Close of k does nothing
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
		if n := closes(); n != 0 {
			t.Fatalf("after %d closes the allocation was unmapped with a region still open", i+1)
		}
	}
	if err := h.v.Close(); err != nil {
		t.Fatal(err)
	}
	if n := closes(); n != 1 {
		t.Fatalf("the last region's Close unmapped the allocation %d times, want once", n)
	}
	// Opened again, it is mapped anew.
	h.k = h.open(0)
	h.drv.locked(func() {
		if h.drv.opens != 2 {
			t.Errorf("opens = %d, want 2", h.drv.opens)
		}
	})
}

func TestEngineClose(t *testing.T) {
	h := newHarness(t, Config{QueueDepth: 2, StreamsPerDirection: 3})
	h.drv.setHold(true)
	var dones []chan error
	for i := range 6 {
		dones = append(dones, h.submit(i%2 == 0, h.copies([]uint64{uint64(i)}, []uint64{uint64(i)}), nil))
	}
	closed := make(chan error, 1)
	go func() { closed <- h.e.Close() }()
	h.polled(1)
	select {
	case <-closed:
		t.Fatal("Close returned with batches in flight")
	default:
	}
	h.drv.setHold(false)
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	for i, d := range dones {
		select {
		case err := <-d:
			if err != nil {
				t.Errorf("batch %d: %v", i, err)
			}
		default:
			t.Errorf("batch %d not done when Close returned", i)
		}
	}
	h.drv.locked(func() {
		if h.drv.closes != 1 || h.drv.registered != nil {
			t.Errorf("after Close: %d unmaps (want 1, regions left open), arena registered %v", h.drv.closes, h.drv.registered != nil)
		}
		for ord, g := range h.drv.gpus {
			if !g.released {
				t.Errorf("device %d not released", ord)
			}
		}
	})
	if err := h.e.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	// Submit after Close is a caller's bug; it must still get its Done.
	if err := wait(t, h.submit(true, nil, nil)); !errors.Is(err, dma.ErrCopy) {
		t.Errorf("Submit after Close: %v", err)
	}
	if _, err := h.e.Open(h.spec(0), dma.Peer{}); !errors.Is(err, dma.ErrBadRegion) {
		t.Errorf("Open after Close: %v", err)
	}
}

func TestEngineEmptyBatch(t *testing.T) {
	h := newHarness(t, Config{})
	if err := wait(t, h.submit(true, nil, nil)); err != nil {
		t.Fatal(err)
	}
}

// TestEngineManyBatches runs concurrent submitters over the streams, each
// batch checking its own bytes, under the race detector in CI.
func TestEngineManyBatches(t *testing.T) {
	h := newHarness(t, Config{QueueDepth: 4})
	var wg sync.WaitGroup
	dones := make([]chan error, nBlocks)
	wants := make([][]byte, nBlocks)
	for b := range uint64(nBlocks) {
		wants[b] = h.block(b)
		wg.Go(func() { dones[b] = h.submit(true, h.copies([]uint64{b}, []uint64{b}), nil) })
	}
	wg.Wait()
	for b, done := range dones {
		if err := wait(t, done); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(h.slot(uint64(b)), wants[b]) {
			t.Errorf("slot %d differs from its block", b)
		}
	}
	if s := h.e.Stats(); s.Batches != nBlocks || s.BytesToArena != nBlocks*slotSize {
		t.Errorf("stats %+v", s)
	}
}

// TestEngineSubmitFromDone chains batches, each submitted by the previous
// one's Done, through a queue of one: Done runs on the engine's poller, which
// must not be what the submitter waits for.
func TestEngineSubmitFromDone(t *testing.T) {
	h := newHarness(t, Config{QueueDepth: 1})
	const chain = 50
	finished := make(chan error, 1)
	var next func(i int) *dma.Batch
	next = func(i int) *dma.Batch {
		b := uint64(i % nBlocks)
		return &dma.Batch{ToArena: true, Copies: h.copies([]uint64{b}, []uint64{b}), Done: func(err error) {
			switch {
			case err != nil || i == chain:
				finished <- err
			default:
				// Two at once, so that the queue is full at times.
				h.e.Submit(next(i + 1))
				if i%2 == 0 {
					h.e.Submit(&dma.Batch{Done: func(error) {}})
				}
			}
		}}
	}
	h.e.Submit(next(1))
	if err := wait(t, finished); err != nil {
		t.Fatal(err)
	}
}
