package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
// On the CPU-only daemon once it is full, --scale-snapshots times: an
// engine's Lookups back to back, idle, then while a router reads a
// WatchEvents snapshot of every block on a connection of its own (issue 34
// item 3): the Lookups' p50/p99 idle and during, the snapshot's duration,
// the daemon's anonymous RSS growth meanwhile.

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
			if row.SnapshotFailed == "" {
				row.CPUFailed = err.Error()
			}
			errs = append(errs, fmt.Errorf("scale %d, CPU tier: %w", n, err))
		}
		b.prog.advance(1)
		b.prog.phase(fmt.Sprintf("scenario scale: %d blocks of 4 KiB over a disk tier, kill -9, recovery", n))
		if err := b.scaleDisk(ctx, &row); err != nil {
			row.DiskFailed = err.Error()
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
	cpu, err := scaleCPUBytes(n, memAvailable())
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp(b.tmp, "scale-")
	if err != nil {
		return err
	}
	d, err := b.startDaemon(ctx, daemon.Options{Binary: b.binary, Dir: dir, CPUBytes: cpu, IOWorkers: b.o.ioWorkers, Extra: []string{"--debug-checks"}})
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
		return fmt.Errorf("%d blocks reported stored are gone (%d evicted) from a CPU tier with room for %d", row.CPULostWhileRoom, row.CPUEvictions, cpu/4096)
	}
	if b.o.scaleSnaps > 0 {
		b.prog.phase(fmt.Sprintf("scenario scale: %d blocks of 4 KiB, Lookups during %d WatchEvents snapshots", n, b.o.scaleSnaps))
		if err := b.scaleSnapshot(ctx, d, fingerprint, row); err != nil {
			row.SnapshotFailed = err.Error()
			return err
		}
	}
	return nil
}

// scaleSpare is the memory left to kvbench, its engines and the rest.
const scaleSpare = 2 << 30

// scaleCPUBytes is the CPU tier of the scale scenario's first phase: room
// for 2N 4 KiB blocks, or as much as the machine's available memory allows
// less scaleSpare (2N where that is unknown), in 64 MiB chunks; at least
// 9N/8 (room to spare for every block stored), or an error that says so.
// At 4*10^6 blocks, 2N (32 GB) is more than a 24 GiB machine lets one
// mapping reserve; and the daemon backs its whole arena in the background,
// so what it maps it soon holds.
func scaleCPUBytes(n int, avail uint64) (uint64, error) {
	const chunk = 64 << 20
	want := uint64(2*n) * 4096
	switch {
	case avail == 0: // unknown: 2N, and the daemon says if it cannot
	case avail > scaleSpare:
		want = min(want, avail-scaleSpare)
	default:
		want = 0
	}
	least := uint64(n) * 4096 * 9 / 8
	if want < least {
		return 0, fmt.Errorf("%d blocks of 4 KiB need a CPU tier of at least %s, and %s of memory is available", n, model.FormatBytes(least+scaleSpare), model.FormatBytes(avail))
	}
	return max(uint64(256<<20), (want+chunk-1)/chunk*chunk), nil
}

// Lookup latencies of the snapshot phase, by window.
const (
	snapGap    = iota // between windows: not counted
	snapIdle          // no snapshot
	snapDuring        // a snapshot is being read
)

