// Package cpu owns the CPU tier: one host arena mapped once outside the Go
// heap (page aligned, huge pages advised, locked where RLIMIT_MEMLOCK
// allows) whose slots are managed by package slots. Slots are 4 KiB aligned
// so the disk tier reads and writes them with O_DIRECT.
//
// With a persistent arena (NewPersistent, persist.go) the arena is a file
// that outlives the process, with a record per slot (records.go) and a
// namespace catalog beside it (catalog.go); after a restart Recover brings
// its blocks back in the background and hands them to the owner
// (recover.go), and Invalidating makes an invalidation durable in the file
// while recovery runs (ledger.go).
package cpu

import (
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// mapArena maps size bytes of anonymous memory, advises huge pages and locks
// it in memory where RLIMIT_MEMLOCK allows. It reports whether it is locked.
//
// The lock is taken on fault (mlock2 MLOCK_ONFAULT): a plain mlock faults in
// and zeroes every page before it returns, which for a 64 GiB arena keeps
// the daemon from serving for tens of seconds. Pages are locked as they are
// first touched instead, and populate backs the whole arena in the
// background while the daemon serves.
func mapArena(size uint64, log *slog.Logger) ([]byte, bool, error) {
	mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, false, fmt.Errorf("mmap %d-byte arena: %w", size, err)
	}
	return mem, adviseAndLock(mem, size, log), nil
}

// adviseAndLock advises huge pages for a mapped arena and locks it on
// fault where RLIMIT_MEMLOCK allows; it reports whether it is locked.
func adviseAndLock(mem []byte, size uint64, log *slog.Logger) bool {
	if err := unix.Madvise(mem, unix.MADV_HUGEPAGE); err != nil {
		log.Debug("transparent huge pages not available for the arena", "err", err)
	}
	err := mlockOnFault(mem)
	if errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EINVAL) {
		err = unix.Mlock(mem) // a kernel before 4.4: lock it all now
	}
	if err != nil {
		var lim unix.Rlimit
		_ = unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim)
		log.Warn("arena is not locked in memory: it may be swapped out; raise RLIMIT_MEMLOCK (ulimit -l) or run with CAP_IPC_LOCK",
			"bytes", size, "memlock_limit", lim.Cur, "err", err)
		return false
	}
	return true
}

func mlockOnFault(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	_, _, e := unix.Syscall(unix.SYS_MLOCK2, uintptr(unsafePointer(b)), uintptr(len(b)), unix.MLOCK_ONFAULT)
	if e != 0 {
		return e
	}
	return nil
}

func unmap(mem []byte) error { return unix.Munmap(mem) }

// populateStep is how much of the arena one MADV_POPULATE_WRITE backs:
// small enough that Close never waits long for it.
const populateStep = 64 << 20

// populate backs every page of mem with memory (MADV_POPULATE_WRITE, which
// faults pages in without changing what they hold, so copies may run
// meanwhile), a step at a time, until done or stop closes. A host without
// the memory is told in the log now rather than at the first store that
// touches the missing pages. Kernels before 5.14 lack the advice: pages
// are then backed (and locked) at first use.
// backed counts the bytes done; it ends at len(mem) only when every page was.
func populate(mem []byte, backed *atomic.Uint64, stop <-chan struct{}, log *slog.Logger) {
	start := time.Now()
	for off := 0; off < len(mem); off += populateStep {
		select {
		case <-stop:
			return
		default:
		}
		end := min(off+populateStep, len(mem))
		if err := unix.Madvise(mem[off:end], unix.MADV_POPULATE_WRITE); err != nil {
			if errors.Is(err, unix.EINVAL) {
				log.Debug("the kernel cannot populate the arena ahead of use (MADV_POPULATE_WRITE); pages are backed at first use", "err", err)
				return
			}
			log.Warn("the arena could not be backed by memory; copies into the rest of it may fail or the kernel may kill the daemon",
				"backed_bytes", off, "arena_bytes", len(mem), "err", err)
			return
		}
		backed.Store(uint64(end))
	}
	log.Info("arena backed by memory", "bytes", len(mem), "took", time.Since(start).Round(time.Millisecond))
}
