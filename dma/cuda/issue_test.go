package cuda

import (
	"bytes"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// TestEngineReadyEventNeverCompletes: an engine that dies or faults never
// completes the event its store waits for. Only that batch may suffer: the
// batches behind it on the same device and streams complete, and the
// waiting one fails after ReadyTimeout, its copies never issued. (With the
// event waited for on the stream, cuStreamWaitEvent, every later copy on the
// stream would hang, and Close with them.)
func TestEngineReadyEventNeverCompletes(t *testing.T) {
	const timeout = 300 * time.Millisecond
	h := newHarness(t, Config{StreamsPerDirection: 1, ReadyTimeout: timeout})
	dead := h.drv.exportEvent() // never signalled
	stale := bytes.Clone(h.slot(0))
	start := time.Now()
	stuck := h.submit(true, h.copies([]uint64{0}, []uint64{0}), dead)
	// Behind it, on the one store stream, and a load: both complete.
	for i, toArena := range []bool{true, false} {
		if err := wait(t, h.submit(toArena, h.copies([]uint64{uint64(3 + i)}, []uint64{uint64(3 + i)}), nil)); err != nil {
			t.Fatalf("a batch behind the stuck one: %v", err)
		}
	}
	notDone(t, stuck)
	err := wait(t, stuck)
	if !errors.Is(err, dma.ErrCopy) || !strings.Contains(err.Error(), "did not complete within 300ms") {
		t.Fatalf("err = %v, want a copy failure naming the ready timeout", err)
	}
	if took := time.Since(start); took < timeout {
		t.Errorf("failed after %v, before the %v timeout", took, timeout)
	}
	if !bytes.Equal(h.slot(0), stale) {
		t.Error("the stuck store copied into its slot")
	}
	h.drv.locked(func() {
		if h.drv.openedEvs != 1 || h.drv.destroyed != h.drv.recorded+1 {
			t.Errorf("%d IPC events opened, %d events destroyed, %d recorded: the opened event must be destroyed once", h.drv.openedEvs, h.drv.destroyed, h.drv.recorded)
		}
	})
	if s := h.e.Stats(); s.ReadyTimeouts != 1 || s.FailedBatches != 1 || s.DriverErrors != 0 {
		t.Errorf("stats %+v, want one ready timeout, counted failed, not as a driver error", s)
	}
	if h.e.Err() != nil {
		t.Errorf("a dead engine's event failed the copy engine: %v", h.e.Err())
	}
}

// TestEngineCloseWithGatedBatch: Close waits for a gated batch, which ends
// (failed) at its ready timeout at the latest.
func TestEngineCloseWithGatedBatch(t *testing.T) {
	h := newHarness(t, Config{ReadyTimeout: 200 * time.Millisecond})
	done := h.submit(true, h.copies([]uint64{1}, []uint64{1}), h.drv.exportEvent())
	h.polled(2)
	if err := h.e.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, dma.ErrCopy) {
			t.Fatalf("err = %v", err)
		}
	default:
		t.Fatal("Close returned before the gated batch's Done")
	}
}

// TestEngineAbandonedBatchIsNotIssued: a store waiting on its ready event
// whose requester's connection closed meanwhile is failed when the event
// completes, its copies never issued (a dead engine's event may read as
// complete over blocks its forward never finished); a batch whose requester
// is still there is issued as usual.
func TestEngineAbandonedBatchIsNotIssued(t *testing.T) {
	h := newHarness(t, Config{})
	var gone atomic.Bool
	submit := func(ev []byte, slot uint64) chan error {
		done := make(chan error, 1)
		h.e.Submit(&dma.Batch{ToArena: true, Copies: h.copies([]uint64{slot}, []uint64{slot}), ReadyEvent: ev,
			Abandoned: gone.Load, Done: func(err error) { done <- err }})
		return done
	}
	stale := bytes.Clone(h.slot(2))
	ev := h.drv.exportEvent()
	done := submit(ev, 2)
	h.polled(2)
	gone.Store(true) // the engine's connection closed
	h.drv.signal(ev) // and its event reads as complete
	err := wait(t, done)
	if !errors.Is(err, dma.ErrCopy) || !strings.Contains(err.Error(), "connection closed") {
		t.Fatalf("err = %v, want the batch failed for its requester gone", err)
	}
	if !bytes.Equal(h.slot(2), stale) {
		t.Fatal("the abandoned store copied into its slot")
	}
	if s := h.e.Stats(); s.ReadyAbandoned != 1 || s.FailedBatches != 1 {
		t.Errorf("stats %+v, want one abandoned batch, counted failed", s)
	}
	gone.Store(false)
	ev = h.drv.exportEvent()
	h.drv.signal(ev)
	if err := wait(t, submit(ev, 3)); err != nil {
		t.Fatalf("a batch whose requester is there: %v", err)
	}
	if !bytes.Equal(h.slot(3), h.block(3)) {
		t.Fatal("slot 3 does not hold block 3")
	}
}