// scaleSnapshot measures what a router's snapshot costs an engine (issue
// 34, item 3): an engine looks up 16 random stored blocks back to back on
// its own connection; b.o.scaleSnaps times, a window of idle Lookups (as
// long as the last snapshot took, at least a second), then a router reads
// a WatchEvents snapshot of every namespace to its CAUGHT_UP on another
// connection, as fast as it can, in a process of its own. Idle and snapshot windows alternate, so
// the machine's load weighs on both alike. The daemon's anonymous RSS is
// read every 20 ms throughout (from /proc: it costs the daemon nothing).
func (b *bench) scaleSnapshot(ctx context.Context, d *daemon.Daemon, fingerprint []byte, row *report.Scale) error {
	n := row.CPUHeld
	region, err := model.NewRegion("/dev/shm", scaleShape, scaleJob)
	if err != nil {
		return err
	}
	defer region.Close()
	eng, err := client.Dial(d.Socket)
	if err != nil {
		return err
	}
	defer eng.Close()
	reg, err := eng.Register(ctx, fingerprint, scaleShape.Layout(), region.Wire(), "kvbench-scale-lookups")
	if err != nil {
		return err
	}

	var window atomic.Int32 // snapGap, snapIdle or snapDuring
	var lat [3][]time.Duration
	lctx, stop := context.WithCancel(ctx)
	defer stop()
	lookErr := make(chan error, 1)
	go func() {
		rng := rand.New(rand.NewPCG(b.o.seed, 34))
		hs := make([][]byte, 16)
		for {
			for i := range hs {
				hs[i] = scaleKey(b.o.seed, rng.IntN(n))
			}
			keys, _ := client.Keys(0, model.HashBytes, hs...)
			w0, t0 := window.Load(), time.Now()
			res, err := eng.Lookup(lctx, []uint32{reg.NamespaceId}, keys, 0)
			took, w1 := time.Since(t0), window.Load()
			if lctx.Err() != nil {
				lookErr <- nil
				return
			}
			if err != nil || res.Ready != uint32(len(hs)) {
				lookErr <- fmt.Errorf("Lookup of 16 stored blocks: %v, %d ready", err, res.GetReady())
				return
			}
			// One that saw a snapshot at its start or end counts as during.
			w := max(w0, w1)
			if w0 == snapGap || w1 == snapGap {
				w = snapGap
			}
			lat[w] = append(lat[w], took)
		}
	}()

	rss := func() float64 {
		ps, _ := procStatus(d.Pid(), "RssAnon")
		return float64(ps["RssAnon"])
	}
	var peak [3]float64
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-lctx.Done():
				return
			case <-tick.C:
				w := window.Load()
				peak[w] = max(peak[w], rss())
			}
		}
	}()
	pause := func(d time.Duration) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-lookErr:
			if err == nil {
				err = errors.New("the Lookups stopped")
			}
			return err
		case <-time.After(d):
			return nil
		}
	}
	var errs []error
	idleFor := time.Second
	for range b.o.scaleSnaps {
		window.Store(snapIdle)
		if err := pause(idleFor); err != nil {
			errs = append(errs, err)
			break
		}
		var blocks int
		var took time.Duration
		err := routerProcess(ctx, d.Socket, func() { window.Store(snapDuring) }, &blocks, &took)
		window.Store(snapGap)
		if err != nil {
			errs = append(errs, fmt.Errorf("snapshot: %w", err))
			break
		}
		if blocks != n {
			errs = append(errs, fmt.Errorf("snapshot of %d blocks, %d held", blocks, n))
		}
		row.SnapshotBlocks = blocks
		row.SnapshotSeconds = append(row.SnapshotSeconds, took.Seconds())
		idleFor = max(time.Second, took)
		if err := pause(100 * time.Millisecond); err != nil {
			errs = append(errs, err)
			break
		}
	}
	stop()
	if err := <-lookErr; err != nil {
		errs = append(errs, err)
	}
	<-sampled
	pct := func(l []time.Duration, q float64) float64 {
		if len(l) == 0 {
			return 0
		}
		slices.Sort(l)
		return float64(l[min(len(l)-1, int(q*float64(len(l))))].Microseconds()) / 1e3
	}
	row.LookupsIdle, row.LookupsDuring = len(lat[snapIdle]), len(lat[snapDuring])
	row.LookupIdleP50Ms, row.LookupIdleP99Ms = pct(lat[snapIdle], 0.5), pct(lat[snapIdle], 0.99)
	row.LookupSnapP50Ms, row.LookupSnapP99Ms = pct(lat[snapDuring], 0.5), pct(lat[snapDuring], 0.99)
	if row.LookupIdleP99Ms > 0 {
		row.LookupSnapP99Ratio = row.LookupSnapP99Ms / row.LookupIdleP99Ms
	}
	if peak[snapIdle] > 0 && peak[snapDuring] > 0 {
		row.SnapshotRSSBytesPerBlock = (peak[snapDuring] - peak[snapIdle]) / float64(n)
	}
	return errors.Join(errs...)
}

// snapshotReaderArg makes kvbench the router of the scale scenario's
// snapshot phase (serveSnapshotReader): a process of its own, as a router
// is, whose decoding does not share the engine's Go runtime.
const snapshotReaderArg = "-kvbench-snapshot-reader"

// routerProcess starts kvbench as a router of the daemon at sock; once it
// has connected, calls start and has it read a snapshot of every block to
// its CAUGHT_UP; blocks is what it held, took the time from asking to its
// end.
func routerProcess(ctx context.Context, sock string, start func(), blocks *int, took *time.Duration) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, exe, snapshotReaderArg, sock)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	out := bufio.NewScanner(stdout)
	var t0 time.Time
	if out.Scan() && out.Text() == "connected" {
		start()
		t0 = time.Now()
		_, err = io.WriteString(stdin, "go\n")
		if err == nil && out.Scan() {
			*took = time.Since(t0)
			_, err = fmt.Sscan(out.Text(), blocks)
		}
	}
	stdin.Close()
	if werr := cmd.Wait(); werr != nil || t0.IsZero() {
		return fmt.Errorf("the router process: %v %v: %s", err, werr, stderr.String())
	}
	return err
}

