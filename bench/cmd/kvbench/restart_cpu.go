package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/zeebo/xxh3"
	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// The restart scenario's CPU tier part (issue 25): the same restart for a
// CPU tier alone whose arena is a file that outlives the daemon
// (--cpu-arena-dir, on /dev/shm). It fills an arena of --restart-bytes to
// 90% of its slots with distinct blocks (each job waited for), kills the
// daemon with SIGKILL, hashes the recorded payloads straight from the
// arena file on one core (xxh3: the least a verifying recovery must do),
// starts the daemon again on the same directory and times the exec to
// SERVING, to the first hit (a Lookup of a sample of the keys, polled,
// offers one) and to the end of the CPU tier's recovery
// (kvoffload_cpu_recovery_state, polled); then every block must be offered
// from the CPU tier and a sample must load byte-exact.

func (b *bench) restartCPU(ctx context.Context) (*report.CPURecovery, error) {
	o := b.o
	shape := o.shape
	B := uint64(shape.BlockBytes())
	total := o.restartBytes
	chunk := slots.DefaultChunkBytes(total)
	n := int(total / chunk * (chunk / layout.AlignUp(B)) * 90 / 100)
	b.prog.phase(fmt.Sprintf("scenario restart: fill a %s persistent CPU arena with %d blocks, kill -9, restart, recover", model.FormatBytes(total), n))
	var fs unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &fs); err != nil || fs.Bavail*uint64(fs.Bsize) < total+total/16+64<<20 {
		return &report.CPURecovery{ArenaBytes: total, Skipped: fmt.Sprintf("/dev/shm has %s free, the arena needs %s", model.FormatBytes(fs.Bavail*uint64(fs.Bsize)), model.FormatBytes(total+total/32))}, nil
	}
	arena, err := os.MkdirTemp("/dev/shm", "kvbench-arena-")
	if err != nil {
		return nil, fmt.Errorf("a directory on /dev/shm for --cpu-arena-dir: %w", err)
	}
	defer os.RemoveAll(arena)
	dir, err := os.MkdirTemp(b.tmp, "restart-cpu-")
	if err != nil {
		return nil, err
	}
	opts := daemon.Options{Binary: b.binary, Dir: dir, CPUBytes: total, IOWorkers: o.ioWorkers,
		Extra: []string{"--cpu-arena-dir", arena, "--log-level", "info"}}
	fingerprint := fmt.Appendf(nil, "kvbench/%s/restart-cpu/seed=%d/pid=%d/%d", shape.Name, o.seed, os.Getpid(), time.Now().UnixNano())

	d, err := b.startDaemon(ctx, opts)
	if err != nil {
		return nil, err
	}
	written, err := b.fillCPU(ctx, d, fingerprint, n)
	d.Kill()
	if err != nil {
		return nil, err
	}
	raw, err := hashArena(filepath.Join(arena, cpu.ArenaFileName), len(written), layout.AlignUp(B), B)
	if err != nil {
		return nil, err
	}

	dir2, err := os.MkdirTemp(b.tmp, "restart-cpu-")
	if err != nil {
		return nil, err
	}
	opts.Dir = dir2
	t0 := time.Now()
	d, err = b.startDaemon(ctx, opts)
	if err != nil {
		return nil, err
	}
	serving := time.Since(t0)
	first, full, blocks, werr := b.awaitCPURecovery(ctx, d, t0, fingerprint, written)
	var back, sampled int
	if werr == nil {
		back, sampled, werr = b.checkRestart(ctx, d, fingerprint, written)
	}
	if err := errors.Join(werr, d.Stop()); err != nil {
		return nil, err
	}
	cr := &report.CPURecovery{
		ArenaBytes: total, BlockBytes: int(B), Blocks: len(written),
		StartToServingMs: float64(serving.Microseconds()) / 1e3, StartToFirstHitMs: float64(first.Microseconds()) / 1e3,
		StartToRecoveredSeconds: full.Seconds(), BlocksRecovered: blocks,
		RawHashSeconds: raw.Seconds(), BlocksBack: back, SampledByteExact: sampled,
	}
	if raw > 0 {
		cr.RawHashGBps = float64(uint64(len(written))*B) / raw.Seconds() / 1e9
	}
	if full > serving {
		cr.RecoveryGBps = float64(uint64(len(written))*B) / (full - serving).Seconds() / 1e9
	}
	if back != len(written) || blocks != uint64(len(written)) {
		return cr, fmt.Errorf("restart (CPU arena): %d blocks stored before the kill, %d recovered, %d offered after it", len(written), blocks, back)
	}
	return cr, nil
}

// fillCPU stores n distinct blocks, a region's worth per job, each job
// waited for, and returns their keys.
func (b *bench) fillCPU(ctx context.Context, d *daemon.Daemon, fingerprint []byte, n int) ([][]byte, error) {
	return b.fill(ctx, d, fingerprint, "kvbench-restart-cpu", b.o.seed^0x435055, n, b.region.Blocks, nil)
}

// hashArena hashes n payloads of payload bytes, one per slot of slotBytes
// from the arena's start, straight from the arena file: the limit of a
// verifying recovery on one core.
func hashArena(path string, n int, slotBytes, payload uint64) (time.Duration, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, err
	}
	defer unix.Munmap(mem)
	off := binary.LittleEndian.Uint64(mem[48:]) // the superblock's arena_off (docs/disk-format.md)
	t0 := time.Now()
	var sink uint64
	for i := range uint64(n) {
		p := off + i*slotBytes
		if p+payload > uint64(len(mem)) {
			break
		}
		sink ^= xxh3.Hash(mem[p : p+payload])
	}
	_ = sink
	return time.Since(t0), nil
}

// awaitCPURecovery polls, from t0 (the daemon's exec), a Lookup of a
// sample of the keys until one is offered (the first hit) and the metrics
// until the CPU tier's recovery has ended.
func (b *bench) awaitCPURecovery(ctx context.Context, d *daemon.Daemon, t0 time.Time, fingerprint []byte, written [][]byte) (first, full time.Duration, blocks uint64, err error) {
	c, err := client.Dial(d.Socket)
	if err != nil {
		return 0, 0, 0, err
	}
	defer c.Close()
	ids, err := c.Resolve(ctx, fingerprint)
	if err != nil || len(ids) != 1 || ids[0] == 0 {
		return 0, 0, 0, fmt.Errorf("the namespace did not come back from the arena's catalog: %v %v", ids, err)
	}
	var sample [][]byte
	for i := 0; i < len(written); i += max(1, len(written)/64) {
		sample = append(sample, written[i])
	}
	for first == 0 || full == 0 {
		if first == 0 {
			for _, k := range sample {
				kl, _ := client.Keys(0, model.HashBytes, k)
				lr, err := c.Lookup(ctx, ids, kl, 0)
				if err != nil {
					return 0, 0, 0, err
				}
				if lr.Ready == 1 {
					first = time.Since(t0)
					break
				}
			}
		}
		if full == 0 {
			m, err := d.Metrics(ctx)
			if err != nil {
				return 0, 0, 0, err
			}
			switch daemon.Sum(m, "kvoffload_cpu_recovery_state") {
			case 2:
				full = time.Since(t0)
				blocks = uint64(daemon.Sum(m, "kvoffload_cpu_recovered_blocks"))
			case 0, 3:
				return 0, 0, 0, fmt.Errorf("the CPU tier's recovery did not run (kvoffload_cpu_recovery_state %g)", daemon.Sum(m, "kvoffload_cpu_recovery_state"))
			}
		}
		select {
		case <-ctx.Done():
			return 0, 0, 0, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
	return first, full, blocks, nil
}
