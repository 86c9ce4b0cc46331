// Package slotfile reads the daemon's disk-tier slot files from outside,
// as kvbench needs to (docs/disk-format.md): it lists the slot files of a
// directory and finds the written slots of one payload size by their
// headers. A slot never straddles a chunk: chunk c of a file holds its
// slots at c*chunkBytes + k*slot.Size(payload).
package slotfile

import (
	"os"
	"path/filepath"
	"sync"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// Files lists the regular files of dir big enough to hold a chunk: the
// slot files (the chunk maps and catalogs beside them are small).
func Files(dir string, chunkBytes int64) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if info, err := e.Info(); err == nil && info.Mode().IsRegular() && info.Size() >= chunkBytes {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	return out, nil
}

// Slot is a written slot found by Scan.
type Slot struct {
	Path string
	Off  int64 // of the header; the payload follows at Off+slot.HeaderSize
	Hash []byte
}

// Positions is how many slot positions of slotBytes a file of fileBytes
// cut into chunks of chunkBytes has, and where the i-th starts.
func Positions(fileBytes, chunkBytes, slotBytes int64) (int64, func(i int64) int64) {
	per := chunkBytes / slotBytes
	return fileBytes / chunkBytes * per, func(i int64) int64 { return i/per*chunkBytes + i%per*slotBytes }
}

// Scan reads the header of every slot position for payloads of
// payloadBytes in the files, with O_DIRECT and workers reads in flight,
// and returns the slots whose header decodes and names a payload of that
// size, in file order.
func Scan(paths []string, chunkBytes, payloadBytes int64, workers int) ([]Slot, error) {
	stride := slot.Size(payloadBytes)
	var out []Slot
	for _, p := range paths {
		found, err := scanFile(p, chunkBytes, stride, payloadBytes, max(workers, 1))
		if err != nil {
			return nil, err
		}
		out = append(out, found...)
	}
	return out, nil
}

func scanFile(path string, chunkBytes, stride, payloadBytes int64, workers int) ([]Slot, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	f, err := vfs.Default.OpenFile(path, 0, true)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	n, at := Positions(st.Size(), chunkBytes, stride)
	found := make([]*Slot, n)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for w := range workers {
		wg.Go(func() {
			buf, err := vfs.AlignedBuffer(slot.HeaderSize)
			if err != nil {
				mu.Lock()
				first = err
				mu.Unlock()
				return
			}
			defer vfs.FreeBuffer(buf)
			for i := int64(w); i < n; i += int64(workers) {
				if _, err := f.ReadAt(buf, at(i)); err != nil {
					mu.Lock()
					first = err
					mu.Unlock()
					return
				}
				h, err := slot.Decode(buf)
				if err != nil || int64(h.PayloadLen) != payloadBytes {
					continue
				}
				found[i] = &Slot{Path: path, Off: at(i), Hash: append([]byte(nil), h.Key()...)}
			}
		})
	}
	wg.Wait()
	if first != nil {
		return nil, first
	}
	var out []Slot
	for _, s := range found {
		if s != nil {
			out = append(out, *s)
		}
	}
	return out, nil
}
