package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// The scale scenario (issue 34): N small blocks through the real daemon,
// for each N of --scale-blocks. Twice per N:
//
//   - CPU tier only, with room for 2N blocks: --scale-ranks engines (ranks
//     of one model) store N distinct blocks at once; every block reported
//     stored must be held (none evicted while the tier has room); Stats is
//     timed (it must not grow with N); the daemon's Go heap and RSS per
//     block are read before and after.
//   - A CPU tier of N/8 blocks (16 to 64 MiB) over a disk tier with room for N: the same stores,
//     faster than the disk takes them; no block reported stored may be
//     dropped (kvoffload_disk_demotions_total{result="dropped"}); the
//     daemon's Go heap per block once the disk took them. Then a
//     kill -9, a restart on the same files, the background recovery timed
//     against a raw O_DIRECT sequential read of the same slot file, and the
//     daemon's CPU time per recovered block.
//
// (A WatchEvents snapshot subscriber during Lookups, issue 34 item 3, is
// the events work's to add here, on the CPU-only daemon once it is full.)

// scaleShape is a 4 KiB block: two 2 KiB segments.
var scaleShape = model.Shape{Name: "scale-4k", Layers: 1, BlockTokens: 16, KVHeads: 1, HeadDim: 64, DTypeBytes: 2}

// scaleJob is the blocks per Store job (and per rank's region).
const scaleJob = 512

// retryFor is how long a rank offers refused blocks again with none stored.
const retryFor = time.Minute

func scaleKey(seed uint64, i int) []byte {
	k := make([]byte, model.HashBytes)
	binary.LittleEndian.PutUint64(k, seed^0x5343414c45213432)
	binary.LittleEndian.PutUint64(k[8:], uint64(i)+1)
	return k
}

// scale runs the scenario for every N.
func (b *bench) scale(ctx context.Context) error {
	var errs []error
	for _, n := range b.o.scaleBlocks {
		row := report.Scale{Blocks: n, BlockBytes: scaleShape.BlockBytes(), Ranks: b.o.scaleRanks}
		b.prog.phase(fmt.Sprintf("scenario scale: %d blocks of 4 KiB, CPU tier only", n))
		if err := b.scaleCPU(ctx, &row); err != nil {
			errs = append(errs, fmt.Errorf("scale %d, CPU tier: %w", n, err))
		}
		b.prog.advance(1)
		b.prog.phase(fmt.Sprintf("scenario scale: %d blocks of 4 KiB over a disk tier, kill -9, recovery", n))
		if err := b.scaleDisk(ctx, &row); err != nil {
			errs = append(errs, fmt.Errorf("scale %d, disk tier: %w", n, err))
		}
		b.prog.advance(1)
		b.rep.Scale = append(b.rep.Scale, row)
		if ctx.Err() != nil {
			break
		}
	}
	return errors.Join(errs...)
}

