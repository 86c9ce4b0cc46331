package baseline

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// SequentialRead reads the first bytes of the file at path front to back
// with O_DIRECT, in reads of ioBytes, queueDepth of them in flight (each
// reader takes the next one), and returns GB/s (10^9 bytes per second): the
// most a scan of that file can reach, the limit the disk tier's recovery
// is held to (it reads its slot files the same way). Nothing is written.
func SequentialRead(path string, bytes int64, ioBytes, queueDepth int) (float64, error) {
	if ioBytes%vfs.Alignment != 0 || bytes <= 0 || queueDepth < 1 {
		return 0, fmt.Errorf("sequential read of %d bytes in %d-byte reads, %d in flight", bytes, ioBytes, queueDepth)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_DIRECT|unix.O_NOFOLLOW, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n := (bytes + int64(ioBytes) - 1) / int64(ioBytes)
	var (
		next    int64
		mu      sync.Mutex
		wg      sync.WaitGroup
		errs    []error
		scanned int64
	)
	t0 := time.Now()
	for range queueDepth {
		buf, err := vfs.AlignedBuffer(ioBytes)
		if err != nil {
			return 0, err
		}
		defer vfs.FreeBuffer(buf)
		wg.Go(func() {
			for {
				mu.Lock()
				i := next
				next++
				mu.Unlock()
				if i >= n {
					return
				}
				m, err := f.ReadAt(buf, i*int64(ioBytes))
				mu.Lock()
				scanned += int64(m)
				if err != nil {
					errs = append(errs, err)
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	return float64(scanned) / time.Since(t0).Seconds() / 1e9, nil
}
