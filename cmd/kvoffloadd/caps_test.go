//go:build !cuda

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestHostBuildSaysWhoItServes: the host build run as a user without
// CAP_SETUID/CAP_SETGID (the systemd unit's default user) says at start
// that it serves only its own uid and how to fix it; run with them, it
// does not (issue 33, 7).
func TestHostBuildSaysWhoItServes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run the daemon both with and without CAP_SETUID")
	}
	bin := buildDaemon(t)
	// The binary, where the daemon's user may run it.
	if err := os.Chmod(filepath.Dir(bin), 0o755); err != nil {
		t.Fatal(err)
	}
	const warning = "host build without CAP_SETUID and CAP_SETGID: it maps region files only for clients of its own uid and groups; run it as the engine's user"
	for _, tc := range []struct {
		name string
		cred *syscall.Credential
		want bool
	}{{"nobody", &syscall.Credential{Uid: 65534, Gid: 65534}, true}, {"root", nil, false}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if tc.cred != nil {
				os.Chmod(filepath.Dir(dir), 0o755)
				os.Chown(dir, int(tc.cred.Uid), int(tc.cred.Gid))
			}
			sock := filepath.Join(dir, "kv.sock")
			proc := exec.Command(bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "8MiB")
			proc.SysProcAttr = &syscall.SysProcAttr{Credential: tc.cred}
			d := runWatched(t, proc)
			logs := d.logs
			d.dial(t, sock).Close()
			proc.Process.Signal(syscall.SIGTERM)
			<-d.exited
			if got := strings.Contains(logs.String(), warning); got != tc.want {
				t.Fatalf("warning logged: %v, want %v; log:\n%s", got, tc.want, logs.String())
			}
		})
	}
}
