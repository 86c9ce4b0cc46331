package server

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// PeerInfo is the AuthInfo of a connection: who is on the other end of the
// unix socket (SO_PEERCRED) and a number naming the connection, so that
// registrations die with the connection that made them.
type PeerInfo struct {
	credentials.CommonAuthInfo
	Peer   dma.Peer
	ConnID uint64
	// HasCred is false on a TCP connection (tests only): no peer identity.
	HasCred bool
}

// AuthType implements credentials.AuthInfo.
func (PeerInfo) AuthType() string { return "peercred" }

// peerCreds is transport "security" for a unix socket: no encryption (the
// socket's mode already limits who connects), but it reads the peer's
// credentials and reports when a connection closes.
type peerCreds struct {
	next    atomic.Uint64
	onClose func(connID uint64)
}

func (c *peerCreds) ClientHandshake(ctx context.Context, _ string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return conn, PeerInfo{}, nil
}

func (c *peerCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	info := PeerInfo{ConnID: c.next.Add(1)}
	info.SecurityLevel = credentials.NoSecurity
	if uc, ok := conn.(*net.UnixConn); ok {
		raw, err := uc.SyscallConn()
		if err != nil {
			return nil, nil, err
		}
		var cred *unix.Ucred
		var cerr error
		err = raw.Control(func(fd uintptr) {
			cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		})
		if err == nil {
			err = cerr
		}
		if err != nil {
			return nil, nil, fmt.Errorf("SO_PEERCRED: %w", err)
		}
		info.Peer = dma.Peer{PID: cred.Pid, UID: cred.Uid, GID: cred.Gid}
		info.HasCred = true
	}
	return &trackedConn{Conn: conn, id: info.ConnID, onClose: c.onClose}, info, nil
}

func (c *peerCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "peercred"}
}

func (c *peerCreds) Clone() credentials.TransportCredentials { return c }

func (c *peerCreds) OverrideServerName(string) error { return nil }

type trackedConn struct {
	net.Conn
	id      uint64
	once    sync.Once
	onClose func(uint64)
}

func (t *trackedConn) Close() error {
	err := t.Conn.Close()
	t.once.Do(func() {
		if t.onClose != nil {
			t.onClose(t.id)
		}
	})
	return err
}
