package baseline

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/slotfile"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// TierReader reads slots of the daemon's own slot file with the disk
// tier's pattern, without the daemon: per slot the 4 KiB header and the
// payload in one O_DIRECT preadv (vfs.ReadvAt, as tiers/disk/io.go read
// does on a real file), queueDepth reads in flight per file (the tier's I/O
// workers per file), in bursts (a Load's disk reads all queued at once). Reading the
// slots the daemon wrote, in the file it wrote them to, takes the file's
// size, layout and age out of the comparison; what is left is the daemon.
type TierReader struct {
	payload    int
	queueDepth int
	files      map[string]vfs.File
	bufs       [][]byte // per worker: header block, then payload
}

// NewTierReader opens the files of slots for reads of payloadBytes.
func NewTierReader(slots []slotfile.Slot, payloadBytes, queueDepth int) (*TierReader, error) {
	r := &TierReader{payload: payloadBytes, queueDepth: max(queueDepth, 1), files: map[string]vfs.File{}}
	for _, s := range slots {
		if r.files[s.Path] != nil {
			continue
		}
		f, err := vfs.Default.OpenFile(s.Path, 0, true)
		if err != nil {
			r.Close()
			return nil, err
		}
		r.files[s.Path] = f
	}
	for range r.queueDepth {
		b, err := vfs.AlignedBuffer(slot.HeaderSize + int(layout.AlignUp(uint64(payloadBytes))))
		if err != nil {
			r.Close()
			return nil, err
		}
		r.bufs = append(r.bufs, b)
	}
	return r, nil
}

// Close closes the files and frees the buffers.
func (r *TierReader) Close() error {
	var errs []error
	for _, f := range r.files {
		errs = append(errs, f.Close())
	}
	for _, b := range r.bufs {
		errs = append(errs, vfs.FreeBuffer(b))
	}
	r.files, r.bufs = nil, nil
	return errors.Join(errs...)
}

// IOBytes is what one slot read moves: the header and the aligned payload.
func (r *TierReader) IOBytes() int { return slot.HeaderSize + int(layout.AlignUp(uint64(r.payload))) }

// Read reads the slots as one burst (all queued at once, queueDepth in
// flight per file) and returns how long the burst took.
func (r *TierReader) Read(slots []slotfile.Slot) (time.Duration, error) {
	byFile := map[string][]slotfile.Slot{}
	for _, s := range slots {
		byFile[s.Path] = append(byFile[s.Path], s)
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	start := time.Now()
	w := 0
	for path, ss := range byFile {
		f := r.files[path]
		if f == nil {
			return 0, fmt.Errorf("tier-pattern read: %s was not opened", path)
		}
		// The tier has queueDepth workers per file; this reader has
		// queueDepth buffers, shared by the files of one burst (kvbench
		// runs one disk directory).
		var next int
		var nmu sync.Mutex
		for q := 0; q < r.queueDepth && q < len(ss); q++ {
			buf := r.bufs[w%len(r.bufs)]
			w++
			wg.Go(func() {
				for {
					nmu.Lock()
					i := next
					next++
					nmu.Unlock()
					if i >= len(ss) {
						return
					}
					hdr, pay := buf[:slot.HeaderSize], buf[slot.HeaderSize:]
					if _, err := vfs.ReadvAt(f, [][]byte{hdr, pay}, ss[i].Off); err != nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
						return
					}
				}
			})
		}
	}
	wg.Wait()
	return time.Since(start), errors.Join(errs...)
}

// Bursts reads slots in bursts of burst slots, one after the other, and
// returns each burst's time.
func (r *TierReader) Bursts(slots []slotfile.Slot, burst int) ([]time.Duration, error) {
	var out []time.Duration
	for lo := 0; lo < len(slots); lo += burst {
		d, err := r.Read(slots[lo:min(lo+burst, len(slots))])
		if err != nil {
			return out, err
		}
		out = append(out, d)
	}
	return out, nil
}
