package vfs_test

import (
	"bytes"
	"errors"
	"io"
	"path/filepath"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// ReadvAt fills the buffers back to back, with one call on the OS (direct
// when the directory takes it) and a ReadAt per buffer elsewhere, and
// reports a short read at the end of the file.
func TestReadvAt(t *testing.T) {
	for _, tc := range []struct {
		name   string
		fs     vfs.FS
		dir    string
		direct bool
	}{
		{"os", vfs.Default, t.TempDir(), vfs.ProbeDirect(t.TempDir()) == nil},
		{"mem", vfs.NewMem(), "/m", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.fs.MkdirAll(tc.dir, 0o700); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(tc.dir, "f")
			f, err := tc.fs.OpenFile(path, 5*4096, tc.direct)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			src := alignedBuf(t, 5*4096)
			for i := range src {
				src[i] = byte(i * 7)
			}
			if _, err := f.WriteAt(src, 0); err != nil {
				t.Fatal(err)
			}
			if _, ok := f.(vfs.ReaderVAt); ok != (tc.name == "os") {
				t.Errorf("%s file implements ReaderVAt: %v", tc.name, ok)
			}
			a, b := alignedBuf(t, 4096), alignedBuf(t, 2*4096)
			n, err := vfs.ReadvAt(f, [][]byte{a, b}, 4096)
			if err != nil || n != 3*4096 {
				t.Fatalf("ReadvAt: %d, %v", n, err)
			}
			if !bytes.Equal(a, src[4096:2*4096]) || !bytes.Equal(b, src[2*4096:4*4096]) {
				t.Fatal("ReadvAt read other bytes")
			}
			// Past the end: the bytes that are there, then an error.
			c := alignedBuf(t, 4096)
			n, err = vfs.ReadvAt(f, [][]byte{a, b, c}, 3*4096)
			if n != 2*4096 || err == nil || (!errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF)) {
				t.Fatalf("ReadvAt past the end: %d, %v", n, err)
			}
		})
	}
}
