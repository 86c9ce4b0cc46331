package corrupt

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// A file of two chunks, some slots written: Flip damages the payload of
// written slots only, leaving their headers valid, so that only the
// payload checksum can catch it.
func TestFlip(t *testing.T) {
	dir := t.TempDir()
	if err := vfs.ProbeDirect(dir); err != nil {
		t.Skip(err)
	}
	const chunk, payload = 64 << 10, 12 << 10
	stride := slot.Size(payload) // 16 KiB: 4 slots per chunk
	file := make([]byte, 2*chunk)
	written := map[int64][]byte{}
	for i, off := range []int64{0, 2 * stride, chunk + stride} {
		p := make([]byte, payload)
		for j := range p {
			p[j] = byte(i*31 + j)
		}
		h := slot.Header{Group: 0, Slot: uint64(off / 4096), Epoch: 1, Seq: uint64(i + 1)}
		if err := h.SetHash([]byte{byte(i + 1), 2, 3}); err != nil {
			t.Fatal(err)
		}
		h.SetPayload(p)
		if err := slot.Encode(h, file[off:off+slot.HeaderSize]); err != nil {
			t.Fatal(err)
		}
		copy(file[off+slot.HeaderSize:], p)
		written[off] = p
	}
	path := filepath.Join(dir, "kvoffload-0.slots")
	if err := os.WriteFile(path, file, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := New(dir, chunk, payload, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n, err := f.Flip(2)
	if err != nil || n != 2 || f.Flipped != 2 {
		t.Fatalf("Flip(2) = %d, %v (Flipped %d)", n, err, f.Flipped)
	}
	after, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	damaged := 0
	for off := int64(0); off < 2*chunk; off += 4096 {
		if p, ok := written[off]; ok {
			h, err := slot.Decode(after[off : off+slot.HeaderSize])
			if err != nil {
				t.Fatalf("header at %d no longer decodes: %v", off, err)
			}
			if slot.VerifyPayload(h, after[off+slot.HeaderSize:off+slot.HeaderSize+payload]) != nil {
				damaged++
			}
			off += int64(len(p)) // skip the payload pages
			continue
		}
		if string(after[off:off+4096]) != string(file[off:off+4096]) {
			t.Errorf("page at %d outside a written payload changed", off)
		}
	}
	// Two flips may land on the same slot.
	if damaged < 1 || damaged > 2 {
		t.Errorf("%d slots fail their payload checksum after 2 flips", damaged)
	}
}
