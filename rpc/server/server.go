// Package server serves the kvoffload.v1 gRPC API over a unix socket: it
// decodes and bounds requests, turns them into offload.Service calls, maps
// domain errors to status codes, and ties registrations to the connection
// that made them.
package server

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/offload"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// MaxMessageBytes bounds one request on the wire. A Store or Load of 65536
// blocks with 32-byte hashes is about 2.5 MiB.
const MaxMessageBytes = 16 << 20

// MaxCompletionsWait bounds how long a Completions call may wait.
const MaxCompletionsWait = 10 * time.Second

// Version is reported by Stats; the daemon sets it from its build.
var Version = "dev"

// Server implements pb.KVOffloadServer.
type Server struct {
	pb.UnimplementedKVOffloadServer
	svc    *offload.Service
	log    *slog.Logger
	health *health.Server
	grpc   *grpc.Server
	reaper sync.WaitGroup

	mu struct {
		sync.Mutex
		byConn map[uint64][]uint64 // connection -> registrations it made
	}
}

var _ pb.KVOffloadServer = (*Server)(nil)

// New builds the gRPC server with the API, health and reflection services.
func New(svc *offload.Service, log *slog.Logger) *Server {
	s := &Server{svc: svc, log: log, health: health.NewServer()}
	s.mu.byConn = map[uint64][]uint64{}
	creds := &peerCreds{onClose: s.connClosed}
	s.grpc = grpc.NewServer(
		grpc.Creds(creds),
		grpc.MaxRecvMsgSize(MaxMessageBytes),
		// Replies carrying results are bounded by the service (a
		// Completions reply is cut to it): the send limit allows it.
		grpc.MaxSendMsgSize(max(MaxMessageBytes, svc.Limits().MaxReplyBytes())),
	)
	pb.RegisterKVOffloadServer(s.grpc, s)
	healthpb.RegisterHealthServer(s.grpc, s.health)
	reflection.Register(s.grpc)
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	s.health.SetServingStatus(pb.KVOffload_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	return s
}

// GRPC is the underlying server, to Serve on a listener.
func (s *Server) GRPC() *grpc.Server { return s.grpc }

// SetNotServing flips health to NOT_SERVING: the first step of a shutdown.
func (s *Server) SetNotServing() { s.health.Shutdown() }

// Stop stops gracefully, falling back to a hard stop after timeout, then
// waits for the unregistrations of closed connections.
func (s *Server) Stop(timeout time.Duration) {
	done := make(chan struct{})
	go func() { s.grpc.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(timeout):
		s.log.Warn("graceful stop timed out; closing connections", "timeout", timeout)
		s.grpc.Stop()
		<-done
	}
	s.reaper.Wait()
}

func (s *Server) connClosed(connID uint64) {
	// Nobody else may use the connection's leases: their pins go now.
	s.svc.ReleaseOwner(offload.Owner(connID))
	s.mu.Lock()
	regs := s.mu.byConn[connID]
	delete(s.mu.byConn, connID)
	s.mu.Unlock()
	if len(regs) == 0 {
		return
	}
	s.reaper.Add(1)
	go func() {
		defer s.reaper.Done()
		for _, id := range regs {
			if err := s.svc.Unregister(id); err == nil {
				s.log.Info("connection closed; registration released", "registration", id)
			}
		}
	}()
}

func peerOf(ctx context.Context) (PeerInfo, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return PeerInfo{}, false
	}
	info, ok := p.AuthInfo.(PeerInfo)
	return info, ok
}

// ownerOf names the caller's connection for the service's leases.
func ownerOf(ctx context.Context) offload.Owner {
	info, _ := peerOf(ctx)
	return offload.Owner(info.ConnID)
}

// toStatus maps a domain error to a gRPC status.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	code := codes.Internal
	switch {
	case errors.Is(err, offload.ErrInvalid), errors.Is(err, offload.ErrUnknownNamespace),
		errors.Is(err, dma.ErrBadRegion), errors.Is(err, dma.ErrNoCUDA):
		code = codes.InvalidArgument
	case errors.Is(err, offload.ErrUnknownRegistration):
		code = codes.NotFound
	case errors.Is(err, offload.ErrLayoutMismatch):
		code = codes.FailedPrecondition
	case errors.Is(err, offload.ErrBacklog), errors.Is(err, offload.ErrLimit):
		code = codes.ResourceExhausted
	case errors.Is(err, offload.ErrShuttingDown):
		code = codes.Unavailable
	case errors.Is(err, context.Canceled):
		code = codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		code = codes.DeadlineExceeded
	}
	return status.Error(code, err.Error())
}

