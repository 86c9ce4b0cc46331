package offload_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// syncFailFS fails every Sync of the slot files (EIO); reads and writes
// pass.
type syncFailFS struct{ vfs.FS }

type syncFailFile struct{ vfs.File }

func (fs syncFailFS) OpenFile(path string, size int64, direct bool) (vfs.File, error) {
	f, err := fs.FS.OpenFile(path, size, direct)
	if err != nil || !strings.HasSuffix(path, ".slots") {
		return f, err
	}
	return syncFailFile{f}, nil
}

func (syncFailFile) Sync() error { return syscall.EIO }

// TestMarksStayUntilEveryCopyIsDurablyGone: a block invalidated in one
// run whose disk copy survived (the daemon was killed before the erase
// landed) must never come back, even when the next run's recovery cannot
// read its slot (a transient EIO), cannot erase it, or cannot sync the
// erase: that recovery keeps the invalidation marks, and the run after it
// erases the copy. Recovery used to drop the marks whenever it ended
// "done", and the intact copy was served from disk two starts later.
func TestMarksStayUntilEveryCopyIsDurablyGone(t *testing.T) {
	plan := func(spec string) vfs.FS {
		p, err := errorfs.ParsePlan(spec)
		if err != nil {
			t.Fatal(err)
		}
		fs, err := errorfs.New(vfs.Default, errorfs.Options{Plan: p, Match: func(path string) bool { return strings.HasSuffix(path, ".slots") }})
		if err != nil {
			t.Fatal(err)
		}
		return fs
	}
	for _, tc := range []struct {
		name  string
		fault func() vfs.FS
	}{
		{"read EIO", func() vfs.FS { return plan("read-eio=1") }},
		{"erase EIO", func() vfs.FS { return plan("write-eio=1") }},
		{"sync EIO", func() vfs.FS { return syncFailFS{vfs.Default} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := testenv.Model{Layers: 2, SegBytes: 16 << 10, Blocks: 16, HashBytes: 16}
			dir := t.TempDir()
			opts := func(fs vfs.FS) testenv.Options {
				return testenv.Options{Quiet: true, CPUBytes: 16 << 20, ChunkBytes: 4 << 20, DiskDirs: []string{dir}, DiskFS: fs, WriteThrough: true}
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			slotFile := filepath.Join(dir, "kvoffload-0.slots")
			hs := m.Hashes(1, 4)
			// start runs a daemon on dir; ready counts the blocks of hs
			// it offers.
			start := func(fs vfs.FS) (d *testenv.Daemon, c *client.Client, reg *pb.RegisterResponse, r *testenv.Region) {
				d = testenv.Start(t, opts(fs))
				r = testenv.NewRegion(t, m.RegionBytes())
				cl := d.Client(t)
				reg, err := cl.Register(ctx, []byte("marks"), m.Layout(), m.Regions(r), t.Name())
				if err != nil {
					t.Fatal(err)
				}
				return d, cl, reg, r
			}
			ready := func(c *client.Client, reg *pb.RegisterResponse, hs [][]byte) int {
				n := 0
				for _, h := range hs {
					lr, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, testenv.Keys(h), 0)
					if err != nil {
						t.Fatal(err)
					}
					n += int(lr.Ready)
				}
				return n
			}

			// Run 1 stores four blocks on disk and invalidates two, and
			// is killed before the erases land: the slot file as it
			// was, the catalog (with the marks) as the Invalidate left it.
			d1, c1, reg1, r1 := start(nil)
			for i, h := range hs {
				m.Fill(r1, i, h)
			}
			res, err := c1.Store(ctx, reg1.RegistrationId, []*pb.Job{testenv.Job(1, hs, testenv.Seq(0, 4))}, true)
			if err != nil || !res[0].Ok {
				t.Fatalf("store: %+v %v", res, err)
			}
			if err := d1.Svc.FlushDisk(ctx); err != nil {
				t.Fatal(err)
			}
			intact, err := os.ReadFile(slotFile)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c1.Invalidate(ctx, []uint32{reg1.NamespaceId}, testenv.Keys(hs[:2]...)); err != nil {
				t.Fatal(err)
			}
			if err := d1.Svc.FlushDisk(ctx); err != nil {
				t.Fatal(err)
			}
			d1.Stop(t)
			if err := os.WriteFile(slotFile, intact, 0o600); err != nil {
				t.Fatal(err)
			}

			// Run 2's recovery meets the fault.
			d2, c2, reg2, _ := start(tc.fault())
			if n := ready(c2, reg2, hs[:2]); n != 0 {
				t.Fatalf("the faulty run offers %d of the 2 invalidated blocks", n)
			}
			if st := d2.Svc.Disk().Recovery(); st.Missed+st.EraseFailed == 0 && tc.name != "sync EIO" {
				t.Fatalf("the faulty recovery missed nothing: %+v", st)
			}
			d2.Stop(t)
			if tc.name == "sync EIO" {
				// A power loss: the erases that were never synced are lost.
				if err := os.WriteFile(slotFile, intact, 0o600); err != nil {
					t.Fatal(err)
				}
			}

			// Run 3: the marks are still there, and erase the copies.
			d3, c3, reg3, _ := start(vfs.Default)
			if n := ready(c3, reg3, hs[:2]); n != 0 {
				t.Fatalf("%d of 2 blocks invalidated two starts ago came back from disk", n)
			}
			if n := ready(c3, reg3, hs[2:]); n != 2 {
				t.Fatalf("%d of the 2 blocks not invalidated came back, want 2", n)
			}
			if st := d3.Svc.Disk().Recovery(); st.Erased != 2 {
				t.Fatalf("the third start erased %d copies, want the 2 invalidated: %+v", st.Erased, st)
			}
		})
	}
}

