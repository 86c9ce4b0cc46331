package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// The restart scenario: what a daemon restart costs an engine whose disk
// tier is full. It fills a disk tier of --restart-bytes with distinct
// blocks (write-through), stops the daemon, reads the slot file once front
// to back with O_DIRECT (the limit: 4 MiB reads, 4 in flight, as recovery
// reads it), starts the daemon again on the same files and times the start
// to SERVING and to the end of the disk tier's background recovery (from
// Stats.disk_recovery), checks that every block is offered and that a
// sample loads byte-exact, stops it and reads the file raw once more.

const (
	restartReadBytes = 4 << 20 // the disk tier's recovery window
	restartReaders   = 4       // and its readers per file
)

func restartKey(seed uint64, i int) []byte {
	k := make([]byte, model.HashBytes)
	binary.LittleEndian.PutUint64(k, seed^0x5245535441525421)
	binary.LittleEndian.PutUint64(k[8:], uint64(i)+1)
	return k
}

// restart runs the scenario and records it in the report.
func (b *bench) restart(ctx context.Context) error {
	o := b.o
	shape, r := o.shape, b.region
	B := uint64(shape.BlockBytes())
	total := o.restartBytes
	chunk := slots.DefaultChunkBytes(total)
	perChunk := chunk / uint64(slotBytes(int(B)))
	// Room for every block without the disk policy evicting: a few
	// percent of the slots stay free.
	n := int(total / chunk * perChunk * 95 / 100)
	// A small CPU tier: the start maps and locks it, and what the start
	// costs apart from the disk is measured by the first start (empty
	// disk tier, same flags).
	cpu := max(uint64(256<<20), (16*B+64<<20-1)/(64<<20)*(64<<20))
	b.prog.phase(fmt.Sprintf("scenario restart: fill a %s disk tier with %d blocks, restart, recover", model.FormatBytes(total), n))

	dir, err := os.MkdirTemp(b.tmp, "restart-")
	if err != nil {
		return err
	}
	diskDir := filepath.Join(b.diskDir, "restart")
	if err := os.Mkdir(diskDir, 0o700); err != nil {
		return err
	}
	defer os.RemoveAll(diskDir)
	opts := daemon.Options{Binary: b.binary, Dir: dir, CPUBytes: cpu, IOWorkers: o.ioWorkers, DiskDir: diskDir, DiskBytes: total,
		Extra: []string{"--write-through", "--disk-chunk-bytes", strconv.FormatUint(chunk, 10), "--log-level", "info"}}
	first := opts
	first.Extra = append(append([]string{}, opts.Extra...), "--disk-reset")
	fingerprint := fmt.Appendf(nil, "kvbench/%s/restart/seed=%d/pid=%d/%d", shape.Name, o.seed, os.Getpid(), time.Now().UnixNano())

	// Fill.
	t0 := time.Now()
	d, err := b.startDaemon(ctx, first)
	if err != nil {
		return err
	}
	servingEmpty := time.Since(t0)
	// A job fits the CPU tier's free reserve (an eighth of its slots):
	// the stores must not meet NO_SPACE while the policy evicts.
	job := max(1, min(r.Blocks, int(cpu/B)/16))
	written, err := b.fillDisk(ctx, d, fingerprint, n, job)
	if err := errors.Join(err, d.Stop()); err != nil {
		return err
	}
	b.prog.advance(1)

	// The limit, on the same file, just before the restart.
	slotFile := filepath.Join(diskDir, "kvoffload-0.slots")
	fileBytes := int64(total / chunk * chunk)
	raw, err := baseline.SequentialRead(slotFile, fileBytes, restartReadBytes, restartReaders)
	if err != nil {
		return fmt.Errorf("sequential read of the slot file: %w", err)
	}

	// Restart.
	dir2, err := os.MkdirTemp(b.tmp, "restart-")
	if err != nil {
		return err
	}
	opts.Dir = dir2
	t0 = time.Now()
	d, err = b.startDaemon(ctx, opts)
	if err != nil {
		return err
	}
	serving := time.Since(t0)
	diskShare, derr := diskStartShare(d.LogPath)
	rec, wall, verr := b.awaitRecovery(ctx, d, t0)
	verr = errors.Join(derr, verr)
	var back, sampled int
	if verr == nil {
		back, sampled, verr = b.checkRestart(ctx, d, fingerprint, written)
	}
	if err := errors.Join(verr, d.Stop()); err != nil {
		return err
	}
	// Again after: the limit is the faster of the two reads (a virtual
	// disk's reads of what was just written wander).
	raw2, err := baseline.SequentialRead(slotFile, fileBytes, restartReadBytes, restartReaders)
	if err != nil {
		return fmt.Errorf("sequential read of the slot file: %w", err)
	}
	b.prog.advance(1)

	rs := &report.Recovery{
		DiskBytes: total, ChunkBytes: chunk, BlockBytes: int(B), Blocks: len(written),
		StartToServingMs: float64(serving.Microseconds()) / 1e3, EmptyStartToServingMs: float64(servingEmpty.Microseconds()) / 1e3,
		DiskOpenToServingMs: float64(diskShare.Microseconds()) / 1e3,
		CPUBytes:            cpu,
		RecoverySeconds:     float64(rec.ElapsedMs) / 1e3, StartToRecoveredSeconds: wall.Seconds(),
		BytesScanned: rec.BytesScanned, BlocksRecovered: rec.BlocksRecovered, BadSlots: rec.BadSlots,
		RawSeqReadGBps: max(raw, raw2), RawSeqReadBeforeGBps: raw, RawSeqReadAfterGBps: raw2, RawReadBytes: restartReadBytes, RawReaders: restartReaders,
		BlocksBack: back, SampledByteExact: sampled,
	}
	if rec.ElapsedMs > 0 {
		rs.RecoveryGBps = float64(rec.BytesScanned) / (float64(rec.ElapsedMs) / 1e3) / 1e9
		rs.RecoveryVsRawSeqRead = rs.RecoveryGBps / rs.RawSeqReadGBps
	}
	b.rep.Recovery = rs
	if uint64(len(written)) != rec.BlocksRecovered || back != len(written) {
		return fmt.Errorf("restart: %d blocks written before the restart, %d recovered, %d offered after it", len(written), rec.BlocksRecovered, back)
	}
	// The CPU tier's turn: a persistent arena (restart_cpu.go).
	rs.CPU, err = b.restartCPU(ctx)
	return err
}

