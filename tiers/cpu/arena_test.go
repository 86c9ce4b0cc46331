package cpu

import (
	"bufio"
	"bytes"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

// vmStatus reads a field of /proc/self/status (VmRSS, VmLck, ...) in bytes.
func vmStatus(t *testing.T, field string) uint64 {
	t.Helper()
	f, err := os.Open("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no %s in /proc/self/status", field)
	return 0
}

// TestArenaLocksOnFault: mapping and locking the arena does not fault in
// (and zero) every page before the daemon can serve (a plain mlock does);
// populate then backs all of it, and it stays locked.
func TestArenaLocksOnFault(t *testing.T) {
	const size = 256 << 20
	before := vmStatus(t, "VmRSS")
	mem, locked, err := mapArena(size, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unmap(mem) }()
	if !locked {
		t.Skip("RLIMIT_MEMLOCK too low to lock the arena here")
	}
	if got := vmStatus(t, "VmRSS") - before; got > size/4 {
		t.Fatalf("locking the arena faulted in %d bytes at once, want its pages locked as they are touched", got)
	}
	var backed atomic.Uint64
	populate(mem, &backed, make(chan struct{}), slog.Default())
	if backed.Load() != size {
		t.Fatalf("populate reports %d bytes backed, want %d", backed.Load(), size)
	}
	if got := vmStatus(t, "VmRSS") - before; got < size*9/10 {
		t.Fatalf("after populate %d bytes are resident, want the whole %d-byte arena", got, size)
	}
	if got := vmStatus(t, "VmLck"); got < size {
		t.Fatalf("%d bytes locked, want the whole %d-byte arena", got, size)
	}
}

// TestPopulateKeepsBytes: backing the arena in the background never
// changes bytes a copy already wrote.
func TestPopulateKeepsBytes(t *testing.T) {
	tr, err := New(Config{Bytes: 256 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	want := bytes.Repeat([]byte("kv"), 1<<20)
	mem := tr.Mem()
	for off := 0; off+len(want) <= len(mem); off += 16 << 20 {
		copy(mem[off:], want)
	}
	<-tr.Populated()
	if got := tr.BackedBytes(); got != uint64(len(mem)) {
		t.Fatalf("BackedBytes = %d once populated, want the arena's %d", got, len(mem))
	}
	for off := 0; off+len(want) <= len(mem); off += 16 << 20 {
		if !bytes.Equal(mem[off:off+len(want)], want) {
			t.Fatalf("bytes at %d changed while the arena was populated", off)
		}
	}
}

// TestCloseWhilePopulating: Close stops the populating goroutine and waits
// for it before it unmaps the arena.
func TestCloseWhilePopulating(t *testing.T) {
	defer leakcheck.VerifyNone(t)
	for range 3 {
		tr, err := New(Config{Bytes: 1 << 30})
		if err != nil {
			t.Fatal(err)
		}
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
	}
}