// scaleStores stores n distinct blocks (scaleKey(seed, i)) from ranks
// engines at once, scaleJob to a job, and returns the keys stored OK and the
// blocks refused NO_SPACE; any other failure is an error. With retry, a
// rank offers its refused blocks again with its next job (pausing 10 ms
// after a job with refusals, as an engine's next step comes later), until
// each is stored or none was stored for retryFor.
func (b *bench) scaleStores(ctx context.Context, d *daemon.Daemon, fingerprint []byte, seed uint64, n, ranks int, retry bool) (ok [][]byte, noSpace int, took time.Duration, err error) {
	type rank struct {
		c   *client.Client
		reg *pb.RegisterResponse
		r   *model.Region
	}
	rs := make([]rank, ranks)
	defer func() {
		for _, r := range rs {
			if r.c != nil {
				r.c.Close()
			}
			if r.r != nil {
				r.r.Close()
			}
		}
	}()
	for i := range rs {
		if rs[i].r, err = model.NewRegion("/dev/shm", scaleShape, scaleJob); err != nil {
			return nil, 0, 0, err
		}
		if rs[i].c, err = client.Dial(d.Socket); err != nil {
			return nil, 0, 0, err
		}
		if rs[i].reg, err = rs[i].c.Register(ctx, fingerprint, scaleShape.Layout(), rs[i].r.Wire(), fmt.Sprintf("kvbench-scale-%d", i)); err != nil {
			return nil, 0, 0, err
		}
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	errc := make(chan error, ranks)
	t0 := time.Now()
	for i := range rs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rs[i]
			blocks := make([]uint32, scaleJob)
			for j := range blocks {
				blocks[j] = uint32(j)
			}
			// Rank i stores blocks i, i+ranks, ...: the ranks' stores
			// overlap, each job scaleJob blocks: refused ones first
			// (with retry), then new ones.
			var again [][]byte
			next, progress := i, time.Now()
			for job := 1; next < n || len(again) > 0; job++ {
				if time.Since(progress) > retryFor {
					errc <- fmt.Errorf("rank %d: %d blocks refused NO_SPACE for %v", i, len(again), retryFor)
					return
				}
				keys := slices.Clone(again[:min(len(again), scaleJob)])
				again = again[len(keys):]
				for ; next < n && len(keys) < scaleJob; next += ranks {
					keys = append(keys, scaleKey(seed, next))
				}
				for j, k := range keys {
					r.r.Fill(j, k)
				}
				kl, _ := client.Keys(0, model.HashBytes, keys...)
				res, err := r.c.Store(ctx, r.reg.RegistrationId, []*pb.Job{{JobId: uint64(job), Keys: kl, BlockIds: blocks[:len(keys)]}}, true)
				if err != nil {
					errc <- err
					return
				}
				failed := map[uint32]bool{}
				for _, f := range res[0].Failures {
					if f.Status != pb.BlockStatus_BLOCK_STATUS_NO_SPACE {
						errc <- fmt.Errorf("block %d of job %d failed %v", f.Index, job, f.Status)
						return
					}
					failed[f.Index] = true
				}
				mu.Lock()
				noSpace += len(failed)
				for j, k := range keys {
					if !failed[uint32(j)] {
						ok = append(ok, k)
					} else if retry {
						again = append(again, k)
					}
				}
				mu.Unlock()
				if len(failed) < len(keys) {
					progress = time.Now()
				}
				if len(failed) > 0 && retry {
					select {
					case <-ctx.Done():
						errc <- ctx.Err()
						return
					case <-time.After(10 * time.Millisecond):
					}
				}
			}
		}()
	}
	wg.Wait()
	took = time.Since(t0)
	close(errc)
	for e := range errc {
		err = errors.Join(err, e)
	}
	return ok, noSpace, took, err
}

// nsBlocks is the blocks Stats reports for the namespace of fingerprint
// (the only one), and how long the call took.
func nsBlocks(ctx context.Context, c *client.Client) (uint64, *pb.StatsResponse, time.Duration, error) {
	t0 := time.Now()
	st, err := c.Stats(ctx)
	took := time.Since(t0)
	if err != nil {
		return 0, nil, 0, err
	}
	var n uint64
	for _, ns := range st.Namespaces {
		n += ns.Blocks
	}
	return n, st, took, nil
}

// procStatus reads kB fields of /proc/pid/status.
func procStatus(pid int, fields ...string) (map[string]uint64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]uint64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || !slices.Contains(fields, name) {
			continue
		}
		v, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		if err == nil {
			out[name] = v << 10
		}
	}
	return out, sc.Err()
}

func (b *bench) scaleCPU(ctx context.Context, row *report.Scale) error {
	n := row.Blocks
	cpu := max(uint64(256<<20), (uint64(2*n)*4096+64<<20-1)/(64<<20)*(64<<20))
	dir, err := os.MkdirTemp(b.tmp, "scale-")
	if err != nil {
		return err
	}
	d, err := daemon.Start(ctx, daemon.Options{Binary: b.binary, Dir: dir, CPUBytes: cpu, IOWorkers: b.o.ioWorkers, Extra: []string{"--debug-checks"}})
	if err != nil {
		return err
	}
	defer d.Stop()
	row.CPUBytes = cpu
	c, err := client.Dial(d.Socket)
	if err != nil {
		return err
	}
	defer c.Close()
	before, err := b.scaleMem(ctx, d, cpu)
	if err != nil {
		return err
	}
	fingerprint := fmt.Appendf(nil, "kvbench/scale-cpu/%d/pid=%d/%d", n, os.Getpid(), time.Now().UnixNano())
	ok, noSpace, took, err := b.scaleStores(ctx, d, fingerprint, b.o.seed, n, b.o.scaleRanks, false)
	if err != nil {
		return err
	}
	row.CPUStoredOK, row.CPUNoSpace, row.CPUStoreSeconds = len(ok), noSpace, took.Seconds()
	held, st, _, err := nsBlocks(ctx, c)
	if err != nil {
		return err
	}
	row.CPUHeld, row.CPUEvictions = int(held), int(st.Evictions)
	row.CPULostWhileRoom = len(ok) - int(held)
	// Stats, polled as an operator would: the median and the worst of 20.
	var ts []time.Duration
	for range 20 {
		_, _, t, err := nsBlocks(ctx, c)
		if err != nil {
			return err
		}
		ts = append(ts, t)
	}
	slices.Sort(ts)
	row.StatsP50Ms, row.StatsMaxMs = float64(ts[len(ts)/2].Microseconds())/1e3, float64(ts[len(ts)-1].Microseconds())/1e3
	after, err := b.scaleMem(ctx, d, cpu)
	if err != nil {
		return err
	}
	row.HeapBytesPerBlock = (after.heap - before.heap) / float64(n)
	row.RSSBytesPerBlock = (after.rss - before.rss) / float64(n)
	if row.CPULostWhileRoom != 0 || row.CPUEvictions != 0 {
		return fmt.Errorf("%d blocks reported stored are gone (%d evicted) from a CPU tier with room for %d", row.CPULostWhileRoom, row.CPUEvictions, 2*n)
	}
	return nil
}

