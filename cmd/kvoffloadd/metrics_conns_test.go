package main

import (
	"bufio"
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestMetricsConnectionsAreBounded: a client of the metrics address that
// opens connections and keeps them (keep-alive, never closed) made the
// daemon hold a goroutine and a descriptor each, without bound. The real
// daemon answers maxMetricsConns of 200 such connections; the rest wait
// (in the listen queue) until one of those closes, its descriptors stay
// bounded, and its gRPC socket serves meanwhile.
func TestMetricsConnectionsAreBounded(t *testing.T) {
	bin := buildDaemon(t)
	metrics := freePort(t)
	sock := filepath.Join(t.TempDir(), "d.sock")
	proc, c, _ := startDaemon(t, bin, "--socket", sock, "--metrics-addr", metrics, "--cpu-bytes", "16MiB", "--cpu-chunk-bytes", "4MiB")
	fds := func() int {
		es, err := os.ReadDir("/proc/" + strconv.Itoa(proc.Process.Pid) + "/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(es)
	}
	before := fds()
	const n = 200
	conns := make([]net.Conn, n)
	for i := range conns {
		cn, err := net.Dial("tcp", metrics)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cn.Close() })
		if _, err := cn.Write([]byte("GET /metrics HTTP/1.1\r\nHost: kvoffloadd\r\n\r\n")); err != nil {
			t.Fatal(err)
		}
		conns[i] = cn
	}
	// answered reports whether cn's reply starts within wait.
	answered := func(cn net.Conn, wait time.Duration) bool {
		cn.SetReadDeadline(time.Now().Add(wait))
		line, err := bufio.NewReader(cn).ReadString('\n')
		return err == nil && strings.HasPrefix(line, "HTTP/1.1 200")
	}
	var served, waiting []net.Conn
	for _, cn := range conns {
		wait := 50 * time.Millisecond
		if len(served) < maxMetricsConns {
			wait = 5 * time.Second // the first ones the daemon accepts answer
		}
		if answered(cn, wait) {
			served = append(served, cn)
		} else {
			waiting = append(waiting, cn)
		}
	}
	if len(served) != maxMetricsConns {
		t.Fatalf("%d of %d kept connections answered, want %d", len(served), n, maxMetricsConns)
	}
	if extra := fds() - before; extra > maxMetricsConns+4 {
		t.Fatalf("the daemon holds %d more descriptors with %d metrics connections open, want at most %d", extra, n, maxMetricsConns+4)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Stats(sctx); err != nil {
		t.Fatalf("Stats over the socket while the metrics address is full: %v", err)
	}
	// One closes: a waiting one is answered.
	served[0].Close()
	got := false
	for _, cn := range waiting {
		if answered(cn, time.Second) {
			got = true
			break
		}
	}
	if !got {
		t.Fatal("no waiting metrics connection answered after one closed")
	}
}
