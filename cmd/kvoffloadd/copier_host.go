//go:build !cuda

package main

import (
	"flag"
	"log/slog"
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/dma/host"
)

// newCopier returns the copy engine this build has: regions are /dev/shm
// files; a CUDA region is refused with dma.ErrNoCUDA.
func newCopier(cfg *config, log *slog.Logger, _ prometheus.Registerer) (dma.Engine, error) {
	if !canActAsClients() {
		// Where the operator looks (the journal): a daemon run as a user
		// of its own, as the systemd unit's default does for the CUDA
		// build, refuses every engine of another user at Register.
		log.Warn("host build without CAP_SETUID and CAP_SETGID: it maps region files only for clients of its own uid and groups; run it as the engine's user (systemd: the deploy/systemd/host-build.conf drop-in, docs/operations.md)",
			"uid", os.Geteuid(), "gid", os.Getegid())
	}
	return host.New(host.Config{ShmDir: cfg.shmDir, Workers: cfg.ioWorkers, Nice: cfg.copyNice, Idle: cfg.copyIdle,
		MaxMappedBytes: cfg.maxMappedBytes, Logger: log}), nil
}

// canActAsClients tells whether the daemon may take a client's filesystem
// credentials to open its region files (setfsuid, setgroups): without
// both capabilities it opens them as itself, for its own uid only.
func canActAsClients() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	const want = 1<<unix.CAP_SETUID | 1<<unix.CAP_SETGID
	return data[0].Effective&want == want
}

// cudaConfig holds the CUDA build's flags; this build has none.
type cudaConfig struct{}

func (*cudaConfig) addFlags(*flag.FlagSet) {}

func (*cudaConfig) validate() error { return nil }
