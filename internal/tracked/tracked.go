// Package tracked tells a build output from a source file, so that the test
// suite fails when a binary, a test binary, a profile or an oversized file is
// committed (a `go build` run inside a package directory leaves its binary
// there, and .gitignore alone only keeps out what it names).
//
// Deliberate large files (test data a test needs whole) are listed, one path
// a line, in the repository's .tracked-large.
package tracked

import (
	"bytes"
	"path"
	"strings"
)

// MaxSize is the size past which a tracked file must be listed in
// .tracked-large.
const MaxSize = 1 << 20

// HeadLen is how many leading bytes Check needs to recognise a binary.
const HeadLen = 64

// magics are the leading bytes of the executable and object formats a Go,
// cgo or Python build writes.
var magics = []struct {
	prefix []byte
	what   string
}{
	{[]byte("\x7fELF"), "an ELF executable or object"},
	{[]byte("\xcf\xfa\xed\xfe"), "a Mach-O binary"},
	{[]byte("\xce\xfa\xed\xfe"), "a Mach-O binary"},
	{[]byte("\xfe\xed\xfa\xcf"), "a Mach-O binary"},
	{[]byte("\xfe\xed\xfa\xce"), "a Mach-O binary"},
	{[]byte("\xca\xfe\xba\xbe"), "a universal Mach-O binary or a Java class"},
	{[]byte("!<arch>\n"), "an ar archive (a Go or C static library)"},
	{[]byte("\x00asm"), "a WebAssembly module"},
	{[]byte("go object "), "a Go object file"},
}

// names are file names that only a build or a profiler writes.
var names = []struct {
	match func(base string) bool
	what  string
}{
	{func(b string) bool { return strings.HasSuffix(b, ".test") }, "a Go test binary"},
	{func(b string) bool { return strings.HasSuffix(b, ".prof") || strings.HasSuffix(b, ".pprof") }, "a profile"},
	{func(b string) bool {
		return strings.HasSuffix(b, ".coverprofile") || b == "coverage.out" || b == "cover.out"
	}, "a coverage profile"},
	{func(b string) bool { return strings.HasSuffix(b, ".pyc") }, "compiled Python"},
}

// Check says why the tracked file at p (slash-separated, relative to the
// repository root), of the given size and starting with head, is a build
// output, or "" when it is not. large lists the paths allowed past MaxSize.
func Check(p string, size int64, head []byte, large map[string]bool) string {
	base := path.Base(p)
	for _, n := range names {
		if n.match(base) {
			return n.what
		}
	}
	if strings.Contains("/"+p, "/__pycache__/") {
		return "compiled Python"
	}
	for _, m := range magics {
		if bytes.HasPrefix(head, m.prefix) {
			return m.what
		}
	}
	// A PE executable starts with MZ; a text file could too, so ask for the
	// binary zero bytes its DOS header has.
	if bytes.HasPrefix(head, []byte("MZ")) && bytes.IndexByte(head, 0) >= 0 {
		return "a Windows PE executable"
	}
	if size > MaxSize && !large[p] {
		return "a file over 1 MiB not listed in .tracked-large"
	}
	return ""
}

// ParseLarge reads .tracked-large: one path a line; blank lines and lines
// starting with # are skipped.
func ParseLarge(data []byte) map[string]bool {
	out := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		out[line] = true
	}
	return out
}
