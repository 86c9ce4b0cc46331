// Package baseline owns the limits kvbench holds the daemon to, measured in
// the same run with the same block size: the memory copy bandwidth (Go
// copy(), the daemon's own copy loop), raw O_DIRECT reads and writes of the
// same I/O size and queue depth on the same directory, the empty gRPC round
// trip, and Redis SET/GET of the same blocks.
package baseline

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// Memcpy copies blocks of blockBytes from one buffer to another, both
// larger than any CPU cache, with workers goroutines (the daemon's copy
// workers), for at least minBytes in five rounds, and returns the median
// round's GB/s (10^9 bytes per second). With segBytes < blockBytes each
// block is copied as segments scattered the way an engine's KV regions lay
// them out (segment s of block b at (s*blocks+b)*segBytes), as the daemon
// must copy them; segBytes == blockBytes is the plain memory limit.
func Memcpy(blockBytes, segBytes, workers int, bufBytes, minBytes int64) (float64, error) {
	if segBytes <= 0 || blockBytes%segBytes != 0 {
		return 0, fmt.Errorf("memcpy: segment of %d bytes does not divide a block of %d", segBytes, blockBytes)
	}
	blocks := int(max(bufBytes/int64(blockBytes), int64(2*workers)))
	size := blocks * blockBytes
	src, err := vfs.AlignedBuffer(size)
	if err != nil {
		return 0, err
	}
	defer vfs.FreeBuffer(src)
	dst, err := vfs.AlignedBuffer(size)
	if err != nil {
		return 0, err
	}
	defer vfs.FreeBuffer(dst)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src) // fault in every page before timing
	segs := blockBytes / segBytes
	// Five rounds, the median reported: on a shared machine one round
	// can land on a neighbour's burst.
	const rounds = 5
	passes := int(max((minBytes/rounds+int64(size)-1)/int64(size), 1))
	var gbps []float64
	for range rounds {
		t0 := time.Now()
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for range passes {
					for b := w; b < blocks; b += workers {
						for sg := range segs {
							from, to := b*blockBytes+sg*segBytes, (sg*blocks+b)*segBytes
							copy(dst[to:to+segBytes], src[from:from+segBytes])
						}
					}
				}
			})
		}
		wg.Wait()
		gbps = append(gbps, float64(passes)*float64(size)/time.Since(t0).Seconds()/1e9)
	}
	slices.Sort(gbps)
	return gbps[rounds/2], nil
}

// ODirect is raw direct I/O throughput in GB/s.
type ODirect struct {
	ReadGBps, WriteGBps float64
	IOBytes             int
	QueueDepth          int
	FileBytes           int64
}

// MeasureODirect writes then reads back a file of fileBytes in dir with
// O_DIRECT, in I/Os of ioBytes (rounded up to 4 KiB, as the disk tier's
// slots are), queueDepth of them in flight; writes go in order, reads in a
// seeded random order, as cache hits do. The file is removed.
func MeasureODirect(dir string, ioBytes, queueDepth int, fileBytes int64, seed uint64) (ODirect, error) {
	ioBytes = (ioBytes + vfs.Alignment - 1) / vfs.Alignment * vfs.Alignment
	n := int(max(fileBytes/int64(ioBytes), int64(queueDepth)))
	res := ODirect{IOBytes: ioBytes, QueueDepth: queueDepth, FileBytes: int64(n) * int64(ioBytes)}
	if err := vfs.ProbeDirect(dir); err != nil {
		return res, err
	}
	path := filepath.Join(dir, fmt.Sprintf("kvbench-odirect-%d", seed))
	f, err := vfs.Default.OpenFile(path, res.FileBytes, true)
	if err != nil {
		return res, err
	}
	defer vfs.Default.Remove(path)
	defer f.Close()
	bufs := make([][]byte, queueDepth)
	for i := range bufs {
		if bufs[i], err = vfs.AlignedBuffer(ioBytes); err != nil {
			return res, err
		}
		defer vfs.FreeBuffer(bufs[i])
		for j := range bufs[i] {
			bufs[i][j] = byte(i + j)
		}
	}
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	run := func(write bool) (float64, error) {
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			errs []error
		)
		t0 := time.Now()
		for q := range queueDepth {
			wg.Go(func() {
				for i := q; i < n; i += queueDepth {
					off := int64(order[i]) * int64(ioBytes)
					var err error
					if write {
						_, err = f.WriteAt(bufs[q], off)
					} else {
						_, err = f.ReadAt(bufs[q], off)
					}
					if err != nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
						return
					}
				}
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return 0, err
		}
		return float64(n) * float64(ioBytes) / time.Since(t0).Seconds() / 1e9, nil
	}
	// Three rounds of writing the file and reading it back, the medians
	// reported: the disk of a shared or virtual machine wanders.
	const rounds = 3
	var reads, writes []float64
	rng := rand.New(rand.NewPCG(seed, 1))
	for range rounds {
		slices.Sort(order)
		w, err := run(true)
		if err != nil {
			return res, err
		}
		if err := f.Sync(); err != nil {
			return res, err
		}
		rng.Shuffle(n, func(i, j int) { order[i], order[j] = order[j], order[i] })
		r, err := run(false)
		if err != nil {
			return res, err
		}
		reads, writes = append(reads, r), append(writes, w)
	}
	slices.Sort(reads)
	slices.Sort(writes)
	res.ReadGBps, res.WriteGBps = reads[rounds/2], writes[rounds/2]
	return res, nil
}

// GRPCEmpty times n sequential health Checks (after n/10 untimed ones) on c, the control path's
// floor: every kvoffloadd RPC costs at least this.
func GRPCEmpty(ctx context.Context, c *client.Client, n int) ([]time.Duration, error) {
	out := make([]time.Duration, 0, n)
	for i := range n + n/10 {
		t0 := time.Now()
		ok, err := c.Healthy(ctx)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, errors.New("health check: not serving")
		}
		if i >= n/10 { // the first tenth warms the connection up
			out = append(out, time.Since(t0))
		}
	}
	return out, nil
}