func invalid(msg string) error { return status.Error(codes.InvalidArgument, msg) }

// Register implements pb.KVOffloadServer.
func (s *Server) Register(ctx context.Context, req *pb.RegisterRequest) (*pb.RegisterResponse, error) {
	info, ok := peerOf(ctx)
	if !ok || !info.HasCred {
		return nil, status.Error(codes.PermissionDenied, "Register needs a unix-socket connection: the daemon checks region files against the peer's credentials")
	}
	l := req.GetLayout()
	if l == nil {
		return nil, invalid("layout is missing")
	}
	if len(l.GetSegments()) > layout.MaxSegments {
		return nil, invalid("layout.segments has too many entries")
	}
	lay := layout.Layout{HashBytes: int(l.GetHashBytes()), Segments: make([]layout.Segment, len(l.GetSegments()))}
	for i, sg := range l.GetSegments() {
		lay.Segments[i] = layout.Segment{Group: sg.GetGroup(), Bytes: sg.GetBytes()}
	}
	if len(req.GetRegions()) > layout.MaxSegments {
		return nil, invalid("regions has too many entries")
	}
	specs := make([]dma.RegionSpec, len(req.GetRegions()))
	for i, r := range req.GetRegions() {
		sp := dma.RegionSpec{Offset: r.GetOffset(), BlockStride: r.GetBlockStride(), NumBlocks: r.GetNumBlocks()}
		switch m := r.GetMemory().(type) {
		case *pb.Region_ShmPath:
			sp.ShmPath = m.ShmPath
		case *pb.Region_Cuda:
			sp.CUDA = &dma.IPCMemory{Handle: m.Cuda.GetHandle(), Device: int(m.Cuda.GetDevice()), AllocSize: m.Cuda.GetAllocSize()}
		default:
			return nil, invalid("regions[" + strconv.Itoa(i) + "] names no memory: set shm_path or cuda")
		}
		specs[i] = sp
	}
	reg, joined, err := s.svc.Register(req.GetFingerprint(), lay, specs, info.Peer, req.GetClientName())
	if err != nil {
		return nil, toStatus(err)
	}
	s.mu.Lock()
	s.mu.byConn[info.ConnID] = append(s.mu.byConn[info.ConnID], reg.ID)
	s.mu.Unlock()
	return &pb.RegisterResponse{RegistrationId: reg.ID, NamespaceId: reg.Namespace().ID, JoinedExisting: joined}, nil
}

// Unregister implements pb.KVOffloadServer.
func (s *Server) Unregister(ctx context.Context, req *pb.UnregisterRequest) (*pb.UnregisterResponse, error) {
	if err := s.svc.Unregister(req.GetRegistrationId()); err != nil {
		return nil, toStatus(err)
	}
	return &pb.UnregisterResponse{}, nil
}

// Resolve implements pb.KVOffloadServer.
func (s *Server) Resolve(ctx context.Context, req *pb.ResolveRequest) (*pb.ResolveResponse, error) {
	ids, err := s.svc.Resolve(req.GetFingerprints())
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.ResolveResponse{NamespaceIds: ids}, nil
}

func keysOf(k *pb.KeyList) offload.Keys {
	return offload.Keys{Group: k.GetGroup(), Hashes: k.GetHashes()}
}

// Lookup implements pb.KVOffloadServer.
func (s *Server) Lookup(ctx context.Context, req *pb.LookupRequest) (*pb.LookupResponse, error) {
	if req.GetKeys() == nil {
		return nil, invalid("keys is missing")
	}
	res, err := s.svc.Lookup(ownerOf(ctx), req.GetNamespaceIds(), keysOf(req.GetKeys()), time.Duration(req.GetLeaseMs())*time.Millisecond, req.GetPeek())
	if err != nil {
		return nil, toStatus(err)
	}
	out := &pb.LookupResponse{Ready: uint32(res.Ready), LeaseId: res.LeaseID, Tiers: make([]pb.Tier, len(res.Tiers))}
	for i, t := range res.Tiers {
		out.Tiers[i] = pb.Tier(t)
	}
	return out, nil
}

// Store implements pb.KVOffloadServer.
func (s *Server) Store(ctx context.Context, req *pb.TransferRequest) (*pb.TransferResponse, error) {
	return s.transfer(ctx, offload.OpStore, req)
}

