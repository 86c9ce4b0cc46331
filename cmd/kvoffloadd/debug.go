package main

import (
	"context"
	"fmt"
	"net/http"
	"runtime"
	"runtime/pprof"
	"strconv"
	"sync"
	"time"

	"github.com/kvoffloadd/kvoffloadd/offload"
)

// mountDebug adds the --debug-checks endpoints to the metrics server's mux.
// They exist for tests that drive the real binary from outside (the
// model-based test, e2e/model): the in-process checks the package tests call
// are otherwise out of their reach.
//
//	/debug/check       once the daemon is quiet (no job or disk write in
//	                   flight; the caller arranges that), runs
//	                   offload.CheckInvariants (slots, pins, leases,
//	                   policies, classes and result queues against the
//	                   index): 200 "ok", or 500 with what disagrees.
//	/debug/goroutines  every goroutine's stack (runtime/pprof, debug=1), to
//	                   name a leak.
//	/debug/heap        the heap profile after a garbage collection
//	                   (runtime/pprof, for `go tool pprof`): what holds
//	                   the memory per block kvbench's scale scenario
//	                   reports.
//	/debug/gc          POST runs a garbage collection and returns once it
//	                   is done: the Go heap metrics then say what is live,
//	                   not what garbage the last cycle left (kvbench's
//	                   scale scenario reads the heap per block so).
//	/debug/cpu-recovery  with --debug-hold-cpu-recovery, POST ?chunks=N lets
//	                   the CPU arena's recovery verify and file N more
//	                   chunks, ?chunks=all lets it run to its end (a test
//	                   invalidates and stops the daemon while it is held).
func mountDebug(mux *http.ServeMux, svc *offload.Service, gate *recoveryGate) {
	mux.HandleFunc("/debug/cpu-recovery", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "POST ?chunks=N or ?chunks=all", http.StatusMethodNotAllowed)
			return
		}
		if gate == nil {
			http.Error(w, "the daemon runs without --debug-hold-cpu-recovery", http.StatusConflict)
			return
		}
		v := r.URL.Query().Get("chunks")
		if v == "all" {
			gate.open()
			fmt.Fprintln(w, "ok")
			return
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxGateChunks {
			http.Error(w, fmt.Sprintf("chunks: want 1..%d or all", maxGateChunks), http.StatusBadRequest)
			return
		}
		gate.let(n)
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/debug/check", func(w http.ResponseWriter, r *http.Request) {
		wait := 5 * time.Second
		if v := r.URL.Query().Get("wait"); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 || d > time.Minute {
				http.Error(w, "wait: want a duration up to 1m", http.StatusBadRequest)
				return
			}
			wait = d
		}
		if err := checkQuiet(r.Context(), svc, wait); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/debug/gc", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "POST runs a garbage collection", http.StatusMethodNotAllowed)
			return
		}
		runtime.GC()
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/debug/heap", func(w http.ResponseWriter, r *http.Request) {
		runtime.GC()
		w.Header().Set("Content-Type", "application/octet-stream")
		pprof.Lookup("heap").WriteTo(w, 0)
	})
	mux.HandleFunc("/debug/goroutines", func(w http.ResponseWriter, r *http.Request) {
		debug := 1
		if v, err := strconv.Atoi(r.URL.Query().Get("debug")); err == nil && v >= 0 && v <= 2 {
			debug = v
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		pprof.Lookup("goroutine").WriteTo(w, debug)
	})
}

// maxGateChunks bounds the chunks one /debug/cpu-recovery call lets go.
const maxGateChunks = 1 << 16

// recoveryGate holds the CPU arena's recovery before each chunk
// (--debug-hold-cpu-recovery) until /debug/cpu-recovery lets it go on;
// nil without the flag. It opens for good at the daemon's stop, so a held
// recovery never holds up the shutdown.
type recoveryGate struct {
	tokens   chan struct{} // one per chunk let go
	opened   chan struct{}
	openOnce sync.Once
}

func newRecoveryGate(hold bool) *recoveryGate {
	if !hold {
		return nil
	}
	return &recoveryGate{tokens: make(chan struct{}, maxGateChunks), opened: make(chan struct{})}
}

// hook is the CPU recovery hook: test's (this package's tests), or the
// gate's wait, or none.
func (g *recoveryGate) hook(test func()) func() {
	if test != nil || g == nil {
		return test
	}
	return func() {
		select {
		case <-g.tokens:
		case <-g.opened:
		}
	}
}

// let lets n more chunks go (tokens past the buffer's room are dropped:
// maxGateChunks bounds a call).
func (g *recoveryGate) let(n int) {
	for range n {
		select {
		case g.tokens <- struct{}{}:
		default:
			return
		}
	}
}

// open lets everything go, from now on.
func (g *recoveryGate) open() {
	if g != nil {
		g.openOnce.Do(func() { close(g.opened) })
	}
}

// checkQuiet waits for queued disk writes to land, then runs the
// service's invariant check (offload.CheckInvariants) until it passes or
// wait has passed. Settling takes a moment even in a quiet daemon (an
// erase's pin drops when its zeroed header lands, the policies evict on
// their own goroutines), so a mismatch counts only if it persists.
func checkQuiet(ctx context.Context, svc *offload.Service, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	if err := svc.FlushDisk(ctx); err != nil {
		return fmt.Errorf("disk writes still queued after %s: %w", wait, err)
	}
	for {
		err := svc.CheckInvariants()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(10 * time.Millisecond):
		}
	}
}