// TestManyKeyMarksKeepTheRest: an Invalidate of more keys than the
// namespace keeps marks for one by one (1,100 here, past 1,024) costs the
// next start those keys' blocks, not the namespace's whole disk cache: the
// blocks not invalidated come back. The namespace used to be marked whole,
// and every block of it was erased at the next start.
func TestManyKeyMarksKeepTheRest(t *testing.T) {
	m := testenv.Model{Layers: 2, SegBytes: 16 << 10, Blocks: 32, HashBytes: 16}
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := func() (*testenv.Daemon, *client.Client, *pb.RegisterResponse, *testenv.Region) {
		d := testenv.Start(t, testenv.Options{Quiet: true, CPUBytes: 16 << 20, ChunkBytes: 4 << 20, DiskDirs: []string{dir}, WriteThrough: true})
		r := testenv.NewRegion(t, m.RegionBytes())
		c := d.Client(t)
		reg, err := c.Register(ctx, []byte("many-marks"), m.Layout(), m.Regions(r), t.Name())
		if err != nil {
			t.Fatal(err)
		}
		return d, c, reg, r
	}
	d1, c1, reg1, r1 := start()
	hs := m.Hashes(3, 20)
	for i, h := range hs {
		m.Fill(r1, i, h)
	}
	if res, err := c1.Store(ctx, reg1.RegistrationId, []*pb.Job{testenv.Job(1, hs, testenv.Seq(0, 20))}, true); err != nil || !res[0].Ok {
		t.Fatalf("store: %+v %v", res, err)
	}
	if err := d1.Svc.FlushDisk(ctx); err != nil {
		t.Fatal(err)
	}
	gone := append(m.Hashes(4, 1096), hs[:4]...)
	if _, err := c1.Invalidate(ctx, []uint32{reg1.NamespaceId}, testenv.Keys(gone...)); err != nil {
		t.Fatal(err)
	}
	if err := d1.Svc.FlushDisk(ctx); err != nil {
		t.Fatal(err)
	}
	d1.Stop(t)
	_, c2, reg2, _ := start()
	ready := 0
	for _, h := range hs {
		lr, err := c2.Lookup(ctx, []uint32{reg2.NamespaceId}, testenv.Keys(h), 0)
		if err != nil {
			t.Fatal(err)
		}
		if lr.Ready == 1 && h != nil {
			ready++
			for _, g := range hs[:4] {
				if string(g) == string(h) {
					t.Fatal("an invalidated block came back")
				}
			}
		}
	}
	if ready != 16 {
		t.Fatalf("%d of the 16 blocks not invalidated came back after an Invalidate of 1,100 keys", ready)
	}
}