// Load implements pb.KVOffloadServer.
func (s *Server) Load(ctx context.Context, req *pb.TransferRequest) (*pb.TransferResponse, error) {
	return s.transfer(ctx, offload.OpLoad, req)
}

func (s *Server) transfer(ctx context.Context, op offload.Op, req *pb.TransferRequest) (*pb.TransferResponse, error) {
	reg, err := s.svc.Registration(req.GetRegistrationId())
	if err != nil {
		return nil, toStatus(err)
	}
	jobs := make([]offload.Job, len(req.GetJobs()))
	for i, j := range req.GetJobs() {
		if j.GetKeys() == nil {
			return nil, invalid("jobs[" + strconv.Itoa(i) + "].keys is missing")
		}
		jobs[i] = offload.Job{ID: j.GetJobId(), RequestID: j.GetRequestId(), Keys: keysOf(j.GetKeys()), BlockIDs: j.GetBlockIds(), LeaseID: j.GetLeaseId()}
	}
	results, err := reg.Transfer(ctx, ownerOf(ctx), op, jobs, req.GetWait(), req.GetReadyEvent())
	if err != nil {
		return nil, toStatus(err)
	}
	out := &pb.TransferResponse{}
	if results != nil {
		out.Results = toResults(results)
	}
	return out, nil
}

func toResults(rs []offload.Result) []*pb.JobResult {
	out := make([]*pb.JobResult, len(rs))
	for i, r := range rs {
		jr := &pb.JobResult{JobId: r.JobID, RequestId: r.RequestID, Op: pb.Op(r.Op), Ok: r.OK, Blocks: r.Blocks, Bytes: r.Bytes, Seq: r.Seq}
		if len(r.Failures) > 0 {
			jr.Failures = make([]*pb.BlockFailure, len(r.Failures))
			for j, f := range r.Failures {
				jr.Failures[j] = &pb.BlockFailure{Index: f.Index, BlockId: f.BlockID, Hash: f.Hash, Status: pb.BlockStatus(f.Status)}
			}
		}
		out[i] = jr
	}
	return out
}

// Completions implements pb.KVOffloadServer.
func (s *Server) Completions(ctx context.Context, req *pb.CompletionsRequest) (*pb.CompletionsResponse, error) {
	reg, err := s.svc.Registration(req.GetRegistrationId())
	if err != nil {
		return nil, toStatus(err)
	}
	wait := min(time.Duration(req.GetWaitMs())*time.Millisecond, MaxCompletionsWait)
	var ack *uint64
	if req.AckSeq != nil {
		ack = req.AckSeq
	}
	c, err := reg.Completions(ctx, wait, int(req.GetMaxJobs()), ack)
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.CompletionsResponse{Results: toResults(c.Results), Pending: uint32(c.Pending), More: c.More}, nil
}

// Invalidate implements pb.KVOffloadServer.
func (s *Server) Invalidate(ctx context.Context, req *pb.InvalidateRequest) (*pb.InvalidateResponse, error) {
	var keys *offload.Keys
	if req.GetKeys() != nil {
		k := keysOf(req.GetKeys())
		keys = &k
	}
	n, err := s.svc.Invalidate(req.GetNamespaceIds(), keys)
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.InvalidateResponse{Removed: uint64(n)}, nil
}

// Stats implements pb.KVOffloadServer.
func (s *Server) Stats(ctx context.Context, req *pb.StatsRequest) (*pb.StatsResponse, error) {
	st := s.svc.Stats()
	out := &pb.StatsResponse{
		Lookups: st.Lookups, LookupHits: st.LookupHits, BlocksStored: st.BlocksStored,
		BlocksLoaded: st.BlocksLoaded, BlocksFailed: st.BlocksFailed, Evictions: st.Evictions, Version: Version,
	}
	for _, t := range st.Tiers {
		out.Tiers = append(out.Tiers, &pb.TierStats{Name: t.Name, CapacityBytes: t.CapacityBytes, UsedBytes: t.UsedBytes, Blocks: t.Blocks})
	}
	for _, n := range st.Namespaces {
		out.Namespaces = append(out.Namespaces, &pb.NamespaceStats{NamespaceId: n.ID, Fingerprint: n.Fingerprint, Registrations: uint32(n.Registrations), Blocks: n.Blocks})
	}
	return out, nil
}
