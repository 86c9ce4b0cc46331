package testenv

import (
	"io"
	"os"
	"path/filepath"
	"testing"
)

// CopyDir copies the regular files of dir into a new directory: the files
// as a kill -9 at this instant would leave them (written data is in the
// page cache; what is still queued is not).
func CopyDir(t testing.TB, dir string) string {
	t.Helper()
	out := t.TempDir()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, ent := range ents {
		if !ent.Type().IsRegular() {
			continue
		}
		src, err := os.Open(filepath.Join(dir, ent.Name()))
		if err != nil {
			t.Fatal(err)
		}
		dst, err := os.Create(filepath.Join(out, ent.Name()))
		if err != nil {
			src.Close()
			t.Fatal(err)
		}
		_, err = io.Copy(dst, src)
		src.Close()
		if err != nil {
			t.Fatal(err)
		}
		if err := dst.Close(); err != nil {
			t.Fatal(err)
		}
	}
	return out
}
