package disk_test

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
)

// Two tiers on one directory would overwrite each other's slots: the
// second Open is refused, naming the directory, while the first runs;
// once the first closes, the directory can be opened again.
func TestSecondOpenRefused(t *testing.T) {
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			cfg := be.config(2, 4*chunk)
			first := open(t, cfg)

			// The same directories, and a set that shares one of them.
			for _, tc := range []struct {
				dirs   []string
				shared string
			}{{cfg.Dirs, cfg.Dirs[0]}, {[]string{filepath.Join(be.root, "other"), cfg.Dirs[1]}, cfg.Dirs[1]}} {
				c := cfg
				c.Dirs = tc.dirs
				second, err := disk.Open(c)
				if err == nil {
					second.Close()
					t.Fatalf("a second tier opened on %v while the first runs", tc.dirs)
				}
				if !strings.Contains(err.Error(), "in use by another") || !strings.Contains(err.Error(), tc.shared) {
					t.Errorf("refusal %q does not say that %s is in use", err, tc.shared)
				}
			}
			// The refused opens left the first tier whole.
			b := newBlock(1, 5000, 32)
			s := alloc(t, first, 5000, []block{b})[0]
			if err := writeBlock(t, first, s, b); err != nil {
				t.Fatal(err)
			}
			if err := readBlock(t, first, s, b); err != nil {
				t.Fatal(err)
			}
			first.Unpin(s)
			if err := first.Close(); err != nil {
				t.Fatal(err)
			}
			again := open(t, cfg)
			if got := recovered(t, again); len(got) != 1 {
				t.Errorf("after the first tier closed, the directory reopened with %d blocks, want 1", len(got))
			}
		})
	}
}

// A symbolic link planted at the name of any file the tier keeps in its
// directory is never followed: Open refuses, naming it, and neither the
// link nor what it points at is touched.
func TestSymlinkRefused(t *testing.T) {
	be := backends(t)[0] // symbolic links live on a real filesystem
	for _, name := range []string{"kvoffload-0.slots", "kvoffload-0.chunks", "kvoffload-0.namespaces",
		"kvoffload-0.chunks.tmp", "kvoffload-0.namespaces.tmp", "kvoffload.lock"} {
		t.Run(name, func(t *testing.T) {
			cfg := be.config(1, 4*chunk)
			cfg.Dirs = []string{filepath.Join(t.TempDir(), "nvme0")}
			if err := os.Mkdir(cfg.Dirs[0], 0o700); err != nil {
				t.Fatal(err)
			}
			victim := filepath.Join(t.TempDir(), "victim")
			precious := []byte("someone else's file\n")
			if err := os.WriteFile(victim, precious, 0o600); err != nil {
				t.Fatal(err)
			}
			link := filepath.Join(cfg.Dirs[0], name)
			if err := os.Symlink(victim, link); err != nil {
				t.Fatal(err)
			}
			tier, err := disk.Open(cfg)
			if err == nil {
				tier.Close()
				t.Errorf("Open followed or replaced a symbolic link at %s", name)
			} else if !strings.Contains(err.Error(), "symbolic link") || !strings.Contains(err.Error(), link) {
				t.Errorf("refusal %q does not name the link", err)
			}
			if b, err := os.ReadFile(victim); err != nil || !bytes.Equal(b, precious) {
				t.Errorf("the link's target changed: %d bytes (was %d), %v", len(b), len(precious), err)
			}
			if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
				t.Errorf("the link itself was replaced or removed: %v, %v", fi, err)
			}
		})
	}
}
