//go:build !cuda

package main

import (
	"flag"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/dma/host"
)

// newCopier returns the copy engine this build has: regions are /dev/shm
// files; a CUDA region is refused with dma.ErrNoCUDA.
func newCopier(cfg *config, log *slog.Logger, _ prometheus.Registerer) (dma.Engine, error) {
	return host.New(host.Config{ShmDir: cfg.shmDir, Workers: cfg.ioWorkers, MaxMappedBytes: cfg.maxMappedBytes, Logger: log}), nil
}

// cudaConfig holds the CUDA build's flags; this build has none.
type cudaConfig struct{}

func (*cudaConfig) addFlags(*flag.FlagSet) {}

func (*cudaConfig) validate() error { return nil }
