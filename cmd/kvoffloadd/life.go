package main

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// lifeSuffix names the file beside the socket that tells a connector
// whether the daemon that holds its registration has exited.
//
// A job the daemon accepted keeps copying into engine memory until it has
// drained, whatever happens to its connection, so a connector may hand
// blocks back to the engine only once the daemon reported the job, said it
// drained the registration, or exited. The connector watches the exit by
// pid (a pidfd) when the daemon's pid is visible; from another pid
// namespace it is not. The life file works across pid namespaces: each
// daemon creates it afresh (a new inode) and holds an exclusive flock on it
// until the process is gone; a connector keeps the file it opened at
// registration open, and a shared lock it can take on it proves that
// daemon has exited. A stopped (SIGSTOP) or draining daemon still holds
// it. docs/vllm.md, "Daemon pid not visible".
const lifeSuffix = ".life"

// holdLife creates socket+".life" as a new file of the socket's mode and
// takes its exclusive lock. The lock goes with the process; release,
// called once everything has drained, removes the file and closes it.
func holdLife(socket string, mode os.FileMode) (release func(), err error) {
	path := socket + lifeSuffix
	tmp := fmt.Sprintf("%s.%d", path, os.Getpid())
	os.Remove(tmp) // a leftover of a pid reused after a crash
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("--socket: create %s: %w", tmp, err)
	}
	fail := func(err error) (func(), error) {
		f.Close()
		os.Remove(tmp)
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return fail(fmt.Errorf("--socket: lock %s: %w", tmp, err))
	}
	if err := f.Chmod(mode); err != nil {
		return fail(fmt.Errorf("--socket: chmod %s: %w", tmp, err))
	}
	// The rename replaces a dead daemon's file in one step: a connector
	// opening the path gets either that one (unlocked: exited) or ours.
	if err := os.Rename(tmp, path); err != nil {
		return fail(fmt.Errorf("--socket: %w", err))
	}
	return func() {
		if st, err := os.Stat(path); err == nil {
			if own, err := f.Stat(); err == nil && os.SameFile(st, own) {
				os.Remove(path)
			}
		}
		f.Close()
	}, nil
}
