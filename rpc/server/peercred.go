package server

import (
	"context"
	"net"

	"google.golang.org/grpc/credentials"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// PeerInfo is the AuthInfo of a connection: who is on the other end of the
// unix socket (SO_PEERCRED, SO_PEERGROUPS) and the number naming the
// connection, to which registrations (and leases) belong.
type PeerInfo struct {
	credentials.CommonAuthInfo
	Peer   dma.Peer
	ConnID uint64
	// HasCred is false on a connection that is not a unix socket: no
	// peer identity, so no Register.
	HasCred bool
}

// AuthType implements credentials.AuthInfo.
func (PeerInfo) AuthType() string { return "peercred" }

// peerCreds is transport "security" for a unix socket: no encryption (the
// socket's mode already limits who connects); it hands gRPC the identity
// the listener read when it accepted the connection.
type peerCreds struct{}

func (peerCreds) ClientHandshake(ctx context.Context, _ string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return conn, PeerInfo{}, nil
}

func (peerCreds) ServerHandshake(nc net.Conn) (net.Conn, credentials.AuthInfo, error) {
	info := PeerInfo{}
	info.SecurityLevel = credentials.NoSecurity
	if c, ok := nc.(*conn); ok {
		info.ConnID, info.Peer, info.HasCred = c.id, c.peer, c.hasCred
	}
	return nc, info, nil
}

func (peerCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "peercred"}
}

func (c peerCreds) Clone() credentials.TransportCredentials { return c }

func (peerCreds) OverrideServerName(string) error { return nil }
