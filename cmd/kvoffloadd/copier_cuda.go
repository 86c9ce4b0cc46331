//go:build cuda

package main

import (
	"flag"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/dma/cuda"
)

// cudaConfig holds the flags of the CUDA copy engine (docs/cuda.md).
type cudaConfig struct {
	arenaDevice  string
	readyTimeout time.Duration
	noBatch      bool
	noNUMA       bool
	faultAfter   int
}

func (c *cudaConfig) addFlags(fs *flag.FlagSet) {
	c.readyTimeout = 30 * time.Second
	fs.StringVar(&c.arenaDevice, "cuda-arena-device", "", "GPU whose context pins the arena at start, by ordinal or UUID (GPU-…). Empty: the only GPU if one is visible, else the first GPU a client registers memory on, so no context is made on a GPU nobody uses.")
	fs.DurationVar(&c.readyTimeout, "cuda-ready-timeout", c.readyTimeout, "how long a Store or Load waits for the engine's ready event before its job fails with DMA_ERROR (an engine that died or faulted never completes it).")
	fs.BoolVar(&c.noBatch, "cuda-no-batch-copies", false, "issue scattered copies one driver call each even where the driver has cuMemcpyBatchAsync (CUDA 12.8+).")
	fs.BoolVar(&c.noNUMA, "cuda-no-numa", false, "leave the arena's pages where they are instead of moving them to the pinning GPU's NUMA node.")
	fs.IntVar(&c.faultAfter, "cuda-fault-after-batches", 0, "TESTING ONLY: after this many copy batches, make the GPU fault on purpose (a trapping kernel) so that the context is lost; the daemon then stops serving and exits. 0: never.")
}

func (c *cudaConfig) validate() error {
	switch {
	case c.readyTimeout <= 0:
		return fmt.Errorf("--cuda-ready-timeout %s: want a positive duration", c.readyTimeout)
	case c.faultAfter < 0:
		return fmt.Errorf("--cuda-fault-after-batches %d: want 0 (off) or more", c.faultAfter)
	}
	return nil
}

// newCopier returns the CUDA copy engine: regions are CUDA IPC handles and
// the arena is registered with the driver as pinned memory.
func newCopier(cfg *config, log *slog.Logger, reg prometheus.Registerer) (dma.Engine, error) {
	errs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvoffload_cuda_errors_total", Help: "CUDA driver calls that failed a copy batch, by call and driver error name.",
	}, []string{"call", "error"})
	reg.MustRegister(errs)
	c := cfg.cuda
	e, err := cuda.New(cuda.Config{
		Logger:            log,
		ArenaDevice:       c.arenaDevice,
		ReadyTimeout:      c.readyTimeout,
		NoBatchCopies:     c.noBatch,
		NoNUMA:            c.noNUMA,
		FaultAfterBatches: c.faultAfter,
		OnError:           func(call, name string) { errs.WithLabelValues(call, name).Inc() },
	})
	if err != nil {
		return nil, err
	}
	stat := func(name, help string, f func(cuda.Stats) uint64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(f(e.Stats())) }))
	}
	stat("kvoffload_cuda_ready_waits_total", "Copy batches whose ready event had not completed when they arrived.", func(s cuda.Stats) uint64 { return s.ReadyWaits })
	stat("kvoffload_cuda_ready_timeouts_total", "Copy batches failed because the engine's ready event never completed.", func(s cuda.Stats) uint64 { return s.ReadyTimeouts })
	stat("kvoffload_cuda_ready_abandoned_total", "Copy batches failed because their connection closed before the engine's ready event completed (the engine may have died mid-forward).", func(s cuda.Stats) uint64 { return s.ReadyAbandoned })
	stat("kvoffload_cuda_driver_copies_total", "Driver copy calls (a batched call counts once).", func(s cuda.Stats) uint64 { return s.DriverCopies })
	stat("kvoffload_cuda_batched_copies_total", "Copies issued through cuMemcpyBatchAsync.", func(s cuda.Stats) uint64 { return s.BatchedCopies })
	return e, nil
}
