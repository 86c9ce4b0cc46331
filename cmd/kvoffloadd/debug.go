package main

import (
	"context"
	"fmt"
	"net/http"
	"runtime/pprof"
	"strconv"
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
func mountDebug(mux *http.ServeMux, svc *offload.Service) {
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
	mux.HandleFunc("/debug/goroutines", func(w http.ResponseWriter, r *http.Request) {
		debug := 1
		if v, err := strconv.Atoi(r.URL.Query().Get("debug")); err == nil && v >= 0 && v <= 2 {
			debug = v
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		pprof.Lookup("goroutine").WriteTo(w, debug)
	})
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
