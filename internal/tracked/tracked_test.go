package tracked

import (
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	large := ParseLarge([]byte("# deliberate\n\ntestdata/big.bin\n"))
	for _, tc := range []struct {
		path    string
		size    int64
		head    string
		flagged bool
	}{
		{"cmd/kvoffloadd/kvoffloadd", 32 << 20, "\x7fELF\x02\x01\x01", true},
		{"cmd/kvoffloadd/main.go", 4000, "package main\n", false},
		{"lib/x.a", 100, "!<arch>\n__.PKGDEF", true},
		{"bin/tool", 100, "\xcf\xfa\xed\xfe\x07", true},
		{"x.exe", 100, "MZ\x90\x00\x03\x00", true},
		{"docs/MZ.md", 100, "MZ is a text file here", false},
		{"e2e/e2e.test", 10, "anything", true},
		{"cpu.prof", 10, "\x1f\x8b", true},
		{"coverage.out", 10, "mode: set\n", true},
		{"clients/python/kvoffload/__pycache__/x.cpython-311.pyc", 10, "\xa7\r\r\n", true},
		{"scripts/run.sh", 300, "#!/bin/sh\n", false},
		{"testdata/big.bin", 2 << 20, "data", false},
		{"testdata/other.bin", 2 << 20, "data", true},
		{"testdata/small.bin", MaxSize, "data", false},
	} {
		got := Check(tc.path, tc.size, []byte(tc.head), large)
		if (got != "") != tc.flagged {
			t.Errorf("Check(%q) = %q, want flagged=%v", tc.path, got, tc.flagged)
		}
	}
}

// TestNoBuildOutputsTracked fails when a committed (or staged) file is a
// binary, a test binary, a profile, or a file over 1 MiB not listed in
// .tracked-large: build outputs stay under ignored paths.
func TestNoBuildOutputsTracked(t *testing.T) {
	top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) || errors.Is(err, exec.ErrNotFound) {
			t.Skipf("not in a git checkout (%v): nothing is tracked", err)
		}
		t.Fatal(err)
	}
	root := strings.TrimSpace(string(top))
	list, err := exec.Command("git", "-C", root, "ls-files", "-z", "--cached").Output()
	if err != nil {
		t.Fatal(err)
	}
	large := map[string]bool{}
	if data, err := os.ReadFile(filepath.Join(root, ".tracked-large")); err == nil {
		large = ParseLarge(data)
	} else if !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	n := 0
	for _, p := range bytes.Split(list, []byte{0}) {
		if len(p) == 0 {
			continue
		}
		rel := string(p)
		f, err := os.Open(filepath.Join(root, filepath.FromSlash(rel)))
		if errors.Is(err, os.ErrNotExist) {
			continue // deleted in the work tree, not yet committed
		}
		if err != nil {
			t.Fatal(err)
		}
		st, err := f.Stat()
		if err != nil || !st.Mode().IsRegular() {
			f.Close()
			continue // a symlink target or submodule is not a file here
		}
		head := make([]byte, HeadLen)
		k, err := io.ReadFull(f, head)
		f.Close()
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
		n++
		if why := Check(rel, st.Size(), head[:k], large); why != "" {
			t.Errorf("%s (%d bytes) is tracked but is %s: remove it (git rm --cached) and let .gitignore cover it", rel, st.Size(), why)
		}
	}
	if n == 0 {
		t.Fatal("git ls-files listed no file")
	}
	for p := range large {
		if _, err := os.Stat(filepath.Join(root, filepath.FromSlash(p))); err != nil {
			t.Errorf(".tracked-large lists %s, which is not there: %v", p, err)
		}
	}
}