type scaleMemory struct{ heap, rss float64 }

// anonOutsideArena is the daemon's anonymous RSS less the resident part of
// its arena (the anonymous mapping of arenaBytes): the heap, stacks, and
// what the runtime keeps.
func anonOutsideArena(pid int, arenaBytes uint64) (float64, error) {
	ps, err := procStatus(pid, "RssAnon")
	if err != nil {
		return 0, err
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return 0, err
	}
	var arena uint64
	inArena := false
	for _, line := range strings.Split(string(b), "\n") {
		name, rest, ok := strings.Cut(line, ":")
		if !ok || strings.Contains(name, " ") || strings.Contains(name, "-") {
			inArena = false // a mapping's header line
			continue
		}
		v, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		switch {
		case err != nil:
		case name == "Size":
			inArena = v<<10 == arenaBytes
		case name == "Rss" && inArena:
			arena = v << 10
		}
	}
	return float64(ps["RssAnon"]) - float64(arena), nil
}

// scaleMem reads the daemon's Go heap in use after a garbage collection
// (POST /debug/gc: without it the heap holds the garbage of the stores
// until the next cycle, up to as much again as what is live, and a read
// said more of when the last cycle ran than of the blocks), the least of
// five reads 200 ms apart, and its anonymous RSS (the arena, locked at the
// start, and the heap; not the engines' shared regions it maps) outside its
// arena of arenaBytes.
func (b *bench) scaleMem(ctx context.Context, d *daemon.Daemon, arenaBytes uint64) (scaleMemory, error) {
	var sm scaleMemory
	if err := d.GC(ctx); err != nil {
		return sm, err
	}
	for i := range 5 {
		if i > 0 {
			select {
			case <-ctx.Done():
				return sm, ctx.Err()
			case <-time.After(200 * time.Millisecond):
			}
		}
		m, err := d.Metrics(ctx)
		if err != nil {
			return sm, err
		}
		if h := daemon.Sum(m, "go_memstats_heap_inuse_bytes"); i == 0 || h < sm.heap {
			sm.heap = h
		}
	}
	var err error
	sm.rss, err = anonOutsideArena(d.Pid(), arenaBytes)
	return sm, err
}

