package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
)

// TestCgroupMemoryLimit reads the limit from cgroup files of each layout:
// the tightest of the cgroup and its ancestors, "max" and v1's huge
// number meaning none.
func TestCgroupMemoryLimit(t *testing.T) {
	write := func(root, rel, body string) {
		p := filepath.Join(root, rel)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name  string
		self  string
		files map[string]string
		want  uint64
		file  string
	}{
		{"v2, limit on the parent", "0::/pod/daemon\n", map[string]string{"cgroup.controllers": "memory", "pod/memory.max": "1073741824\n", "pod/daemon/memory.max": "max\n"}, 1 << 30, "pod/memory.max"},
		{"v2, tighter on the leaf", "0::/pod/daemon\n", map[string]string{"cgroup.controllers": "memory", "pod/memory.max": "1073741824\n", "pod/daemon/memory.max": "536870912\n"}, 512 << 20, "pod/daemon/memory.max"},
		{"v2, namespaced root", "0::/\n", map[string]string{"cgroup.controllers": "memory", "memory.max": "268435456\n"}, 256 << 20, "memory.max"},
		{"v2, none", "0::/a\n", map[string]string{"cgroup.controllers": "memory", "a/memory.max": "max\n"}, 0, ""},
		{"v1", "4:memory:/x\n3:cpu,cpuacct:/x\n0::/\n", map[string]string{"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/x/memory.limit_in_bytes": "536870912\n"}, 512 << 20, "memory/x/memory.limit_in_bytes"},
		{"v1, unlimited", "4:memory:/x\n", map[string]string{"memory/x/memory.limit_in_bytes": "9223372036854771712\n"}, 0, ""},
		{"a path of another namespace", "0::/elsewhere\n", map[string]string{"cgroup.controllers": "memory", "memory.max": "268435456\n"}, 256 << 20, "memory.max"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			for rel, body := range tc.files {
				write(root, rel, body)
			}
			self := filepath.Join(t.TempDir(), "cgroup")
			write(filepath.Dir(self), "cgroup", tc.self)
			got, err := cgroupMemoryLimit(self, root)
			if err != nil {
				t.Fatal(err)
			}
			wantFile := ""
			if tc.file != "" {
				wantFile = filepath.Join(root, tc.file)
			}
			if got.bytes != tc.want || got.file != wantFile {
				t.Fatalf("got %d from %q, want %d from %q", got.bytes, got.file, tc.want, wantFile)
			}
		})
	}
	if l, err := cgroupMemoryLimit(filepath.Join(t.TempDir(), "missing"), t.TempDir()); err != nil || l.bytes != 0 {
		t.Fatalf("no cgroup file: %v %v", l, err)
	}
}

// memoryCgroup makes a child of this process's memory cgroup limited to
// limit bytes, removed when the test ends, and returns the file a process
// joins it by and the limit file; it skips where none can be made.
func memoryCgroup(t *testing.T, limit uint64) (procs, limitFile string) {
	t.Helper()
	testenv.NeedRoot(t)
	f, err := os.Open(cgroupFiles.self)
	if err != nil {
		t.Skip(err)
	}
	defer f.Close()
	name := fmt.Sprintf("kvo-test-%d", os.Getpid())
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		var dir, file string
		switch {
		case strings.Contains(","+parts[1]+",", ",memory,"):
			dir, file = filepath.Join(cgroupFiles.root, "memory", parts[2], name), "memory.limit_in_bytes"
		case parts[0] == "0" && parts[1] == "":
			parent := filepath.Join(cgroupFiles.root, parts[2])
			if b, err := os.ReadFile(filepath.Join(parent, "cgroup.subtree_control")); err != nil || !strings.Contains(string(b), "memory") {
				continue
			}
			dir, file = filepath.Join(parent, name), "memory.max"
		default:
			continue
		}
		if err := os.Mkdir(dir, 0o755); err != nil {
			continue
		}
		t.Cleanup(func() { os.Remove(dir) })
		if err := os.WriteFile(filepath.Join(dir, file), []byte(fmt.Sprint(limit)), 0o644); err != nil {
			continue
		}
		return filepath.Join(dir, "cgroup.procs"), filepath.Join(dir, file)
	}
	t.Skip("no memory cgroup can be made here (cgroup v1's memory hierarchy, or a v2 parent delegating memory, is needed)")
	return "", ""
}

// inCgroup runs bin with args in the cgroup whose cgroup.procs is procs.
func inCgroup(procs, bin string, args ...string) *exec.Cmd {
	return exec.Command("sh", append([]string{"-c", `echo $$ > "$0" && exec "$@"`, procs, bin}, args...)...)
}

// TestCPUBytesPastTheMemoryLimitIsRefused runs the daemon in a real memory
// cgroup of 256MiB: a --cpu-bytes that cannot fit under it is refused at
// start, naming the limit and its file, instead of an OOM kill as the
// arena fills; one that fits starts (issue 30, 4).
func TestCPUBytesPastTheMemoryLimitIsRefused(t *testing.T) {
	procs, limitFile := memoryCgroup(t, 256<<20)
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	out, err := inCgroup(procs, bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "512MiB").CombinedOutput()
	want := fmt.Sprintf("kvoffloadd: --cpu-bytes 512MiB: the daemon's memory limit is 256MiB (%s); the arena and 64MiB for the daemon itself do not fit under it, and the kernel would kill the daemon (OOM) as the arena fills: give --cpu-bytes at most 192MiB, or raise the limit", limitFile)
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(string(out), want) {
		t.Fatalf("--cpu-bytes 512MiB under a 256MiB limit: %v\n%s\nwant exit status 1 and %q", err, out, want)
	}

	proc := inCgroup(procs, bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "128MiB")
	d := runWatched(t, proc)
	d.dial(t, sock).Close()
	proc.Process.Signal(syscall.SIGTERM)
	<-d.exited
}

// TestArenaPastItsTmpfsIsRefused: an arena file that its tmpfs (a real
// 320MiB mount) cannot hold with the reserve left free is refused at start,
// before the file is made; one that fits starts (issue 30, 4).
func TestArenaPastItsTmpfsIsRefused(t *testing.T) {
	mnt := testenv.SmallTmpfs(t, 320<<20)
	bin := buildDaemon(t)
	dir := filepath.Join(mnt, "arena")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "kv.sock")
	args := func(cpuBytes string) []string {
		return []string{"--socket", sock, "--metrics-addr", "", "--cpu-bytes", cpuBytes, "--cpu-arena-dir", dir}
	}
	out := refusedStart(t, bin, args("512MiB")...)
	if !strings.Contains(out, "--cpu-arena-dir "+dir+": an arena file of 528MiB (--cpu-bytes 512MiB and its records) needs 528MiB more, and its tmpfs has 320MiB free, of which the daemon leaves 16MiB") {
		t.Fatalf("refusal does not give the tmpfs's free space:\n%s", out)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("a refused start left %v in the arena directory", ents)
	}
	proc, _, exited := startDaemon(t, bin, args("128MiB")...)
	proc.Process.Signal(syscall.SIGTERM)
	<-exited
}
