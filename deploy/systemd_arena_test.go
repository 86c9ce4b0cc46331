package deploy

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSystemdCPUArenaDropIn: with the cpu-arena.conf drop-in the unit runs
// the daemon with a --cpu-arena-dir on /dev/shm (tmpfs, writable under
// ProtectSystem=strict, and not removed at stop), without it with none;
// the unit sets nothing that would take the file away at stop; and the
// daemon on that command line leaves its arena file behind when it stops
// and re-attaches it at the next start.
func TestSystemdCPUArenaDropIn(t *testing.T) {
	u := parseUnit(t, readFile(t, "systemd/kvoffloadd.service"))
	drop := parseUnit(t, readFile(t, "systemd/cpu-arena.conf"))
	env := readEnvFile(t, "systemd/kvoffloadd.default")
	if _, ok := flagValue(command(t, u.one(t, "ExecStart"), env)[1:], "cpu-arena-dir"); ok {
		t.Error("without the drop-in the unit already keeps the arena in a file")
	}
	for _, e := range drop["Service"]["Environment"] {
		k, v, ok := strings.Cut(strings.Trim(e, `"`), "=")
		if !ok {
			t.Fatalf("cpu-arena.conf: Environment=%s", e)
		}
		env[k] = v
	}
	args := command(t, u.one(t, "ExecStart"), env)[1:]
	dir, ok := flagValue(args, "cpu-arena-dir")
	if !ok {
		t.Fatal("with cpu-arena.conf ExecStart passes no --cpu-arena-dir (is $KVOFFLOADD_ARENA_ARGS in ExecStart?)")
	}
	if !strings.HasPrefix(dir, "/dev/shm/") {
		t.Errorf("--cpu-arena-dir %s: want a directory under /dev/shm (tmpfs, writable under ProtectSystem=strict, kept when the unit stops)", dir)
	}
	for _, key := range []string{"RemoveIPC", "PrivateIPC"} {
		if vs := u["Service"][key]; len(vs) > 0 && vs[len(vs)-1] == "yes" {
			t.Errorf("%s=yes would remove or hide the arena file in /dev/shm when the unit stops", key)
		}
	}
	checkDaemonArgs(t, "ExecStart with cpu-arena.conf", args)

	arena, err := os.MkdirTemp("/dev/shm", "kvo-deploy-arena-")
	if err != nil {
		t.Skip(err)
	}
	defer os.RemoveAll(arena)
	root := t.TempDir()
	run := hostArgs(t, "ExecStart with cpu-arena.conf", args, root, map[string]string{
		"cpu-bytes": "16MiB", "disk-bytes": "64MiB", "metrics-addr": "", "cpu-arena-dir": arena,
	})
	socket, _ := flagValue(run, "socket")
	for i, want := range []string{`"reattached":false`, `"reattached":true`} {
		d := startDaemon(t, run)
		if code, out := health(t, "--socket", socket, "--wait", "1m"); code != 0 {
			t.Fatalf("start %d: health: exit %d, %s\n%s", i, code, out, d.logs.String())
		}
		if err := d.stop(t); err != nil {
			t.Fatalf("daemon exit: %v\n%s", err, d.logs.String())
		}
		if !strings.Contains(d.logs.String(), want) {
			t.Fatalf("start %d: the log does not say %s:\n%s", i, want, d.logs.String())
		}
		if _, err := os.Stat(filepath.Join(arena, "kvoffload-cpu.arena")); err != nil {
			t.Fatalf("after the daemon stopped: %v", err)
		}
	}
}
