package disk_test

import (
	"errors"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// spaceFS reports the free space a test sets, per directory's parent (its
// device).
type spaceFS struct {
	vfs.FS
	free map[string]uint64
}

func (s spaceFS) Space(dir string) (vfs.Space, error) {
	parent := filepath.Dir(dir)
	return vfs.Space{Dev: uint64(len(parent)), Free: s.free[parent], Total: 1 << 30}, nil
}

// TestOpenRefusesWhatDoesNotFit: slot files that their filesystem cannot
// hold with the reserve (5% of 1GiB here: 51.2MiB) left free are refused
// before any is created; directories on one filesystem share it; a tier
// that takes nothing more opens however full the disk has become.
func TestOpenRefusesWhatDoesNotFit(t *testing.T) {
	mem := vfs.NewMem()
	sfs := spaceFS{FS: mem, free: map[string]uint64{"/a": 100 << 20, "/bb": 150 << 20}}
	cfg := func(dirs ...string) disk.Config {
		return disk.Config{Dirs: dirs, BytesPerDir: 64 << 20, ChunkBytes: chunk, FS: sfs, Direct: true, Logger: quiet()}
	}
	_, err := disk.Open(cfg("/a/nvme0"))
	if !errors.Is(err, disk.ErrNoSpace) || !strings.Contains(err.Error(), "need 64MiB more, and the filesystem has 100MiB free, of which the tier leaves 51.2MiB (5% of its 1GiB, at most 1GiB); at most 48MiB per directory fits there") {
		t.Fatalf("64MiB with 100MiB free: %v", err)
	}
	if _, err := mem.Stat("/a/nvme0/kvoffload-0.slots"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a refused tier created its slot file: %v", err)
	}
	// Two directories on one filesystem: 128MiB do not fit in 150MiB less
	// the reserve; on two, each fits.
	if _, err := disk.Open(cfg("/bb/x", "/bb/y")); !errors.Is(err, disk.ErrNoSpace) || !strings.Contains(err.Error(), "/bb/x, /bb/y: 2 slot file(s)") {
		t.Fatalf("two directories sharing 150MiB: %v", err)
	}
	sfs.free["/a"] = 150 << 20
	tier, err := disk.Open(cfg("/a/nvme0", "/bb/y"))
	if err != nil {
		t.Fatal(err)
	}
	tier.Close()
	// The disk filled by others meanwhile: the same tier takes nothing
	// more, and opens.
	sfs.free["/a"], sfs.free["/bb"] = 0, 0
	tier, err = disk.Open(cfg("/a/nvme0", "/bb/y"))
	if err != nil {
		t.Fatalf("reopening a tier that takes no more space on a full disk: %v", err)
	}
	tier.Close()
}