func (b *bench) scaleDisk(ctx context.Context, row *report.Scale) error {
	n := row.Blocks
	if b.diskDir == "" {
		row.DiskSkipped = b.diskWhy
		return nil
	}
	slot := uint64(slotBytes(scaleShape.BlockBytes()))
	want := uint64(n) * slot * 9 / 8
	chunk := slots.DefaultChunkBytes(want)
	total := (want + chunk - 1) / chunk * chunk
	if free := diskFree(b.diskDir); free < total+total/8 {
		row.DiskSkipped = fmt.Sprintf("%s has %s free, %d blocks need %s", b.diskDir, model.FormatBytes(free), n, model.FormatBytes(total))
		return nil
	}
	diskDir := filepath.Join(b.diskDir, "scale")
	if err := os.Mkdir(diskDir, 0o700); err != nil {
		return err
	}
	defer os.RemoveAll(diskDir)
	dir, err := os.MkdirTemp(b.tmp, "scale-")
	if err != nil {
		return err
	}
	// A CPU tier of an eighth of the blocks (16 to 64 MiB): most go to
	// disk, evicted faster than the disk takes them.
	cpu := min(max(uint64(n)*4096/8, 16<<20), 64<<20) / (16 << 20) * (16 << 20)
	opts := daemon.Options{Binary: b.binary, Dir: dir, CPUBytes: cpu, IOWorkers: b.o.ioWorkers, DiskDir: diskDir, DiskBytes: total,
		Extra: []string{"--disk-chunk-bytes", strconv.FormatUint(chunk, 10), "--log-level", "info", "--debug-checks"}}
	first := opts
	first.Extra = append(slices.Clip(opts.Extra), "--disk-reset")
	d, err := daemon.Start(ctx, first)
	if err != nil {
		return err
	}
	row.DiskBytes = total
	before, err := b.scaleMem(ctx, d, cpu)
	if err != nil {
		d.Kill()
		return err
	}
	fingerprint := fmt.Appendf(nil, "kvbench/scale-disk/%d/pid=%d/%d", n, os.Getpid(), time.Now().UnixNano())
	ok, noSpace, took, err := b.scaleStores(ctx, d, fingerprint, b.o.seed+1, n, b.o.scaleRanks, true)
	if err != nil {
		d.Kill()
		return err
	}
	row.DiskStoredOK, row.DiskNoSpace, row.DiskStoreSeconds = len(ok), noSpace, took.Seconds()
	c, err := client.Dial(d.Socket)
	if err != nil {
		d.Kill()
		return err
	}
	defer c.Close()
	// Let the disk take what the CPU tier evicted: until the disk tier's
	// block count holds still for half a second.
	var onDisk uint64
	for still := 0; still < 5; {
		_, st, _, err := nsBlocks(ctx, c)
		if err != nil {
			d.Kill()
			return err
		}
		var blocks uint64
		for _, t := range st.Tiers {
			if t.Name == "disk" {
				blocks = t.Blocks
			}
		}
		if blocks == onDisk {
			still++
		} else {
			still, onDisk = 0, blocks
		}
		select {
		case <-ctx.Done():
			d.Kill()
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	held, _, _, err := nsBlocks(ctx, c)
	if err != nil {
		d.Kill()
		return err
	}
	after, err := b.scaleMem(ctx, d, cpu)
	if err != nil {
		d.Kill()
		return err
	}
	row.DiskHeapBytesPerBlock = (after.heap - before.heap) / float64(n)
	m, err := d.Metrics(ctx)
	if err != nil {
		d.Kill()
		return err
	}
	row.DiskHeld, row.DiskOnDisk = int(held), int(onDisk)
	row.DiskDropped = int(daemon.Sum(m, "kvoffload_disk_demotions_total", `result="dropped"`))
	row.DiskLost = len(ok) - int(held)
	d.Kill() // kill -9: no clean shutdown

	// The limit: a raw O_DIRECT read of the same slot file.
	slotFile := filepath.Join(diskDir, "kvoffload-0.slots")
	fi, err := os.Stat(slotFile)
	if err != nil {
		return err
	}
	raw, err := baseline.SequentialRead(slotFile, fi.Size()/restartReadBytes*restartReadBytes, restartReadBytes, restartReaders)
	if err != nil {
		return fmt.Errorf("sequential read of the slot file: %w", err)
	}
	opts.Dir, err = os.MkdirTemp(b.tmp, "scale-")
	if err != nil {
		return err
	}
	t0 := time.Now()
	d, err = daemon.Start(ctx, opts)
	if err != nil {
		return err
	}
	row.RestartToServingMs = float64(time.Since(t0).Microseconds()) / 1e3
	m0, merr := d.Metrics(ctx)
	rec, _, rerr := b.awaitRecovery(ctx, d, t0)
	m1, merr2 := d.Metrics(ctx)
	if err := errors.Join(merr, rerr, merr2, d.Stop()); err != nil {
		return err
	}
	row.RawSeqReadGBps = raw
	row.RecoveredBlocks, row.BadSlots = int(rec.BlocksRecovered), int(rec.BadSlots)
	if rec.ElapsedMs > 0 {
		row.RecoverySeconds = float64(rec.ElapsedMs) / 1e3
		row.RecoveryGBps = float64(rec.BytesScanned) / row.RecoverySeconds / 1e9
		row.RecoveryVsRaw = row.RecoveryGBps / raw
	}
	if rec.BlocksRecovered > 0 {
		cpuS := daemon.Sum(m1, "process_cpu_seconds_total") - daemon.Sum(m0, "process_cpu_seconds_total")
		row.RecoveryCPUusPerBlock = cpuS * 1e6 / float64(rec.BlocksRecovered)
	}
	var errs []error
	if row.DiskDropped != 0 || row.DiskLost != 0 {
		errs = append(errs, fmt.Errorf("%d blocks reported stored are gone, %d dropped from the demotion queue, with a disk tier of room for %d", row.DiskLost, row.DiskDropped, n))
	}
	if int(rec.BlocksRecovered) < row.DiskOnDisk {
		errs = append(errs, fmt.Errorf("%d blocks on disk before the kill -9, %d recovered", row.DiskOnDisk, rec.BlocksRecovered))
	}
	return errors.Join(errs...)
}
