//go:build cuda

// Command gpucheck proves the CUDA path of kvoffloadd on a machine with a
// GPU, from the engine's side of the socket. scripts/gpu-check.sh runs it
// (through scripts/gpucheck/run.py); see docs/cuda.md. Subcommands:
//
//	gpucheck probe  --json FILE
//	    CUDA IPC between two processes without the daemon: this process
//	    allocates and fills device memory and exports it and an IPC event;
//	    a child process finds the device by UUID, opens both, checks the
//	    memory's device, pins a host buffer, reads the bytes after the
//	    event, writes new ones; this process checks them.
//	gpucheck bench  --socket S --json FILE [--min-ratio 0.9]
//	    Through a running daemon, for consecutive and for scattered blocks:
//	    a store behind an engine stream that is still writing the blocks
//	    (ready event), a load behind a stream still reading its destination
//	    blocks, every byte compared; then store and load throughput beside
//	    plain pinned cuMemcpy*Async of the same bytes, in the same run.
//	gpucheck sticky --socket S --json FILE
//	    Against a daemon started with --cuda-fault-after-batches: stores
//	    until the daemon's context is lost, and checks the job failed
//	    (DMA_ERROR) and the daemon stopped serving.
//
// Each writes one JSON object to --json and prints one line per figure. Exit
// status: 0 pass, 1 a failure (mismatch, failed call), 2 a throughput ratio
// below --min-ratio.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"runtime"
	"time"
)

// result is what a subcommand reports, written as JSON.
type result struct {
	Check    string         `json:"check"`
	Pass     bool           `json:"pass"`
	Failures []string       `json:"failures,omitempty"`
	Seconds  float64        `json:"seconds"`
	Data     map[string]any `json:"data"`
	start    time.Time
}

func newResult(check string) *result {
	return &result{Check: check, Data: map[string]any{}, start: time.Now()}
}

func (r *result) fail(format string, a ...any) {
	msg := fmt.Sprintf(format, a...)
	r.Failures = append(r.Failures, msg)
	fmt.Printf("gpucheck %s: FAIL %s\n", r.Check, msg)
}

func (r *result) say(format string, a ...any) {
	fmt.Printf("gpucheck %s: %s\n", r.Check, fmt.Sprintf(format, a...))
}

func (r *result) write(path string) {
	r.Pass = len(r.Failures) == 0
	r.Seconds = time.Since(r.start).Seconds()
	if path == "" {
		return
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err == nil {
		err = os.WriteFile(path, append(b, '\n'), 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gpucheck: writing", path, err)
	}
}

func main() {
	// The CUDA context is current on one OS thread: keep main on it.
	runtime.LockOSThread()
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: gpucheck probe|bench|sticky [flags] (see the package comment)")
		os.Exit(1)
	}
	cmd, args := os.Args[1], os.Args[2:]
	var code int
	switch cmd {
	case "probe":
		code = probeMain(args)
	case "probe-child":
		code = probeChild(args)
	case "bench":
		code = benchMain(args)
	case "sticky":
		code = stickyMain(args)
	default:
		fmt.Fprintf(os.Stderr, "gpucheck: unknown subcommand %q\n", cmd)
		code = 1
	}
	os.Exit(code)
}

func flags(name string) *flag.FlagSet {
	return flag.NewFlagSet("gpucheck "+name, flag.ExitOnError)
}
