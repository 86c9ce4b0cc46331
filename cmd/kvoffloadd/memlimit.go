package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
)

// cgroupFiles are where the daemon learns its memory limit: its cgroup
// membership and the mount point of the cgroup filesystems. Tests point
// them at files of their own.
var cgroupFiles = struct{ self, root string }{"/proc/self/cgroup", "/sys/fs/cgroup"}

// daemonOverheadBytes is the memory the daemon needs beside its arena (the
// index, the policy, buffers, the Go runtime), for the start's check
// against the memory limit.
const daemonOverheadBytes = 64 << 20

// memLimit is the tightest memory limit on the daemon and the file that
// sets it; bytes 0: none.
type memLimit struct {
	bytes uint64
	file  string
}

// cgroupMemoryLimit reads the memory limit of the daemon's cgroup and of
// each ancestor up to the mount point: memory.max (cgroup v2, "max" is
// none) or memory.limit_in_bytes (v1, whose "none" is a huge number), and
// returns the smallest. Files it cannot find (no cgroup filesystem, a
// cgroup path of another namespace) set no limit.
func cgroupMemoryLimit(self, root string) (memLimit, error) {
	b, err := os.ReadFile(self)
	if errors.Is(err, fs.ErrNotExist) {
		return memLimit{}, nil
	}
	if err != nil {
		return memLimit{}, err
	}
	var best memLimit
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		// hierarchy-id:controllers:path
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		var base, file string
		switch {
		case parts[0] == "0" && parts[1] == "":
			base, file = root, "memory.max"
			if _, err := os.Stat(filepath.Join(root, "cgroup.controllers")); err != nil {
				base = filepath.Join(root, "unified") // a hybrid layout
			}
		case strings.Contains(","+parts[1]+",", ",memory,"):
			base, file = filepath.Join(root, "memory"), "memory.limit_in_bytes"
		default:
			continue
		}
		dir := filepath.Join(base, filepath.Clean("/"+parts[2]))
		for {
			if l, ok := readLimit(filepath.Join(dir, file)); ok && (best.bytes == 0 || l < best.bytes) {
				best = memLimit{bytes: l, file: filepath.Join(dir, file)}
			}
			if dir == base || !strings.HasPrefix(dir, base) {
				break
			}
			dir = filepath.Dir(dir)
		}
	}
	return best, sc.Err()
}

// readLimit reads one limit file; false when it is absent, unreadable or
// says there is no limit.
func readLimit(path string) (uint64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	v, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || v == 0 || v >= 1<<62 { // "max", or v1's page-rounded MaxInt64
		return 0, false
	}
	return v, true
}

// checkMemory refuses, at start, a CPU tier the daemon could not hold: an
// arena (with --cpu-arena-dir, its file and records) past the memory
// limit of the daemon's cgroup would get the daemon OOM-killed as it
// fills, and an arena file past what its tmpfs has free (less a reserve,
// as for the disk tier: the engine's /dev/shm files share it) would fail
// to be allocated or take the filesystem's last space.
func checkMemory(cfg *config) error {
	need := cfg.cpuBytes
	if cfg.cpuArenaDir != "" {
		need += cfg.cpuBytes / 32 // a 128-byte record per 4KiB (tiers/cpu)
	}
	limit, err := cgroupMemoryLimit(cgroupFiles.self, cgroupFiles.root)
	if err != nil {
		return fmt.Errorf("read the cgroup's memory limit: %w", err)
	}
	if limit.bytes > 0 && need+daemonOverheadBytes > limit.bytes {
		fits := uint64(0)
		if limit.bytes > daemonOverheadBytes {
			fits = limit.bytes - daemonOverheadBytes
			if cfg.cpuArenaDir != "" {
				fits = fits / 33 * 32
			}
			fits = fits >> 20 << 20
		}
		records := ""
		if cfg.cpuArenaDir != "" {
			records = " (with its records, 1/32 more)"
		}
		return fmt.Errorf("--cpu-bytes %s: the daemon's memory limit is %s (%s); the arena%s and %s for the daemon itself do not fit under it, and the kernel would kill the daemon (OOM) as the arena fills: give --cpu-bytes at most %s, or raise the limit",
			formatBytes(cfg.cpuBytes), formatBytes(limit.bytes), limit.file, records, formatBytes(daemonOverheadBytes), formatBytes(fits))
	}
	if cfg.cpuArenaDir == "" {
		return nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(cfg.cpuArenaDir, &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		return nil // not there yet, or not tmpfs: the CPU tier says why
	}
	var held uint64
	if fi, err := os.Lstat(filepath.Join(cfg.cpuArenaDir, cpu.ArenaFileName)); err == nil && fi.Mode().IsRegular() {
		if s, ok := fi.Sys().(*unix.Stat_t); ok {
			held = min(uint64(s.Blocks)*512, need)
		}
	}
	free, total := st.Bavail*uint64(st.Bsize), st.Blocks*uint64(st.Bsize)
	reserve := disk.ReserveBytes(total)
	if need-held+reserve > free {
		return fmt.Errorf("--cpu-arena-dir %s: an arena file of %s (--cpu-bytes %s and its records) needs %s more, and its tmpfs has %s free, of which the daemon leaves %s (5%% of its %s, at most 1GiB); give a smaller --cpu-bytes or a larger tmpfs",
			cfg.cpuArenaDir, formatBytes(need), formatBytes(cfg.cpuBytes), formatBytes(need-held), formatBytes(free), formatBytes(reserve), formatBytes(total))
	}
	return nil
}