// TestEngineReadyEventFails: the driver reporting an error for the ready
// event (not a sticky one) fails that batch only.
func TestEngineReadyEventFails(t *testing.T) {
	h := newHarness(t, Config{})
	ev := h.drv.exportEvent()
	h.drv.locked(func() { h.drv.ipcEvs[[IPCHandleBytes]byte(ev)].failed = "CUDA_ERROR_INVALID_HANDLE" })
	err := wait(t, h.submit(true, h.copies([]uint64{1}, []uint64{1}), ev))
	var de *DriverError
	if !errors.Is(err, dma.ErrCopy) || !errors.As(err, &de) || de.Op != "cuEventQuery" {
		t.Fatalf("err = %v, want the query's driver error", err)
	}
	if err := wait(t, h.submit(true, h.copies([]uint64{2}, []uint64{2}), nil)); err != nil {
		t.Fatalf("the next batch: %v", err)
	}
}

// TestEngineReadyEventAlreadyComplete: an event that has completed when the
// batch arrives costs one query, and the batch is not counted as waiting.
func TestEngineReadyEventAlreadyComplete(t *testing.T) {
	h := newHarness(t, Config{})
	ev := h.drv.exportEvent()
	h.drv.signal(ev)
	if err := wait(t, h.submit(true, h.copies([]uint64{1}, []uint64{1}), ev)); err != nil {
		t.Fatal(err)
	}
	if s := h.e.Stats(); s.ReadyWaits != 0 {
		t.Errorf("stats %+v: a completed event counted as a wait", s)
	}
}

// scattered returns blocks and slots in no order, so that no two copies
// coalesce: vLLM's block ids after some churn.
func scattered() (blocks, slots []uint64) {
	blocks = []uint64{17, 3, 29, 8, 22, 11, 0, 26}
	slots = []uint64{5, 30, 12, 1, 19, 7, 24, 14}
	return blocks, slots
}

