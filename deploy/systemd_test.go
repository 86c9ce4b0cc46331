package deploy

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// unit is a systemd unit file: section → key → values in order.
type unit map[string]map[string][]string

func parseUnit(t *testing.T, b []byte) unit {
	t.Helper()
	u := unit{}
	section := ""
	var cont string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := cont + strings.TrimSpace(sc.Text())
		cont = ""
		if strings.HasSuffix(line, `\`) {
			cont = strings.TrimSuffix(line, `\`) + " "
			continue
		}
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[':
			section = strings.Trim(line, "[]")
			u[section] = map[string][]string{}
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok || section == "" {
				t.Fatalf("unit: bad line %q", line)
			}
			u[section][k] = append(u[section][k], v)
		}
	}
	return u
}

// one returns the single value of key, failing when it is absent or repeated.
func (u unit) one(t *testing.T, key string) string {
	t.Helper()
	vs := u["Service"][key]
	if len(vs) != 1 {
		t.Fatalf("kvoffloadd.service: want one %s=, have %q", key, vs)
	}
	return vs[0]
}

// readEnvFile reads KEY="value" lines as systemd's EnvironmentFile= does
// (for the quoting this repository uses: none, or one pair of double quotes).
func readEnvFile(t *testing.T, path string) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, line := range strings.Split(string(readFile(t, path)), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s: bad line %q", path, line)
		}
		env[k] = strings.Trim(v, `"`)
	}
	return env
}

// command splits an Exec*= line the way systemd does for this unit: words
// on white space, a bare $VAR replaced by the words of its value.
func command(t *testing.T, line string, env map[string]string) []string {
	t.Helper()
	if strings.ContainsAny(line, `"'`) {
		t.Fatalf("command %q: quoting is not handled by this test", line)
	}
	var words []string
	for _, w := range strings.Fields(line) {
		if strings.HasPrefix(w, "$") {
			words = append(words, strings.Fields(env[strings.TrimPrefix(w, "$")])...)
			continue
		}
		words = append(words, w)
	}
	return words
}

func parseSystemdDuration(t *testing.T, key, v string) time.Duration {
	t.Helper()
	d, err := time.ParseDuration(strings.ReplaceAll(v, "min", "m"))
	if err != nil {
		t.Fatalf("%s=%s: %v", key, v, err)
	}
	return d
}

// TestSystemdUnit checks what the unit promises: the daemon accepts its
// command line (with /etc/default/kvoffloadd's flags), the engine's group can
// reach the socket and nobody else, the arena may be locked, the stop timeout
// outlasts the shutdown, the start check asks the same socket, and every disk
// directory is writable under ProtectSystem=strict.
func TestSystemdUnit(t *testing.T) {
	u := parseUnit(t, readFile(t, "systemd/kvoffloadd.service"))
	env := readEnvFile(t, "systemd/kvoffloadd.default")
	if got := u.one(t, "EnvironmentFile"); got != "-/etc/default/kvoffloadd" {
		t.Errorf("EnvironmentFile=%s: the example file installs as /etc/default/kvoffloadd", got)
	}
	start := command(t, u.one(t, "ExecStart"), env)
	if start[0] != DaemonPath {
		t.Fatalf("ExecStart runs %s, want %s", start[0], DaemonPath)
	}
	args := start[1:]
	checkDaemonArgs(t, "ExecStart", args)

	if got := u.one(t, "LimitMEMLOCK"); got != "infinity" {
		t.Errorf("LimitMEMLOCK=%s: the arena is locked whole", got)
	}
	user, group := u.one(t, "User"), u.one(t, "Group")
	sysusers := string(readFile(t, "systemd/kvoffloadd.sysusers"))
	if !regexp.MustCompile(`(?m)^u `+regexp.QuoteMeta(user)+` `).MatchString(sysusers) || group != user {
		t.Errorf("User=%s Group=%s: kvoffloadd.sysusers must make that user, whose group is its own", user, group)
	}

	// The socket: in the runtime directory, reachable by the group only.
	socket, _ := flagValue(args, "socket")
	if want := "/run/" + u.one(t, "RuntimeDirectory"); filepath.Dir(socket) != want {
		t.Errorf("--socket %s is not in RuntimeDirectory= (%s)", socket, want)
	}
	if mode, _ := flagValue(args, "socket-mode"); mode != "0660" {
		t.Errorf("--socket-mode %q: the engine's user reaches the socket through the group, want 0660", mode)
	}
	dirMode, err := strconv.ParseUint(u.one(t, "RuntimeDirectoryMode"), 8, 32)
	if err != nil || dirMode&0o022 != 0 || dirMode&0o050 != 0o050 || dirMode&0o007 != 0 {
		t.Errorf("RuntimeDirectoryMode=%s: want group r-x, no write for group or others, nothing for others (the daemon refuses a directory others can write)", u.one(t, "RuntimeDirectoryMode"))
	}

	// Stopping: the daemon promises to exit within --shutdown-timeout.
	st, ok := flagValue(args, "shutdown-timeout")
	if !ok {
		st = "30s" // the daemon's default
	}
	shutdown, err := time.ParseDuration(st)
	if err != nil {
		t.Fatal(err)
	}
	if stop := parseSystemdDuration(t, "TimeoutStopSec", u.one(t, "TimeoutStopSec")); stop <= shutdown {
		t.Errorf("TimeoutStopSec=%s is not above --shutdown-timeout %s", stop, shutdown)
	}

	// Starting: the start check waits on the same socket, within the start timeout.
	post := command(t, u.one(t, "ExecStartPost"), env)
	if post[0] != HealthPath {
		t.Fatalf("ExecStartPost runs %s, want %s", post[0], HealthPath)
	}
	if s, _ := flagValue(post[1:], "socket"); s != socket {
		t.Errorf("ExecStartPost asks %s, the daemon listens on %s", s, socket)
	}
	wait, _ := flagValue(post[1:], "wait")
	w, err := time.ParseDuration(wait)
	if err != nil || w <= 0 {
		t.Fatalf("ExecStartPost --wait %q", wait)
	}
	if ts := parseSystemdDuration(t, "TimeoutStartSec", u.one(t, "TimeoutStartSec")); ts <= w {
		t.Errorf("TimeoutStartSec=%s ends the start check (--wait %s) early", ts, w)
	}
	checkHealthArgs(t, "ExecStartPost", post[1:])

	// ProtectSystem=strict: only the state directory and ReadWritePaths= are
	// writable, so each disk directory must be under one of them.
	if u.one(t, "ProtectSystem") != "strict" {
		t.Fatal("ProtectSystem= is not strict; update this test")
	}
	writable := append([]string{"/var/lib/" + u.one(t, "StateDirectory")}, u["Service"]["ReadWritePaths"]...)
	dirs := 0
	for i := 0; i < len(args); i++ {
		if name, v, has := splitFlag(args[i]); name == "disk-dir" {
			if !has {
				v = args[i+1]
			}
			dirs++
			ok := false
			for _, w := range writable {
				ok = ok || v == w || strings.HasPrefix(v, w+"/")
			}
			if !ok {
				t.Errorf("--disk-dir %s is read-only under ProtectSystem=strict (writable: %v)", v, writable)
			}
		}
	}
	if dirs == 0 {
		t.Error("the example /etc/default/kvoffloadd configures no disk tier")
	}
}

