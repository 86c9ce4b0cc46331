package main

import (
	"bytes"
	"compress/gzip"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
)

// TestDebugMemoryEndpoints: /metrics comes uncompressed even when gzip is
// asked for; with --debug-checks the real daemon runs a
// collection on POST /debug/gc (GET is refused) and serves its heap
// profile on /debug/heap (gzipped protobuf with the heap's sample types,
// what `go tool pprof` reads); without the flag neither exists.
func TestDebugMemoryEndpoints(t *testing.T) {
	bin := buildDaemon(t)
	dir := t.TempDir()
	for _, debug := range []bool{true, false} {
		metrics := freePort(t)
		sock := filepath.Join(dir, "d.sock")
		args := []string{"--socket", sock, "--metrics-addr", metrics, "--cpu-bytes", "16MiB", "--cpu-chunk-bytes", "4MiB"}
		if debug {
			args = append(args, "--debug-checks")
		}
		proc, c, exited := startDaemon(t, bin, args...)
		storeOne(t, c, testenv.Model{Layers: 1, SegBytes: 64 << 10, Blocks: 2}, "debug-endpoints", 1)
		get := func(method, path string) (int, []byte) {
			t.Helper()
			req, _ := http.NewRequest(method, "http://"+metrics+path, nil)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, b
		}
		// /metrics is never compressed, even when asked (Go's client asks
		// by default): a pooled gzip writer holds about 1.2 MB.
		req, _ := http.NewRequest(http.MethodGet, "http://"+metrics+"/metrics", nil)
		req.Header.Set("Accept-Encoding", "gzip")
		resp, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if enc := resp.Header.Get("Content-Encoding"); enc != "" || !strings.Contains(string(body), "kvoffload_") {
			t.Fatalf("/metrics asked for gzip: Content-Encoding %q, %d bytes", enc, len(body))
		}
		code, _ := get(http.MethodPost, "/debug/gc")
		if !debug {
			if code != http.StatusNotFound {
				t.Fatalf("POST /debug/gc without --debug-checks: %d", code)
			}
			if code, _ := get(http.MethodGet, "/debug/heap"); code != http.StatusNotFound {
				t.Fatalf("GET /debug/heap without --debug-checks: %d", code)
			}
		} else {
			if code != http.StatusOK {
				t.Fatalf("POST /debug/gc: %d", code)
			}
			if code, _ := get(http.MethodGet, "/debug/gc"); code != http.StatusMethodNotAllowed {
				t.Fatalf("GET /debug/gc: %d, want 405", code)
			}
			code, body := get(http.MethodGet, "/debug/heap")
			if code != http.StatusOK {
				t.Fatalf("GET /debug/heap: %d", code)
			}
			zr, err := gzip.NewReader(bytes.NewReader(body))
			if err != nil {
				t.Fatalf("/debug/heap is not a gzipped profile: %v", err)
			}
			raw, err := io.ReadAll(zr)
			if err != nil {
				t.Fatal(err)
			}
			// The profile's string table names its sample types.
			if !strings.Contains(string(raw), "inuse_space") || !strings.Contains(string(raw), "alloc_objects") {
				t.Fatalf("/debug/heap holds no heap profile (%d bytes)", len(raw))
			}
		}
		proc.Process.Kill()
		<-exited
	}
}
