package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// refusingFS fails the creation of the files its match names with errno,
// as a read-only or full directory would.
type refusingFS struct {
	vfs.FS
	match string
	errno syscall.Errno
}

func (f refusingFS) OpenFile(path string, size int64, direct bool) (vfs.File, error) {
	if strings.HasSuffix(path, f.match) {
		return nil, &os.PathError{Op: "open", Path: path, Err: f.errno}
	}
	return f.FS.OpenFile(path, size, direct)
}

// TestCatalogSaveErrorCodes: a Register whose namespace cannot be recorded
// in the disk tier's catalog fails with the code that says whose fault it
// is and whether to retry (codes.go's guidance), never INTERNAL, and the
// namespace is not created.
func TestCatalogSaveErrorCodes(t *testing.T) {
	plan := func(spec string) vfs.FS {
		p, err := errorfs.ParsePlan(spec)
		if err != nil {
			t.Fatal(err)
		}
		fs, err := errorfs.New(vfs.Default, errorfs.Options{Plan: p, Match: func(path string) bool {
			return strings.HasSuffix(path, ".namespaces.tmp")
		}})
		if err != nil {
			t.Fatal(err)
		}
		return fs
	}
	cases := []struct {
		name string
		fs   vfs.FS
		want codes.Code
	}{
		{"enospc", plan("enospc=1"), codes.ResourceExhausted},
		{"edquot", refusingFS{vfs.Default, ".namespaces.tmp", syscall.EDQUOT}, codes.ResourceExhausted},
		{"read-only", refusingFS{vfs.Default, ".namespaces.tmp", syscall.EROFS}, codes.FailedPrecondition},
		{"permission", refusingFS{vfs.Default, ".namespaces.tmp", syscall.EACCES}, codes.FailedPrecondition},
		{"eio", plan("write-eio=1"), codes.Unavailable},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			o := diskOpts(t.TempDir())
			o.DiskFS = tc.fs
			d := testenv.Start(t, o)
			c := d.Client(t)
			r := testenv.NewRegion(t, small.RegionBytes())
			_, err := c.Register(ctx(t), []byte("catalog-"+tc.name), small.Layout(), small.Regions(r), t.Name())
			if got := status.Code(err); got != tc.want {
				t.Fatalf("Register with the catalog failing (%s): %v (code %v), want %v", tc.name, err, got, tc.want)
			}
			if !strings.Contains(err.Error(), "catalog") {
				t.Errorf("message %q does not say what failed", err)
			}
			if ids, err := c.Resolve(ctx(t), []byte("catalog-"+tc.name)); err != nil || ids[0] != 0 {
				t.Errorf("a namespace the catalog could not record exists: %v %v", ids, err)
			}
		})
	}
}

// TestChunkMapFailureQuarantinesNothing: a disk write that fails because
// the chunk map could not be saved first (EIO on the small file, not on
// the slot) leaves the slot healthy: it is freed, not quarantined, and
// the same chunk is written once the map can be saved.
func TestChunkMapFailureQuarantinesNothing(t *testing.T) {
	p, _ := errorfs.ParsePlan("write-eio=1")
	fs, err := errorfs.New(vfs.Default, errorfs.Options{Plan: p, Match: func(path string) bool {
		return filepath.Ext(path) == ".tmp" && strings.Contains(path, ".chunks")
	}})
	if err != nil {
		t.Fatal(err)
	}
	fs.Pause() // the maps are saved at start
	o := diskOpts(t.TempDir())
	o.WriteThrough = true
	o.DiskFS = fs
	d := testenv.Start(t, o)
	e := register(t, d, small, "chunk-map")
	fs.Resume()
	stored := storeMany(t, e, 11, 8)
	flush(t, d)
	if q := d.Svc.Disk().Quarantined(); q != 0 {
		t.Fatalf("%d healthy slots quarantined after chunk-map saves failed", q)
	}
	if sumCounts(fs) == 0 {
		t.Fatal("no chunk-map save failed")
	}
	if lr := e.lookup(t, stored); int(lr.Ready) != len(stored) || lr.Tiers[0] != pb.Tier_TIER_CPU {
		t.Fatalf("after failed disk writes: %+v", lr)
	}
	fs.Pause()
	more := storeMany(t, e, 12, 4)
	flush(t, d)
	if _, blocks := d.Svc.Disk().Usage(); blocks != uint64(len(more)) {
		t.Fatalf("with the map saved again, %d blocks on disk, want %d", blocks, len(more))
	}
	if err := d.Svc.CheckAccounting(); err != nil {
		t.Fatal(err)
	}
}
