//go:build cuda

package main

import (
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/dma/cuda"
)

// newCopier returns the CUDA copy engine: regions are CUDA IPC handles and
// the arena is registered with the driver as pinned memory.
func newCopier(cfg *config, log *slog.Logger, reg prometheus.Registerer) (dma.Engine, error) {
	errs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvoffload_cuda_errors_total", Help: "CUDA driver calls that failed a copy batch, by call and driver error name.",
	}, []string{"call", "error"})
	reg.MustRegister(errs)
	return cuda.New(cuda.Config{Logger: log, OnError: func(call, name string) { errs.WithLabelValues(call, name).Inc() }})
}
