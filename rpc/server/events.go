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
		if err = toStatus(err); isStopping(err) {
			stream.SetTrailer(refusalTrailer)
		}
		return err
	}
	defer sub.Close()
	n := int(req.GetMaxEvents())
	if n <= 0 || n > MaxEventsPerReply {
		n = MaxEventsPerReply
	}
	buf := make([]events.Event, 0, n)
	var out wireEvents
	resp := &pb.WatchEventsResponse{}
	ctx := stream.Context()
	for {
		evs, err := sub.Next(ctx, s.stopping, buf)
		if errors.Is(err, events.ErrStopped) {
			return status.Error(codes.Unavailable, "the daemon is shutting down")
		}
		if err != nil {
			return toStatus(err)
		}
		// One reply's messages are reused for the next: grpc encodes a
		// message in Send, and this server has no stats handler, the one
		// thing that may read it later. A snapshot of a million blocks
		// then leaves no garbage per block for the collector to chase.
		resp.Events = out.fill(evs)
		if err := stream.Send(resp); err != nil {
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

// wireEvents holds a reply's messages, reused reply after reply.
type wireEvents struct {
	msgs   []pb.KVEvent
	ptrs   []*pb.KVEvent
	hashes []byte
}

// fill sets the messages of evs and returns them.
func (w *wireEvents) fill(evs []events.Event) []*pb.KVEvent {
	if len(evs) > len(w.msgs) {
		w.msgs = make([]pb.KVEvent, len(evs))
		w.ptrs = make([]*pb.KVEvent, len(evs))
		for i := range w.msgs {
			w.ptrs[i] = &w.msgs[i]
		}
		w.hashes = make([]byte, len(evs)*len(index.Key{}.Hash))
	}
	for i := range evs {
		e, pe := &evs[i], w.ptrs[i]
		pe.Seq, pe.Kind = e.Seq, eventKinds[e.Kind]
		pe.Tier, pe.NamespaceId, pe.Group, pe.Hash = pb.Tier_TIER_NONE, 0, 0, nil
		if e.Kind == events.Stored || e.Kind == events.Removed {
			switch e.Tier {
			case index.InDisk:
				pe.Tier = pb.Tier_TIER_DISK
			case events.Remote:
				pe.Tier = pb.Tier_TIER_REMOTE
			default:
				pe.Tier = pb.Tier_TIER_CPU
			}
			h := w.hashes[i*len(e.Key.Hash):]
			pe.NamespaceId, pe.Group, pe.Hash = e.Key.NS, e.Key.Group, h[:copy(h[:e.HashLen], e.Hash())]
		}
	}
	return w.ptrs[:len(evs)]
}