// TestEngineScatteredBlocksBatched: scattered blocks make one copy per
// segment; where the driver has cuMemcpyBatchAsync they go in one call per
// batch and device, else one call each. The bytes are the same either way.
func TestEngineScatteredBlocksBatched(t *testing.T) {
	for _, tc := range []struct {
		name                   string
		noBatch, noBatchConfig bool
		wantCalls, wantBatched int
		wantBatchedStat        uint64
	}{
		{name: "batched", wantCalls: 0, wantBatched: 2, wantBatchedStat: 2 * 16},
		// Without batches, pairs of copies that happen to fit one pitch
		// become 2D copies; the rest go one by one.
		{name: "driver without cuMemcpyBatchAsync", noBatch: true, wantCalls: -1},
		{name: "batching turned off", noBatchConfig: true, wantCalls: -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, Config{NoBatchCopies: tc.noBatchConfig})
			h.drv.locked(func() { h.drv.noBatch = tc.noBatch })
			blocks, slots := scattered()
			dst := []uint64{1, 31, 9, 14, 27, 4, 19, 6}
			if tc.wantCalls < 0 {
				tc.wantCalls = len(planRuns(nil, h.copies(blocks, slots), 1<<31)) + len(planRuns(nil, h.copies(dst, slots), 1<<31))
			}
			var want [][]byte
			for _, b := range blocks {
				want = append(want, h.block(b))
			}
			if err := wait(t, h.submit(true, h.copies(blocks, slots), nil)); err != nil {
				t.Fatal(err)
			}
			for i, s := range slots {
				if !bytes.Equal(h.slot(s), want[i]) {
					t.Fatalf("slot %d does not hold block %d", s, blocks[i])
				}
			}
			// Load them back into other scattered blocks.
			if err := wait(t, h.submit(false, h.copies(dst, slots), nil)); err != nil {
				t.Fatal(err)
			}
			for i, b := range dst {
				if !bytes.Equal(h.block(b), want[i]) {
					t.Fatalf("block %d does not hold what block %d held", b, blocks[i])
				}
			}
			h.drv.locked(func() {
				if len(h.drv.copyCalls) != tc.wantCalls || len(h.drv.batchCalls) != tc.wantBatched {
					t.Errorf("%d plain copies and %d batched calls, want %d and %d", len(h.drv.copyCalls), len(h.drv.batchCalls), tc.wantCalls, tc.wantBatched)
				}
				for _, c := range h.drv.batchCalls {
					if len(c) != 2*len(blocks) {
						t.Errorf("a batched call of %d copies, want %d (every segment of the batch)", len(c), 2*len(blocks))
					}
				}
			})
			if s := h.e.Stats(); s.BatchedCopies != tc.wantBatchedStat || s.DriverCopies != uint64(tc.wantCalls+tc.wantBatched) {
				t.Errorf("stats %+v, want %d batched copies in %d driver calls", s, tc.wantBatchedStat, tc.wantCalls+tc.wantBatched)
			}
		})
	}
}

// TestEngineBatchedCallsAreBounded: a batch of more one-row copies than
// batchMax goes in several calls.
func TestEngineBatchedCallsAreBounded(t *testing.T) {
	const n = batchMax + 10
	const seg = 8
	drv := newFakeDriver(1)
	e, err := newEngine(drv, Config{Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	arena := make([]byte, 2*n*seg)
	if err := e.SetArena(arena); err != nil {
		t.Fatal(err)
	}
	hd, dev := drv.export(0, 0, 2*n*seg)
	for i := range dev {
		dev[i] = byte(i * 31)
	}
	r, err := e.Open(dma.RegionSpec{CUDA: &dma.IPCMemory{Handle: hd, AllocSize: uint64(len(dev))}, BlockStride: seg, NumBlocks: 2 * n, SegmentBytes: seg}, dma.Peer{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	// Every other block into every other slot, backwards: nothing coalesces.
	var cs []dma.Copy
	for i := range n {
		cs = append(cs, dma.Copy{Region: r, RegionOff: uint64(2*i) * seg, ArenaOff: uint64(2*(n-1-i)) * seg, Len: seg})
	}
	done := make(chan error, 1)
	e.Submit(&dma.Batch{ToArena: true, Copies: cs, Done: func(err error) { done <- err }})
	if err := wait(t, done); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if !bytes.Equal(arena[2*(n-1-i)*seg:][:seg], dev[2*i*seg:][:seg]) {
			t.Fatalf("copy %d wrong", i)
		}
	}
	drv.locked(func() {
		if len(drv.batchCalls) != 2 || len(drv.batchCalls[0]) != batchMax || len(drv.batchCalls[1]) != 10 {
			t.Errorf("batched calls of %d copies, want %d then 10", callSizes(drv.batchCalls), batchMax)
		}
	})
}

func callSizes(calls [][]span) []int {
	var n []int
	for _, c := range calls {
		n = append(n, len(c))
	}
	return n
}

// TestEngineBatchedCopyFails: a failed batched call fails the batch after
// the copies queued before it drained.
func TestEngineBatchedCopyFails(t *testing.T) {
	h := newHarness(t, Config{})
	h.drv.locked(func() { h.drv.failCopyAt = 1 })
	blocks, slots := scattered()
	err := wait(t, h.submit(true, h.copies(blocks, slots), nil))
	var de *DriverError
	if !errors.As(err, &de) || de.Op != "cuMemcpyBatchAsync" {
		t.Fatalf("err = %v, want the batched call's error", err)
	}
}