// fillDisk stores n distinct blocks, E per job, waiting after each job
// until its disk writes have landed, and returns the keys written to disk.
func (b *bench) fillDisk(ctx context.Context, d *daemon.Daemon, fingerprint []byte, n, E int) ([][]byte, error) {
	return b.fill(ctx, d, fingerprint, "kvbench-restart", b.o.seed, n, E, func(c *client.Client, reg *pb.RegisterResponse, kl *pb.KeyList, keys [][]byte) error {
		// Write-through: the disk writes run behind the store. Wait
		// until every key of the job has its disk copy.
		for {
			lr, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, kl, 0)
			if err != nil {
				return err
			}
			onDisk := 0
			for _, t := range lr.Tiers {
				if t == pb.Tier_TIER_DISK || t == pb.Tier_TIER_CPU_AND_DISK {
					onDisk++
				}
			}
			if onDisk == len(keys) {
				return nil
			}
			m, err := d.Metrics(ctx)
			if err != nil {
				return err
			}
			if failed := daemon.Sum(m, "kvoffload_disk_demotions_total", `result="failed"`) + daemon.Sum(m, "kvoffload_disk_demotions_total", `result="no_space"`) +
				daemon.Sum(m, "kvoffload_disk_demotions_total", `result="dropped"`) + daemon.Sum(m, "kvoffload_disk_demotions_total", `result="rejected"`); failed > 0 {
				return fmt.Errorf("fill: %g blocks did not reach the disk (see kvoffload_disk_demotions_total)", failed)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(2 * time.Millisecond):
			}
		}
	})
}

// fill stores n distinct blocks (restartKey(seed, i)), per to a job, each
// job waited for and then handed to settle (nil: nothing more), and returns
// their keys.
func (b *bench) fill(ctx context.Context, d *daemon.Daemon, fingerprint []byte, name string, seed uint64, n, per int, settle func(c *client.Client, reg *pb.RegisterResponse, kl *pb.KeyList, keys [][]byte) error) ([][]byte, error) {
	r := b.region
	c, err := client.Dial(d.Socket)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	reg, err := c.Register(ctx, fingerprint, b.o.shape.Layout(), r.Wire(), name)
	if err != nil {
		return nil, err
	}
	var written [][]byte
	for i := 0; i < n; i += per {
		keys := make([][]byte, 0, per)
		blocks := make([]uint32, 0, per)
		for j := i; j < min(i+per, n); j++ {
			k := restartKey(seed, j)
			r.Fill(len(keys), k)
			keys, blocks = append(keys, k), append(blocks, uint32(len(keys)))
		}
		kl, err := client.Keys(0, model.HashBytes, keys...)
		if err != nil {
			return nil, err
		}
		res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{{JobId: uint64(i + 1), Keys: kl, BlockIds: blocks}}, true)
		if err != nil {
			return nil, err
		}
		if len(res[0].Failures) > 0 {
			return nil, fmt.Errorf("fill: %d blocks not stored: %v", len(res[0].Failures), res[0].Failures[0].Status)
		}
		if settle != nil {
			if err := settle(c, reg, kl, keys); err != nil {
				return nil, err
			}
		}
		written = append(written, keys...)
	}
	return written, nil
}

