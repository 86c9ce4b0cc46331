// Package corrupt damages the daemon's disk tier from outside, as a
// failing disk or a stray writer would: it finds written slots in the slot
// files (docs/disk-format.md) and flips a byte of their payload, with
// O_DIRECT so the daemon's own direct reads see the change.
package corrupt

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"

	"github.com/kvoffloadd/kvoffloadd/bench/slotfile"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// Flipper damages slots of one payload size in the files of a directory.
type Flipper struct {
	dir        string
	chunkBytes int64 // slots never straddle a chunk: chunk c holds slots at c*chunk + k*stride
	payload    int64
	stride     int64
	rng        *rand.Rand
	page       []byte
	// Flipped is how many slots have been damaged.
	Flipped int
}

// New returns a flipper for slots holding payloads of payloadBytes, in a
// disk tier cut into chunks of chunkBytes.
func New(dir string, chunkBytes, payloadBytes int64, seed uint64) (*Flipper, error) {
	stride := slot.Size(payloadBytes)
	if chunkBytes < stride {
		return nil, fmt.Errorf("corrupt: chunk of %d bytes holds no slot of %d", chunkBytes, stride)
	}
	page, err := vfs.AlignedBuffer(vfs.Alignment)
	if err != nil {
		return nil, err
	}
	return &Flipper{dir: dir, chunkBytes: chunkBytes, payload: payloadBytes, stride: stride,
		rng: rand.New(rand.NewPCG(seed, 0xc0440)), page: page}, nil
}

// Close releases the flipper's buffer.
func (f *Flipper) Close() error { return vfs.FreeBuffer(f.page) }

// Flip damages up to n written slots, trying a bounded number of random
// slot positions, and returns how many it damaged.
func (f *Flipper) Flip(n int) (int, error) {
	files, err := slotfile.Files(f.dir, f.chunkBytes)
	if err != nil || len(files) == 0 {
		return 0, err
	}
	done := 0
	for try := 0; try < 64*n && done < n; try++ {
		ok, err := f.flipOne(files[f.rng.IntN(len(files))])
		if err != nil {
			return done, err
		}
		if ok {
			done++
		}
	}
	f.Flipped += done
	return done, nil
}

func (f *Flipper) flipOne(path string) (bool, error) {
	file, err := vfs.Default.OpenFile(path, 0, true)
	if err != nil {
		return false, err
	}
	defer file.Close()
	st, err := os.Stat(path)
	if err != nil {
		return false, err
	}
	n, pos := slotfile.Positions(st.Size(), f.chunkBytes, f.stride)
	if n == 0 {
		return false, nil
	}
	off := pos(f.rng.Int64N(n))
	if _, err := file.ReadAt(f.page, off); err != nil {
		return false, err
	}
	h, err := slot.Decode(f.page)
	if err != nil || int64(h.PayloadLen) != f.payload {
		return false, nil // not a written slot of this size: try another
	}
	// Flip one byte of the payload, read-modify-write of its page.
	at := f.rng.Int64N(f.payload)
	pageOff := off + slot.HeaderSize + at/vfs.Alignment*vfs.Alignment
	if _, err := file.ReadAt(f.page, pageOff); err != nil {
		return false, err
	}
	f.page[at%vfs.Alignment] ^= 0x5a
	if _, err := file.WriteAt(f.page, pageOff); err != nil {
		return false, errors.Join(fmt.Errorf("corrupt: write %s at %d", path, pageOff), err)
	}
	return true, nil
}
