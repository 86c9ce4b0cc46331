package server

import (
	"context"
	"fmt"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/offload"
)

// registration returns the registration id names, if the caller may name
// it in call. Registration ids are small sequential numbers, not
// capabilities: a registration belongs to the connection that made it, and
// every call naming it must come over that connection.
//
// One exception keeps a connector's jobs from being lost when its
// connection breaks: the daemon drains the registration's copies before it
// forgets it, and Completions may read its results from another connection
// of the same process: the same pid (visible in the daemon's pid
// namespace: pid 0 never matches) and the same uid, as the kernel recorded
// them at connect. It does not wait for the daemon to see the old
// connection close: a reconnecting client may well get there first, and
// NOT_FOUND would tell it the copies had drained. A pid reused by another
// process of the same uid is the same user, who could read those results
// anyway.
//
// Any other caller gets exactly what an unknown id gets (NOT_FOUND), so ids
// reveal nothing; the refusal is counted and logged.
func (s *Server) registration(ctx context.Context, id uint64, call string) (*offload.Registration, error) {
	info, _ := peerOf(ctx)
	unknown := toStatus(fmt.Errorf("%w: registration_id %d", offload.ErrUnknownRegistration, id))
	reg, err := s.svc.Registration(id)
	if err != nil {
		return nil, toStatus(err)
	}
	own, ok := s.conns.ownerOf(id)
	switch {
	case !ok: // being made, or released: not the caller's to name
		return nil, unknown
	case own.conn == info.ConnID && info.ConnID != 0:
		return reg, nil
	case call == "Completions" && samePeer(own.peer, info.Peer):
		return reg, nil
	}
	s.foreign.warn(s.log, "refused a call naming another connection's registration", "call", call, "registration", id,
		"conn", info.ConnID, "peer_pid", info.Peer.PID, "peer_uid", info.Peer.UID,
		"owner_conn", own.conn, "owner_pid", own.peer.PID, "owner_uid", own.peer.UID)
	return nil, unknown
}

func samePeer(a, b dma.Peer) bool {
	return a.PID != 0 && a.PID == b.PID && a.UID == b.UID
}
