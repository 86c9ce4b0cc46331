package server

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// budget bounds the bytes of requests the daemon receives and handles at
// once, over every connection. grpc reads a request into memory whole
// before any handler sees it, and a connection may carry many requests at
// once: without a bound, clients sending large requests together (even
// ones that will be refused) grow the daemon's memory with their number.
//
// A request books the largest request size before grpc reads it (its size
// is not known until then), and, once decoded, keeps only its own size
// until its handler returns. A request that finds the budget spent waits
// for it (its connection's other requests go on), up to the receive
// timeout (Config.ReceiveTimeout). One
// uid may hold at most a quarter of the budget (at least one request's
// worth), so that a user whose requests stall cannot starve the others.
type budget struct {
	max, perUID int64
	wait        time.Duration
	mu          sync.Mutex
	// used is what requests hold now, byUID the same per peer uid; freed
	// is closed and replaced when bytes come back.
	used  int64
	byUID map[uint32]int64
	freed chan struct{}
}

func newBudget(total, oneRequest int64, wait time.Duration) *budget {
	return &budget{max: total, perUID: max(total/4, oneRequest), wait: wait, byUID: map[uint32]int64{}, freed: make(chan struct{})}
}

// acquire books n bytes for uid, waiting while others hold the rest.
func (b *budget) acquire(ctx context.Context, uid uint32, n int64, stop <-chan struct{}) error {
	var timeout <-chan time.Time
	for {
		b.mu.Lock()
		if b.used+n <= b.max && b.byUID[uid]+n <= b.perUID {
			b.used += n
			b.byUID[uid] += n
			b.mu.Unlock()
			return nil
		}
		freed := b.freed
		b.mu.Unlock()
		if timeout == nil {
			t := time.NewTimer(b.wait)
			defer t.Stop()
			timeout = t.C
		}
		select {
		case <-freed:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-stop:
			return stoppingError("daemon is shutting down")
		case <-timeout:
			return status.Errorf(codes.ResourceExhausted, "the daemon is receiving as many request bytes as it allows (%d over all clients, %d per uid: --max-inflight-request-bytes); try again", b.max, b.perUID)
		}
	}
}

func (b *budget) release(uid uint32, n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	b.used -= n
	if b.byUID[uid] -= n; b.byUID[uid] <= 0 {
		delete(b.byUID, uid)
	}
	close(b.freed)
	b.freed = make(chan struct{})
	b.mu.Unlock()
}

// DefaultReceiveTimeout bounds the wait for budget, and the time a request
// that holds budget may take to arrive: a client that sends a request's
// headers and then stalls would otherwise hold its share for good. A
// request that has not arrived by then has its connection closed. On a
// unix socket a request of the largest size arrives in milliseconds.
const DefaultReceiveTimeout = 30 * time.Second

// admit books budget for one request and receives it with dec. It returns
// what the request keeps booked afterwards, which the caller releases.
func (s *Server) admit(ctx context.Context, dec func(any) error, m any) (held int64, uid uint32, err error) {
	info, _ := peerOf(ctx)
	uid = info.Peer.UID
	held = int64(s.maxReq)
	if err := s.budget.acquire(ctx, uid, held, s.stopping); err != nil {
		return 0, uid, err
	}
	stall := time.AfterFunc(s.budget.wait, func() {
		s.log.Warn("a request did not arrive within the receive timeout; closing its connection",
			"conn", info.ConnID, "peer_pid", info.Peer.PID, "peer_uid", info.Peer.UID, "timeout", s.budget.wait)
		s.conns.close(info.ConnID)
	})
	err = dec(m)
	stall.Stop()
	if err != nil {
		s.budget.release(uid, held)
		return 0, uid, err
	}
	// The decoded request is about its wire size in memory, held until
	// the handler returns.
	keep := int64(0)
	if pm, ok := m.(proto.Message); ok {
		keep = min(int64(proto.Size(pm)), held)
	}
	s.budget.release(uid, held-keep)
	return keep, uid, nil
}

// guardUnary wraps every unary handler of desc so that its request is
// received within the budget. (grpc decodes a unary request inside the
// generated handler, before any interceptor runs, so an interceptor would
// come too late.)
func (s *Server) guardUnary(desc *grpc.ServiceDesc) *grpc.ServiceDesc {
	out := *desc
	out.Methods = make([]grpc.MethodDesc, len(desc.Methods))
	for i, md := range desc.Methods {
		h := md.Handler
		refusedLate := desc.ServiceName == pb.KVOffload_ServiceDesc.ServiceName && !resultsOnlyMethods[md.MethodName]
		md.Handler = func(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
			if refusedLate && s.resultsOnly.Load() {
				_ = grpc.SetTrailer(ctx, refusalTrailer)
				return nil, stoppingError("daemon is shutting down: only Completions is answered while clients read their results")
			}
			var held int64
			var uid uint32
			defer func() { s.budget.release(uid, held) }()
			resp, err := h(srv, ctx, func(m any) error {
				var err error
				held, uid, err = s.admit(ctx, dec, m)
				return err
			}, ic)
			if isStopping(err) {
				_ = grpc.SetTrailer(ctx, refusalTrailer)
			}
			return resp, err
		}
		out.Methods[i] = md
	}
	return &out
}

// guardStream is the stream interceptor that receives each message of a
// streaming RPC (reflection, health Watch) within the budget.
func (s *Server) guardStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	g := &guardedStream{ServerStream: ss, s: s}
	defer func() { s.budget.release(g.uid, g.held) }()
	return handler(srv, g)
}

type guardedStream struct {
	grpc.ServerStream
	s    *Server
	held int64 // the last message received, until the next or the end
	uid  uint32
}

func (g *guardedStream) RecvMsg(m any) error {
	g.s.budget.release(g.uid, g.held)
	g.held = 0
	held, uid, err := g.s.admit(g.Context(), g.ServerStream.RecvMsg, m)
	g.held, g.uid = held, uid
	return err
}
