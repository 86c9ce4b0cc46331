package server

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// conn is one accepted connection: who is on the other end, as the kernel
// recorded it at connect (so a pid reused later changes nothing), and a
// number naming it for the daemon's life.
type conn struct {
	net.Conn
	id      uint64
	peer    dma.Peer
	hasCred bool
	t       *connTable
	once    sync.Once
}

// Close closes the connection and, once, releases what it held.
func (c *conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.t.closed(c) })
	return err
}

// connTable admits connections within the bounds, knows which are open and
// what each registered, and closes them all at a hard stop.
type connTable struct {
	max, maxPerUID int
	log            *slog.Logger
	// onClose runs once per connection after it closed, with the
	// registrations it made.
	onClose func(id uint64, regs []uint64)
	next    atomic.Uint64
	refused rateLog

	mu struct {
		sync.Mutex
		open   map[uint64]*conn
		regs   map[uint64][]uint64 // open connection -> registrations it made
		owners map[uint64]owner    // registration -> who made it, until it is gone
		perUID map[uint32]int
		closed bool // closeAll ran: refuse every connection
	}
}

// owner is the connection that made a registration and its peer.
type owner struct {
	conn uint64
	peer dma.Peer
}

func newConnTable(max, maxPerUID int, log *slog.Logger, onClose func(uint64, []uint64)) *connTable {
	t := &connTable{max: max, maxPerUID: maxPerUID, log: log, onClose: onClose}
	t.mu.open = map[uint64]*conn{}
	t.mu.regs = map[uint64][]uint64{}
	t.mu.owners = map[uint64]owner{}
	t.mu.perUID = map[uint32]int{}
	return t
}

// listener admits each accepted connection through the table.
type listener struct {
	net.Listener
	t *connTable
}

// Accept returns the next connection within the bounds; one past them is
// closed at once (its client sees the connection fail: UNAVAILABLE).
func (l *listener) Accept() (net.Conn, error) {
	for {
		nc, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		c, err := l.t.admit(nc)
		if err != nil {
			l.t.logRefusal(err)
			nc.Close()
			continue
		}
		return c, nil
	}
}

var errConnLimit = errors.New("connection refused")

func (t *connTable) admit(nc net.Conn) (*conn, error) {
	c := &conn{Conn: nc, id: t.next.Add(1), t: t}
	if uc, ok := nc.(*net.UnixConn); ok {
		peer, err := peerOfConn(uc)
		if err != nil {
			return nil, err
		}
		c.peer, c.hasCred = peer, true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.mu.closed:
		return nil, fmt.Errorf("%w: the daemon is stopping", errConnLimit)
	case len(t.mu.open) >= t.max:
		return nil, fmt.Errorf("%w: %d connections are open, at most %d (--max-connections); peer uid %d pid %d", errConnLimit, len(t.mu.open), t.max, c.peer.UID, c.peer.PID)
	case t.mu.perUID[c.peer.UID] >= t.maxPerUID:
		return nil, fmt.Errorf("%w: uid %d has %d connections open, at most %d per uid (--max-connections-per-uid); peer pid %d", errConnLimit, c.peer.UID, t.mu.perUID[c.peer.UID], t.maxPerUID, c.peer.PID)
	}
	t.mu.open[c.id] = c
	t.mu.perUID[c.peer.UID]++
	return c, nil
}

// logRefusal counts a refused connection and logs it, at most once a
// second: a client that floods the socket must not flood the log too.
func (t *connTable) logRefusal(err error) {
	t.refused.warn(t.log, "connection refused", "err", err)
}

func (t *connTable) closed(c *conn) {
	t.mu.Lock()
	delete(t.mu.open, c.id)
	if t.mu.perUID[c.peer.UID]--; t.mu.perUID[c.peer.UID] <= 0 {
		delete(t.mu.perUID, c.peer.UID)
	}
	regs := t.mu.regs[c.id]
	delete(t.mu.regs, c.id)
	t.mu.Unlock()
	t.onClose(c.id, regs)
}

// addRegistration records that connection c made registration reg. It
// reports false if the connection has closed meanwhile: the caller must
// release the registration itself, as onClose will not see it.
func (t *connTable) addRegistration(c PeerInfo, reg uint64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.mu.open[c.ConnID]; !ok {
		return false
	}
	t.mu.regs[c.ConnID] = append(t.mu.regs[c.ConnID], reg)
	t.mu.owners[reg] = owner{conn: c.ConnID, peer: c.Peer}
	return true
}

// ownerOf returns who made registration reg.
func (t *connTable) ownerOf(reg uint64) (owner, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	o, ok := t.mu.owners[reg]
	return o, ok
}

// forget drops registration reg: its client unregistered it, or its
// connection closed and it has been released.
func (t *connTable) forget(reg uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	o, ok := t.mu.owners[reg]
	if !ok {
		return
	}
	delete(t.mu.owners, reg)
	regs := t.mu.regs[o.conn]
	for i, r := range regs {
		if r == reg {
			t.mu.regs[o.conn] = append(regs[:i], regs[i+1:]...)
			break
		}
	}
}

// close closes connection id, if open.
func (t *connTable) close(id uint64) {
	t.mu.Lock()
	c := t.mu.open[id]
	t.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

// closeAll refuses new connections and closes every open one, those still
// in their handshake included (grpc's Stop waits for those).
func (t *connTable) closeAll() {
	t.mu.Lock()
	t.mu.closed = true
	open := make([]*conn, 0, len(t.mu.open))
	for _, c := range t.mu.open {
		open = append(open, c)
	}
	t.mu.Unlock()
	for _, c := range open {
		c.Close()
	}
}

// count reports the open connections.
func (t *connTable) count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.mu.open)
}

// peerOfConn reads the peer's credentials the kernel recorded at connect.
func peerOfConn(uc *net.UnixConn) (dma.Peer, error) {
	raw, err := uc.SyscallConn()
	if err != nil {
		return dma.Peer{}, err
	}
	var p dma.Peer
	var cerr error
	err = raw.Control(func(fd uintptr) {
		var cred *unix.Ucred
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		if cerr != nil {
			cerr = fmt.Errorf("SO_PEERCRED: %w", cerr)
			return
		}
		p = dma.Peer{PID: cred.Pid, UID: cred.Uid, GID: cred.Gid}
		p.Groups, cerr = peerGroups(int(fd))
	})
	if err == nil {
		err = cerr
	}
	return p, err
}

// peerGroups reads SO_PEERGROUPS: the supplementary groups of the peer at
// connect (Linux 4.13+).
func peerGroups(fd int) ([]uint32, error) {
	buf := make([]uint32, 64)
	for {
		n := uint32(len(buf) * 4)
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_PEERGROUPS,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&n)), 0)
		switch {
		case errno == 0:
			return buf[:n/4], nil
		case errno == unix.ERANGE && int(n/4) > len(buf) && n/4 <= 1<<16:
			buf = make([]uint32, n/4) // n now says how much it needs
		case errno == unix.ENODATA:
			return nil, nil
		default:
			return nil, fmt.Errorf("SO_PEERGROUPS: %w", errno)
		}
	}
}
