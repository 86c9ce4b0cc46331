// Package cpu owns the CPU tier: one host arena mapped once outside the Go
// heap (page aligned, huge pages advised, locked where RLIMIT_MEMLOCK
// allows) whose slots are managed by package slots. Slots are 4 KiB aligned
// so the disk tier reads and writes them with O_DIRECT.
package cpu

import (
	"fmt"
	"log/slog"

	"golang.org/x/sys/unix"
)

// mapArena maps size bytes of anonymous memory, advises huge pages and locks
// it in memory where RLIMIT_MEMLOCK allows. It reports whether it is locked.
func mapArena(size uint64, log *slog.Logger) ([]byte, bool, error) {
	mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, false, fmt.Errorf("mmap %d-byte arena: %w", size, err)
	}
	if err := unix.Madvise(mem, unix.MADV_HUGEPAGE); err != nil {
		log.Debug("transparent huge pages not available for the arena", "err", err)
	}
	if err := unix.Mlock(mem); err != nil {
		var lim unix.Rlimit
		_ = unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim)
		log.Warn("arena is not locked in memory: it may be swapped out; raise RLIMIT_MEMLOCK (ulimit -l) or run with CAP_IPC_LOCK",
			"bytes", size, "memlock_limit", lim.Cur, "err", err)
		return mem, false, nil
	}
	return mem, true, nil
}
