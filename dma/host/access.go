package host

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// openAsPeer opens rel beneath dir, read-write, only if the peer could open
// it itself by that path: the kernel checks every directory from the root
// down to the file, with the peer's filesystem uid, gid and supplementary
// groups, so ACLs, directory modes above the file and LSMs all count.
//
// Why impersonate rather than compare mode bits: a check of our own would
// have to re-implement the kernel's (ACLs, every directory above, group
// membership, capabilities), and get it wrong on the looser side. The
// credentials are the ones the kernel recorded at connect (SO_PEERCRED,
// SO_PEERGROUPS), not read from /proc/<pid>, which a reused pid could make
// another process's. And the file is opened once: every later check (type,
// size) and the mapping use that descriptor, so nothing can be swapped in
// between.
//
// setfsuid, setfsgid and setgroups change only the calling thread when made
// as raw system calls (x/sys/unix makes them so; the syscall package's
// Setgroups changes every thread). The open runs on a goroutine locked to
// its thread that never unlocks: when it returns, the runtime ends the
// thread rather than hand it, with the peer's credentials, to another
// goroutine.
func openAsPeer(dir, rel string, p dma.Peer) (int, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		fd, err := openAsPeerLocked(dir, rel, p)
		ch <- result{fd, err}
	}()
	r := <-ch
	return r.fd, r.err
}

func openAsPeerLocked(dir, rel string, p dma.Peer) (int, error) {
	if err := becomePeer(p); err != nil {
		return -1, err
	}
	dfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("%w: open %s as uid %d: %v", dma.ErrBadRegion, dir, p.UID, err)
	}
	defer unix.Close(dfd)
	// O_NONBLOCK: a FIFO or device must not hold the open; it is refused
	// as not a regular file right after.
	fd, err := unix.Openat2(dfd, rel, &unix.OpenHow{
		Flags:   unix.O_RDWR | unix.O_CLOEXEC | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_NOCTTY,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	})
	switch {
	case errors.Is(err, unix.ELOOP):
		return -1, fmt.Errorf("%w: %s is or passes through a symlink", dma.ErrBadRegion, rel)
	case errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM):
		return -1, fmt.Errorf("%w: %s is not readable and writable by the client (uid %d, gid %d, groups %v): %v", dma.ErrBadRegion, rel, p.UID, p.GID, p.Groups, err)
	case err != nil:
		return -1, fmt.Errorf("%w: open %s as uid %d: %v", dma.ErrBadRegion, rel, p.UID, err)
	}
	return fd, nil
}

// becomePeer gives the calling (locked) thread the peer's filesystem
// credentials. A daemon without CAP_SETUID and CAP_SETGID cannot; it then
// opens as itself, which is safe only for a peer with its uid and at least
// its groups (whatever the daemon may open, the peer may too).
func becomePeer(p dma.Peer) error {
	gids := make([]int, len(p.Groups))
	for i, g := range p.Groups {
		gids[i] = int(g)
	}
	if err := unix.Setgroups(gids); err != nil {
		if !errors.Is(err, unix.EPERM) {
			return fmt.Errorf("%w: setgroups: %v", dma.ErrBadRegion, err)
		}
		if !sameAsDaemon(p) {
			return fmt.Errorf("%w: the daemon runs without CAP_SETUID/CAP_SETGID, so it opens regions only for clients with its own uid (%d) and groups; this client is uid %d, gid %d", dma.ErrBadRegion, os.Geteuid(), p.UID, p.GID)
		}
		return nil
	}
	unix.Setfsgid(int(p.GID))
	unix.Setfsuid(int(p.UID))
	// setfsuid and setfsgid report no errors: ask for the current values
	// (an invalid id changes nothing and returns them).
	gid, _ := unix.SetfsgidRetGid(-1)
	uid, _ := unix.SetfsuidRetUid(-1)
	if uid != int(p.UID) || gid != int(p.GID) {
		return fmt.Errorf("%w: cannot take the client's credentials (fsuid %d, fsgid %d; want %d, %d)", dma.ErrBadRegion, uid, gid, p.UID, p.GID)
	}
	return nil
}

// sameAsDaemon reports whether the peer has the daemon's uid and gid and
// every group the daemon has.
func sameAsDaemon(p dma.Peer) bool {
	if int(p.UID) != os.Geteuid() || int(p.GID) != os.Getegid() {
		return false
	}
	mine, err := unix.Getgroups()
	if err != nil {
		return false
	}
	for _, g := range mine {
		if uint32(g) != p.GID && !slices.Contains(p.Groups, uint32(g)) {
			return false
		}
	}
	return true
}