// checkHealthArgs runs kvoffload-health with args against a socket nobody
// listens on: exit status 1 (not serving) means it took every flag; 2 means
// it refused one.
func checkHealthArgs(t *testing.T, what string, args []string) {
	t.Helper()
	args = append(append([]string{}, args...), "--socket", filepath.Join(t.TempDir(), "none.sock"), "--wait", "0")
	if code, out := health(t, args...); code != 1 {
		t.Fatalf("%s: kvoffload-health %q: exit %d\n%s", what, args, code, out)
	}
}

// TestSystemdVerify runs systemd-analyze verify over the unit, with the
// binaries it names built here; any message fails (verify exits 0 on
// unknown keys and bad values, printing them).
func TestSystemdVerify(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed (Debian's systemd; scripts/test-deps.sh installs it): deploy/systemd/kvoffloadd.service was NOT verified")
	}
	b := readFile(t, "systemd/kvoffloadd.service")
	b = bytes.ReplaceAll(b, []byte(DaemonPath), []byte(bins.daemon))
	b = bytes.ReplaceAll(b, []byte(HealthPath), []byte(bins.health))
	path := filepath.Join(t.TempDir(), "kvoffloadd.service")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(sa, "verify", "--man=no", path).CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// TestSystemdHostBuildDropIn: the host build, which maps region files only
// for clients of its own uid, has a drop-in that runs it as the engine's
// user, and the unit's install steps and docs/operations.md name it (issue
// 33, 7; the daemon's own warning is tested in cmd/kvoffloadd).
func TestSystemdHostBuildDropIn(t *testing.T) {
	drop := parseUnit(t, readFile(t, "systemd/host-build.conf"))
	if len(drop) != 1 || len(drop["Service"]) != 2 {
		t.Fatalf("host-build.conf: want only User= and Group= in [Service], have %v", drop)
	}
	user, group := drop.one(t, "User"), drop.one(t, "Group")
	u := parseUnit(t, readFile(t, "systemd/kvoffloadd.service"))
	if user == u.one(t, "User") || user == "" || group == "" {
		t.Errorf("host-build.conf: User=%s Group=%s: want the engine's user, not the unit's default", user, group)
	}
	const install = "install -D -m 0644 deploy/systemd/host-build.conf /etc/systemd/system/kvoffloadd.service.d/host-build.conf"
	for _, f := range []string{"systemd/kvoffloadd.service", "systemd/host-build.conf", "../docs/operations.md"} {
		if !strings.Contains(string(readFile(t, f)), install) {
			t.Errorf("%s does not say how to install the host build's drop-in (%q)", f, install)
		}
	}
}
