package disk_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// Failures that are not the slot's own transfer failing never quarantine
// it: a request refused as invalid, one made after Close, and a write
// refused because its chunk map could not be saved first (EIO on the small
// file: the slot was never touched). TestFaultKinds covers the device
// faults.
func TestShouldQuarantine(t *testing.T) {
	inner := vfs.NewMem()
	efs, err := errorfs.New(inner, errorfs.Options{Plan: errorfs.Plan{WriteEIO: 1},
		Match: func(p string) bool { return strings.HasSuffix(p, ".chunks.tmp") }})
	if err != nil {
		t.Fatal(err)
	}
	efs.Pause() // Open saves the maps
	cfg := disk.Config{Dirs: []string{"/disk/a"}, BytesPerDir: 2 * chunk, ChunkBytes: chunk, FS: efs, Direct: true, Logger: quiet()}
	tier := open(t, cfg)
	b := newBlock(1, 9000, 32)
	s := alloc(t, tier, 9000, []block{b})[0]

	efs.Resume()
	mapErr := writeBlock(t, tier, s, b)
	efs.Pause()
	if !errors.Is(mapErr, disk.ErrIO) || !strings.Contains(mapErr.Error(), "chunk map") {
		t.Fatalf("write with the chunk map failing: %v", mapErr)
	}
	short := arena(t, layout.AlignUp(b.meta.PayloadLen)+4096)
	invalidErr := readSync(tier, s, b.meta, short)
	if !errors.Is(invalidErr, disk.ErrInvalid) {
		t.Fatalf("read into a buffer of the wrong size: %v", invalidErr)
	}
	if err := writeBlock(t, tier, s, b); err != nil {
		t.Fatalf("the slot, once its chunk is mapped: %v", err)
	}
	tier.Unpin(s)
	tier.Close()
	closedErr := readSync(tier, s, b.meta, arena(t, layout.AlignUp(b.meta.PayloadLen)))
	if !errors.Is(closedErr, disk.ErrClosed) {
		t.Fatalf("read after Close: %v", closedErr)
	}
	for _, err := range []error{mapErr, invalidErr, closedErr} {
		if disk.ShouldQuarantine(err) {
			t.Errorf("ShouldQuarantine(%v) = true", err)
		}
	}
}
