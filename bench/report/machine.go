package report

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Machine is what the numbers ran on.
type Machine struct {
	CPU         string `json:"cpu"`
	Cores       int    `json:"cores"`
	MemoryBytes uint64 `json:"memory_bytes"`
	Kernel      string `json:"kernel"`
	GoVersion   string `json:"go_version"`
	// DiskDir is where the disk tier and the O_DIRECT baseline ran, on
	// DiskFS (filesystem type) over DiskDevice.
	DiskDir    string `json:"disk_dir,omitempty"`
	DiskFS     string `json:"disk_fs,omitempty"`
	DiskDevice string `json:"disk_device,omitempty"`
}

func (m Machine) String() string {
	s := fmt.Sprintf("%s, %d cores, %.1f GiB, Linux %s, %s", m.CPU, m.Cores, float64(m.MemoryBytes)/(1<<30), m.Kernel, m.GoVersion)
	if m.DiskDir != "" {
		s += fmt.Sprintf("; disk dir %s on %s (%s)", m.DiskDir, m.DiskFS, m.DiskDevice)
	}
	return s
}

// Describe reads the machine from /proc and uname; diskDir, if set, is
// looked up in the mount table.
func Describe(diskDir string) Machine {
	m := Machine{CPU: "unknown", Cores: runtime.NumCPU(), GoVersion: runtime.Version()}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "MemTotal:"); ok {
				kb, _ := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
				m.MemoryBytes = kb << 10
			}
		}
	}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if diskDir != "" {
		m.DiskDir = diskDir
		m.DiskFS, m.DiskDevice = mountOf(diskDir)
	}
	return m
}

// mountOf returns the filesystem type and source of the mount holding dir.
func mountOf(dir string) (fstype, source string) {
	abs, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return "unknown", "unknown"
	}
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "unknown", "unknown"
	}
	best := -1
	fstype, source = "unknown", "unknown"
	for _, l := range strings.Split(string(b), "\n") {
		// id parent major:minor root mountpoint options [optional...] - fstype source superopts
		pre, post, ok := strings.Cut(l, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 2 {
			continue
		}
		mp := f[4]
		if (abs == mp || strings.HasPrefix(abs, strings.TrimSuffix(mp, "/")+"/")) && len(mp) > best {
			best, fstype, source = len(mp), g[0], g[1]
		}
	}
	return fstype, source
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}