// serveSnapshotReader is the router process of routerProcess: it connects
// to the socket named after snapshotReaderArg, says "connected", and on a
// line from stdin reads a snapshot, prints its blocks and exits.
func serveSnapshotReader() {
	if len(os.Args) < 3 || os.Args[1] != snapshotReaderArg {
		return
	}
	c, err := client.Dial(os.Args[2])
	if err == nil {
		defer c.Close()
		// One round trip first: the connection is up before the clock
		// starts.
		_, err = c.Healthy(context.Background())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("connected")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		os.Exit(1)
	}
	n, err := readSnapshot(context.Background(), c)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(n)
	c.Close()
	os.Exit(0)
}

// readSnapshot reads a WatchEvents stream of every namespace up to its
// first CAUGHT_UP and returns the blocks its snapshot held (tiers of one
// block counted once each: the CPU tier only here).
func readSnapshot(ctx context.Context, c *client.Client) (int, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := c.API.WatchEvents(ctx, &pb.WatchEventsRequest{})
	if err != nil {
		return 0, err
	}
	stored := 0
	for {
		resp, err := w.Recv()
		if err != nil {
			return stored, err
		}
		for _, e := range resp.Events {
			switch e.Kind {
			case pb.EventKind_EVENT_KIND_BLOCK_STORED:
				stored++
			case pb.EventKind_EVENT_KIND_CAUGHT_UP:
				return stored, nil
			}
		}
	}
}

type scaleMemory struct{ heap, rss float64 }

// anonOutsideArena is the daemon's anonymous RSS less the resident part of
// its arena (the anonymous mapping of arenaBytes): the heap, stacks, and
// what the runtime keeps.
func anonOutsideArena(pid int, arenaBytes uint64) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return 0, err
	}
	anon, arena := anonAndArena(string(b), arenaBytes)
	return float64(anon) - float64(arena), nil
}

// anonAndArena reads one smaps: the anonymous bytes resident in every
// mapping, and those of the arena, the adjacent private read-write
// anonymous mappings (no path) whose sizes add up to arenaBytes (where
// several do, the most resident: the Go runtime's own 64 MiB reservations
// add up to a 256 MiB arena's size too). Both come from the one read: the
// arena is populated in the background while the daemon serves, and
// RssAnon read apart from smaps saw less of it than smaps did (at 10^4
// blocks the figure came out at -605 or 26,244 B a block). The kernel may
// split the arena's mapping (at 4*10^6 blocks a search for one mapping of
// its size found none), and other anonymous mappings may sit beside it.
func anonAndArena(smaps string, arenaBytes uint64) (anon, arena uint64) {
	type vma struct{ size, anon uint64 }
	var run []vma // adjacent anonymous mappings up to the current one
	var end uint64
	isAnon := false
	for _, line := range strings.Split(smaps, "\n") {
		fields := strings.Fields(line)
		if len(fields) >= 5 && !strings.HasSuffix(fields[0], ":") {
			// A mapping's header: start-end perms offset dev inode [path].
			lo, hi, _ := strings.Cut(fields[0], "-")
			start, err1 := strconv.ParseUint(lo, 16, 64)
			next, err2 := strconv.ParseUint(hi, 16, 64)
			isAnon = err1 == nil && err2 == nil && len(fields) == 5 && fields[1] == "rw-p"
			if !isAnon || start != end {
				run = run[:0]
			}
			if isAnon {
				run = append(run, vma{})
			}
			end = next
			continue
		}
		name, rest, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		v, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		if err != nil {
			continue
		}
		if name == "Anonymous" {
			anon += v << 10
		}
		if !isAnon {
			continue
		}
		cur := &run[len(run)-1]
		switch name {
		case "Size":
			cur.size = v << 10
		case "Anonymous":
			cur.anon = v << 10
			// The run's mappings that end here and add up to the arena.
			var size, a uint64
			for i := len(run) - 1; i >= 0 && size < arenaBytes; i-- {
				size, a = size+run[i].size, a+run[i].anon
			}
			if size == arenaBytes {
				arena = max(arena, a)
			}
		}
	}
	return anon, arena
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
	if !b.o.scaleDisk {
		row.DiskSkipped = "--scale-disk=false"
		return nil
	}
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
	d, err := b.startDaemon(ctx, first)
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
	d, err = b.startDaemon(ctx, opts)
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
