package cuda

import (
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func failed(e *Engine) bool {
	select {
	case <-e.Failed():
		return true
	default:
		return false
	}
}

// TestEngineStickyErrorFailsTheEngine: a device fault (here on purpose, the
// trapping kernel of FaultAfterBatches) loses the context. The batch it hit
// fails, Failed is closed for the daemon, and from then on every batch fails
// at once, without a driver call, as does every Open: a batch reported done
// is never one whose copies might still run, and none waits forever.
func TestEngineStickyErrorFailsTheEngine(t *testing.T) {
	h := newHarness(t, Config{FaultAfterBatches: 1, ReadyTimeout: time.Minute})
	if err := wait(t, h.submit(true, h.copies(seq(0, 2), seq(0, 2)), nil)); err != nil {
		t.Fatalf("batch 1: %v", err)
	}
	if failed(h.e) {
		t.Fatal("failed before the fault")
	}
	// A batch waiting for its ready event when the context is lost.
	gated := h.submit(true, h.copies([]uint64{9}, []uint64{9}), h.drv.exportEvent())
	h.polled(2)
	err := wait(t, h.submit(true, h.copies(seq(2, 2), seq(2, 2)), nil))
	var de *DriverError
	if !errors.As(err, &de) || de.Name != "CUDA_ERROR_LAUNCH_FAILED" || !de.Sticky() {
		t.Fatalf("batch 2: err = %v, want the sticky CUDA_ERROR_LAUNCH_FAILED", err)
	}
	select {
	case <-h.e.Failed():
	case <-time.After(10 * time.Second):
		t.Fatal("Failed is not closed after a sticky error")
	}
	if !errors.As(h.e.Err(), &de) || de.Code != 719 {
		t.Errorf("Err() = %v", h.e.Err())
	}
	if err := wait(t, gated); !errors.Is(err, dma.ErrCopy) {
		t.Errorf("the gated batch: %v, want a failure (not a wait of a minute)", err)
	}
	var calls int
	h.drv.locked(func() { calls = len(h.drv.copyCalls) + len(h.drv.batchCalls) })
	for _, toArena := range []bool{true, false} {
		err := wait(t, h.submit(toArena, h.copies(seq(4, 2), seq(4, 2)), nil))
		if !errors.Is(err, dma.ErrCopy) || !strings.Contains(err.Error(), "context is lost") {
			t.Errorf("a batch after the fault: %v", err)
		}
	}
	h.drv.locked(func() {
		if n := len(h.drv.copyCalls) + len(h.drv.batchCalls); n != calls || h.drv.injected != 1 {
			t.Errorf("%d copy calls after the context was lost, %d faults injected", n-calls, h.drv.injected)
		}
	})
	if _, err := h.e.Open(h.spec(0), dma.Peer{}); err == nil || !strings.Contains(err.Error(), "has failed") {
		t.Errorf("Open after the fault: %v", err)
	}
}

// TestEngineStickyErrorWhileWaiting: an ECC error or illegal address shows
// up where the engine waits for a batch: the batch fails at once (nothing
// queued in a lost context runs) and so does the engine.
func TestEngineStickyErrorWhileWaiting(t *testing.T) {
	h := newHarness(t, Config{})
	h.drv.locked(func() { h.drv.faultWait, h.drv.faultCode = "CUDA_ERROR_ECC_UNCORRECTABLE", 214 })
	err := wait(t, h.submit(false, h.copies(seq(0, 2), seq(0, 2)), nil))
	if !errors.Is(err, dma.ErrCopy) || !strings.Contains(err.Error(), "CUDA_ERROR_ECC_UNCORRECTABLE") {
		t.Fatalf("err = %v", err)
	}
	if !failed(h.e) {
		t.Fatal("an uncorrectable ECC error did not fail the engine")
	}
	h.drv.locked(func() {
		if h.drv.syncs != 0 {
			t.Errorf("%d stream synchronizations after a sticky error (the context is gone; nothing to wait for)", h.drv.syncs)
		}
	})
}

// TestEngineStickyErrorWhileIssuing: a copy call that returns a sticky
// error (the context was lost by something else, between two batches) fails
// the engine as well.
func TestEngineStickyErrorWhileIssuing(t *testing.T) {
	h := newHarness(t, Config{})
	h.drv.locked(func() {
		h.drv.noBatch, h.drv.failCopyAt = true, 1
		h.drv.failCopyAs = fakeErr("cuMemcpy2DAsync", "CUDA_ERROR_ILLEGAL_ADDRESS", 700)
	})
	err := wait(t, h.submit(true, h.copies(seq(0, 2), seq(0, 2)), nil))
	if !errors.Is(err, dma.ErrCopy) || !strings.Contains(err.Error(), "CUDA_ERROR_ILLEGAL_ADDRESS") {
		t.Fatalf("err = %v", err)
	}
	if !failed(h.e) {
		t.Fatal("a sticky error from a copy call did not fail the engine")
	}
}

// TestEngineUnsettledBatchIsNeverDone: a completion wait fails, and so does
// the stream synchronization meant to make sure the copies stopped, neither
// with a sticky error. Nothing says the copies stopped: the engine fails
// (the daemon exits) and the batch is never reported done.
func TestEngineUnsettledBatchIsNeverDone(t *testing.T) {
	h := newHarness(t, Config{})
	h.drv.locked(func() {
		h.drv.faultWait, h.drv.faultSync, h.drv.faultCode = "CUDA_ERROR_INVALID_HANDLE", "CUDA_ERROR_UNKNOWN", 999
	})
	done := h.submit(true, h.copies(seq(0, 2), seq(0, 2)), nil)
	select {
	case <-h.e.Failed():
	case <-time.After(10 * time.Second):
		t.Fatal("the engine did not fail")
	}
	if err := h.e.Err(); !errors.Is(err, errUnsettled) {
		t.Errorf("Err() = %v", err)
	}
	if err := h.e.Close(); err == nil {
		t.Error("Close of a failed engine reported no error")
	}
	notDone(t, done)
}

func TestStickyCodes(t *testing.T) {
	for code, want := range map[int]bool{
		700: true, 719: true, 214: true, 710: true, 999: false, 1: false, 400: false, 2: false, 701: false, 600: false,
	} {
		if got := (&DriverError{Code: code}).Sticky(); got != want {
			t.Errorf("code %d: sticky %v, want %v", code, got, want)
		}
	}
}
