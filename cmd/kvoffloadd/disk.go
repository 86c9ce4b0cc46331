package main

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// diskConfig turns the disk flags into the disk tier's configuration: it
// probes O_DIRECT in every directory and installs the fault plan, loudly.
// nil when there is no --disk-dir.
//
// The fault plan is paused while the daemon recovers its files; the
// returned start turns it on (faultsAfterRecovery calls it once recovery
// is over: the plan is for runtime faults, not for losing the cache at
// start).
func diskConfig(cfg *config, log *slog.Logger, reg prometheus.Registerer) (dc *disk.Config, start func(), err error) {
	start = func() {}
	if len(cfg.diskDirs) == 0 {
		return nil, start, nil
	}
	direct := true
	for _, d := range cfg.diskDirs {
		err := vfs.ProbeDirect(d)
		switch {
		case err == nil:
		case errors.Is(err, vfs.ErrDirectUnsupported) && cfg.diskDirect == "fallback":
			log.Warn("the filesystem of a --disk-dir refuses O_DIRECT; the disk tier goes through the page cache (--disk-direct=fallback)", "dir", d, "err", err)
			direct = false
		case errors.Is(err, vfs.ErrDirectUnsupported):
			return nil, start, fmt.Errorf("--disk-dir %s: %w (use a filesystem that takes O_DIRECT, or --disk-direct=fallback)", d, err)
		default:
			return nil, start, fmt.Errorf("--disk-dir %s: %w", d, err)
		}
	}
	dc = &disk.Config{
		Dirs:        cfg.diskDirs,
		BytesPerDir: cfg.diskBytes,
		ChunkBytes:  cfg.diskChunkBytes,
		Direct:      direct,
		Reset:       cfg.diskReset,
		QueueDepth:  cfg.diskQueueDepth,
	}
	if cfg.faultSpec != "" {
		injected := prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_faults_injected_total", Help: "Disk faults injected by --fault-spec, by kind.",
		}, []string{"kind"})
		reg.MustRegister(injected)
		fs, err := errorfs.New(vfs.Default, errorfs.Options{
			Plan:     cfg.faultPlan,
			Match:    func(path string) bool { return strings.HasSuffix(path, ".slots") },
			OnInject: func(ev errorfs.Event) { injected.WithLabelValues(ev.Kind.String()).Inc() },
		})
		if err != nil {
			return nil, start, fmt.Errorf("--fault-spec: %w", err)
		}
		fs.Pause()
		dc.FS = fs
		start = func() {
			fs.Resume()
			log.Warn("FAULT INJECTION ENABLED: the disk tier's slot files now fail on purpose; never run this in production",
				"plan", cfg.faultPlan.String())
		}
	}
	if cfg.diskReset {
		log.Warn("--disk-reset: the disk tier starts empty; what its files held is discarded")
	}
	if testHookDiskFS != nil {
		fs := dc.FS
		if fs == nil {
			fs = vfs.Default
		}
		dc.FS = testHookDiskFS(fs)
	}
	return dc, start, nil
}

// testHookDiskFS, set only by this package's tests, wraps the disk tier's
// filesystem (to hold recovery in the middle and kill the process there).
var testHookDiskFS func(vfs.FS) vfs.FS

// testHookCPURecovery, set only by this package's tests, runs before the
// CPU tier's recovery files each chunk (offload.Config.CPURecoveryHook).
var testHookCPURecovery func()

// faultsAfterRecovery calls start once recovered is closed (the disk
// tier's recovery ran in the background while the daemon served), unless
// stop comes first. The returned func stops waiting and waits for the
// goroutine; call it at shutdown.
func faultsAfterRecovery(recovered <-chan struct{}, start func()) (stop func()) {
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-recovered:
			select {
			case <-quit:
			default:
				start()
			}
		case <-quit:
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() { close(quit) })
		<-done
	}
}