// awaitRecovery polls Stats until the disk tier's recovery has ended; it
// returns the final progress and the time since t0 (the daemon's start).
func (b *bench) awaitRecovery(ctx context.Context, d *daemon.Daemon, t0 time.Time) (*pb.DiskRecovery, time.Duration, error) {
	c, err := client.Dial(d.Socket)
	if err != nil {
		return nil, 0, err
	}
	defer c.Close()
	for {
		st, err := c.Stats(ctx)
		if err != nil {
			return nil, 0, err
		}
		rec := st.GetDiskRecovery()
		if rec == nil {
			return nil, 0, errors.New("the daemon reports no disk recovery (a daemon from before background recovery?)")
		}
		if rec.State != pb.RecoveryState_RECOVERY_STATE_RUNNING {
			wall := time.Since(t0)
			if rec.State != pb.RecoveryState_RECOVERY_STATE_DONE {
				return rec, wall, fmt.Errorf("recovery ended %v", rec.State)
			}
			return rec, wall, nil
		}
		select {
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// checkRestart looks every written key up after the restart and loads a
// sample (one engine region's worth) into engine memory, byte-checked.
func (b *bench) checkRestart(ctx context.Context, d *daemon.Daemon, fingerprint []byte, written [][]byte) (back, sampled int, err error) {
	r, E := b.region, b.region.Blocks
	c, err := client.Dial(d.Socket)
	if err != nil {
		return 0, 0, err
	}
	defer c.Close()
	reg, err := c.Register(ctx, fingerprint, b.o.shape.Layout(), r.Wire(), "kvbench-restart")
	if err != nil {
		return 0, 0, err
	}
	if !reg.JoinedExisting {
		return 0, 0, errors.New("the namespace did not come back from the disk tier's catalog")
	}
	for i := 0; i < len(written); i += 256 {
		kl, _ := client.Keys(0, model.HashBytes, written[i:min(i+256, len(written))]...)
		lr, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, kl, 0)
		if err != nil {
			return 0, 0, err
		}
		back += int(lr.Ready)
	}
	step := max(1, len(written)/E)
	var sample [][]byte
	for i := 0; i < len(written) && len(sample) < E; i += step {
		sample = append(sample, written[i])
	}
	blocks := make([]uint32, len(sample))
	for i := range sample {
		blocks[i] = uint32(i)
		r.Poison(i)
	}
	kl, _ := client.Keys(0, model.HashBytes, sample...)
	res, err := c.Load(ctx, reg.RegistrationId, []*pb.Job{{JobId: 1, Keys: kl, BlockIds: blocks}}, true)
	if err != nil {
		return back, 0, err
	}
	if !res[0].Ok {
		return back, 0, fmt.Errorf("restart: loads of recovered blocks failed: %d, first %v", len(res[0].Failures), res[0].Failures[0].Status)
	}
	var errs []string
	for i, k := range sample {
		if err := r.Check(i, k); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if len(errs) > 0 {
		return back, 0, fmt.Errorf("restart: %d recovered blocks loaded with wrong bytes: %s", len(errs), strings.Join(errs[:1], ""))
	}
	return back, len(sample), nil
}

// diskStartShare reads, from the daemon's log, the time from the start of
// the disk tier's open to SERVING: what the disk tier adds to the start.
func diskStartShare(logPath string) (time.Duration, error) {
	b, err := os.ReadFile(logPath)
	if err != nil {
		return 0, err
	}
	var open, serving time.Time
	for _, line := range strings.Split(string(b), "\n") {
		ts, rest, ok := strings.Cut(strings.TrimPrefix(line, "time="), " ")
		if !ok {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, ts)
		if err != nil {
			continue
		}
		switch {
		case strings.Contains(rest, `msg="opening the disk tier"`):
			open = t
		case strings.Contains(rest, `msg="kvoffloadd serving"`):
			serving = t
		}
	}
	if open.IsZero() || serving.IsZero() {
		return 0, fmt.Errorf("the daemon's log (%s) lacks the disk tier's open or its serving line", logPath)
	}
	return serving.Sub(open), nil
}
