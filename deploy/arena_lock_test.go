package deploy

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestArenaUnlockedSaysSo runs the daemon as a Pod Security baseline or
// restricted sidecar runs it: without CAP_IPC_LOCK and with a small
// RLIMIT_MEMLOCK, so the arena cannot be locked. It must serve anyway and
// say so: a warning in the log and kvoffload_cpu_arena_locked 0; and 1 when
// it can lock (as root, here, with CAP_IPC_LOCK).
func TestArenaUnlockedSaysSo(t *testing.T) {
	for _, unlocked := range []bool{true, false} {
		t.Run(fmt.Sprintf("unlocked=%v", unlocked), func(t *testing.T) {
			if !unlocked && os.Geteuid() != 0 {
				t.Skip("locking a 64 MiB arena needs CAP_IPC_LOCK or a raised RLIMIT_MEMLOCK")
			}
			root := t.TempDir()
			port := freePort(t)
			socket := filepath.Join(root, "run", "kv.sock")
			args := []string{bins.daemon, "--socket=" + socket, "--cpu-bytes=64MiB", fmt.Sprintf("--metrics-addr=127.0.0.1:%d", port)}
			if unlocked {
				// 64 KiB of RLIMIT_MEMLOCK, and for root no CAP_IPC_LOCK
				// (it overrides the limit).
				args = append([]string{"prlimit", "--memlock=65536:65536", "--"}, args...)
				if os.Geteuid() == 0 {
					args = append([]string{"setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--"}, args...)
				}
			}
			d := &daemon{cmd: exec.Command(args[0], args[1:]...), logs: &syncBuffer{}, exited: make(chan struct{})}
			d.cmd.Stdout, d.cmd.Stderr = d.logs, d.logs
			if err := d.cmd.Start(); err != nil {
				t.Fatal(err)
			}
			go func() { d.err = d.cmd.Wait(); close(d.exited) }()
			t.Cleanup(func() {
				d.cmd.Process.Kill()
				<-d.exited
				if t.Failed() {
					t.Logf("daemon %q log:\n%s", args, d.logs.String())
				}
			})
			if code, out := health(t, "--socket", socket, "--wait", "1m"); code != 0 {
				t.Fatalf("the daemon does not serve: %s", out)
			}
			resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			want := "kvoffload_cpu_arena_locked 1"
			if unlocked {
				want = "kvoffload_cpu_arena_locked 0"
			}
			if !regexp.MustCompile(`(?m)^` + want + `$`).Match(body) {
				t.Errorf("metrics lack %q", want)
			}
			warned := strings.Contains(d.logs.String(), "arena is not locked in memory")
			if warned != unlocked {
				t.Errorf("the log's warning that the arena is not locked: %v, want %v", warned, unlocked)
			}
			if !strings.Contains(d.logs.String(), fmt.Sprintf("arena_locked=%v", !unlocked)) {
				t.Errorf("the serving line does not say arena_locked=%v", !unlocked)
			}
			if err := d.stop(t); err != nil {
				t.Errorf("daemon exit: %v", err)
			}
		})
	}
}
