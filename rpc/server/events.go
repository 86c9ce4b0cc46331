package server

import (
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/events"
	"github.com/kvoffloadd/kvoffloadd/index"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// MaxEventsPerReply bounds one WatchEvents reply (about 64 KiB).
const MaxEventsPerReply = 1024

// WatchEvents implements pb.KVOffloadServer. The stream is this handler's:
// it ends when the client goes (its context) or the server stops serving,
// and the subscription with it.
func (s *Server) WatchEvents(req *pb.WatchEventsRequest, stream pb.KVOffload_WatchEventsServer) error {
	sub, err := s.svc.Subscribe(req.GetNamespaceIds())
	if err != nil {
		return toStatus(err)
	}
	defer sub.Close()
	n := int(req.GetMaxEvents())
	if n <= 0 || n > MaxEventsPerReply {
		n = MaxEventsPerReply
	}
	buf := make([]events.Event, 0, n)
	ctx := stream.Context()
	for {
		evs, err := sub.Next(ctx, s.stopping, buf)
		if errors.Is(err, events.ErrStopped) {
			return status.Error(codes.Unavailable, "the daemon is shutting down")
		}
		if err != nil {
			return toStatus(err)
		}
		if err := stream.Send(&pb.WatchEventsResponse{Events: toEvents(evs)}); err != nil {
			return err
		}
		buf = evs[:0]
	}
}

var eventKinds = [...]pb.EventKind{
	events.Stored:   pb.EventKind_EVENT_KIND_BLOCK_STORED,
	events.Removed:  pb.EventKind_EVENT_KIND_BLOCK_REMOVED,
	events.Cleared:  pb.EventKind_EVENT_KIND_ALL_BLOCKS_CLEARED,
	events.Lost:     pb.EventKind_EVENT_KIND_EVENTS_LOST,
	events.CaughtUp: pb.EventKind_EVENT_KIND_CAUGHT_UP,
}

func toEvents(evs []events.Event) []*pb.KVEvent {
	out := make([]*pb.KVEvent, len(evs))
	for i := range evs {
		e := &evs[i]
		pe := &pb.KVEvent{Seq: e.Seq, Kind: eventKinds[e.Kind]}
		if e.Kind == events.Stored || e.Kind == events.Removed {
			switch e.Tier {
			case index.InDisk:
				pe.Tier = pb.Tier_TIER_DISK
			case events.Remote:
				pe.Tier = pb.Tier_TIER_REMOTE
			default:
				pe.Tier = pb.Tier_TIER_CPU
			}
			pe.NamespaceId, pe.Group, pe.Hash = e.Key.NS, e.Key.Group, append([]byte(nil), e.Hash()...)
		}
		out[i] = pe
	}
	return out
}
