package host

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// threadsAt counts the process's threads at nice (or, with idle, in
// SCHED_IDLE), from /proc/self/task/*/stat, the main thread aside: a worker
// may run on it, and the runtime cannot end the main thread when a locked
// goroutine on it returns; it parks it for good instead, so it never runs
// another goroutine at the worker's priority either.
func threadsAt(t *testing.T, nice int, idle bool) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Skip(err)
	}
	n := 0
	for _, e := range ents {
		if e.Name() == strconv.Itoa(os.Getpid()) {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc/self/task", e.Name(), "stat"))
		if err != nil {
			continue // the thread is gone
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		// f[0] is field 3; nice is field 19, policy field 41.
		ni, _ := strconv.Atoi(f[16])
		pol, _ := strconv.Atoi(f[38])
		if (idle && pol == unix.SCHED_IDLE) || (!idle && ni == nice) {
			n++
		}
	}
	return n
}

// waitThreads waits until want threads are at the priority.
func waitThreads(t *testing.T, nice int, idle bool, want int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for threadsAt(t, nice, idle) != want {
		if time.Now().After(deadline) {
			t.Fatalf("%d threads at nice %d (idle %v), want %d", threadsAt(t, nice, idle), nice, idle, want)
		}
		time.Sleep(time.Millisecond)
	}
}

// The copy workers' threads, and only theirs, run at the configured
// priority, and go with the engine.
func TestWorkerPriority(t *testing.T) {
	cur, err := unix.Getpriority(unix.PRIO_PROCESS, 0)
	if err != nil || 20-cur >= 17 {
		t.Skipf("the test process already runs at nice %d", 20-cur)
	}
	for _, tc := range []struct {
		nice int
		idle bool
	}{{17, false}, {0, true}} {
		before := threadsAt(t, tc.nice, tc.idle)
		e := New(Config{Workers: 3, Nice: tc.nice, Idle: tc.idle})
		// One worker may be on the main thread, which is not counted.
		deadline := time.Now().Add(30 * time.Second)
		for n := threadsAt(t, tc.nice, tc.idle); n < before+2; n = threadsAt(t, tc.nice, tc.idle) {
			if time.Now().After(deadline) {
				t.Fatalf("%d threads at nice %d (idle %v) besides the main thread, want at least %d", n, tc.nice, tc.idle, before+2)
			}
			time.Sleep(time.Millisecond)
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		waitThreads(t, tc.nice, tc.idle, before)
	}
}

// Batches of many pieces, submitted at once from several goroutines, all
// land, each Done exactly once, and Submit never waits for the copies.
func TestManyBatches(t *testing.T) {
	dir := t.TempDir()
	const size = 8 << 20
	path := filepath.Join(dir, "region")
	if err := os.WriteFile(path, make([]byte, size), 0o600); err != nil {
		t.Fatal(err)
	}
	e := New(Config{ShmDir: dir, Workers: 2, Nice: 5})
	defer e.Close()
	arena := make([]byte, size)
	for i := range arena {
		arena[i] = byte(i * 7)
	}
	if err := e.SetArena(arena); err != nil {
		t.Fatal(err)
	}
	r, err := e.Open(dma.RegionSpec{ShmPath: path, NumBlocks: 1, SegmentBytes: size}, dma.Peer{UID: uint32(os.Getuid()), GID: uint32(os.Getgid())})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	const batches, per = 16, 64 // 16 batches of 64 copies of 8 KiB: 512 KiB each
	var wg sync.WaitGroup
	done := make([]int, batches)
	var mu sync.Mutex
	for b := range batches {
		var copies []dma.Copy
		for c := range per {
			off := uint64((b*per + c) * 8192)
			copies = append(copies, dma.Copy{Region: r, RegionOff: off, ArenaOff: off, Len: 8192})
		}
		wg.Add(1)
		go e.Submit(&dma.Batch{Copies: copies, Done: func(err error) {
			if err != nil {
				t.Errorf("batch %d: %v", b, err)
			}
			mu.Lock()
			done[b]++
			mu.Unlock()
			wg.Done()
		}})
	}
	wg.Wait()
	for b, n := range done {
		if n != 1 {
			t.Errorf("batch %d: Done called %d times", b, n)
		}
	}
	got := r.(*region).mem
	for i := range got {
		if got[i] != arena[i] {
			t.Fatalf("byte %d: %d, want %d", i, got[i], arena[i])
		}
	}
	if e.QueueDepth() != 0 {
		t.Errorf("queue depth %d after every batch is done", e.QueueDepth())
	}
}
