// Package server serves the kvoffload.v1 gRPC API over a unix socket: it
// decodes and bounds requests, turns them into offload.Service calls, maps
// domain errors to status codes, and ties registrations to the connection
// that made them.
package server

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/offload"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// MaxMessageBytes bounds one reply on the wire. Requests have a limit of
// their own, computed from the request bounds (MaxRequestBytes).
const MaxMessageBytes = 16 << 20

// MaxCompletionsWait bounds how long a Completions call may wait.
const MaxCompletionsWait = 10 * time.Second

// HandshakeTimeout bounds how long a new connection may take to finish its
// HTTP/2 preface: grpc's default, 120 s, would let one connection that
// never sends it hold the shutdown that long.
const HandshakeTimeout = 10 * time.Second

// Per connection: concurrent calls, and the bytes a call's unread request
// may take in the transport's buffers (the HTTP/2 stream window; 64 KiB is
// grpc's least). Together with Config.MaxConnections they bound what
// requests not yet admitted by the budget can hold.
const (
	MaxStreamsPerConn = 16
	streamWindowBytes = 64 << 10
	maxHeaderBytes    = 16 << 10
)

// Version is reported by Stats and Register; the daemon sets it from its
// build (the VERSION file).
var Version = "dev"

// The API protocol: a number apart from the release version, raised when a
// change makes a client and a daemon misread each other (a new meaning of an
// old field, not a new optional field). The daemon speaks every protocol
// from MinProtocolVersion to ProtocolVersion and refuses a Register in
// another (checkProtocol). The Python client has the same number
// (kvoffload/_version.py); deploy/version_test.go holds them together.
const (
	ProtocolVersion    = 1
	MinProtocolVersion = 1
)

// checkProtocol refuses a client whose protocol the daemon does not speak,
// naming both sides' versions so that the operator knows what to install.
// 0 comes from clients older than the number: they speak protocol 1.
func checkProtocol(req *pb.RegisterRequest) error {
	p := req.GetProtocolVersion()
	if p == 0 {
		p = 1
	}
	if p >= MinProtocolVersion && p <= ProtocolVersion {
		return nil
	}
	client := req.GetClientVersion()
	if client == "" {
		client = "unknown version"
	}
	return status.Errorf(codes.FailedPrecondition,
		"version mismatch: kvoffloadd %s speaks API protocol %s, the client (kvoffload %s) speaks protocol %d: install the connector of the daemon's release",
		Version, protocolRange(), client, p)
}

func protocolRange() string {
	if MinProtocolVersion == ProtocolVersion {
		return strconv.Itoa(ProtocolVersion)
	}
	return strconv.Itoa(MinProtocolVersion) + " to " + strconv.Itoa(ProtocolVersion)
}

// Config bounds what clients may make the server hold. Zero fields take
// DefaultConfig's.
type Config struct {
	// Connections open at once, in total and per peer uid; one past
	// either is closed at accept.
	MaxConnections       int
	MaxConnectionsPerUID int
	// MaxInflightRequestBytes bounds the request bytes being received or
	// handled at once over every connection (see budget).
	MaxInflightRequestBytes int64
	// ReceiveTimeout bounds a request's wait for that budget and the time
	// its body may then take to arrive (default DefaultReceiveTimeout).
	ReceiveTimeout time.Duration
	// Registerer, when set, gets the server's metrics.
	Registerer prometheus.Registerer
}

// DefaultConfig serves an engine per GPU and its scheduler with room to
// spare.
var DefaultConfig = Config{
	MaxConnections:          128,
	MaxConnectionsPerUID:    32,
	MaxInflightRequestBytes: 64 << 20,
	ReceiveTimeout:          DefaultReceiveTimeout,
}

// Server implements pb.KVOffloadServer.
type Server struct {
	pb.UnimplementedKVOffloadServer
	svc    *offload.Service
	log    *slog.Logger
	health *health.Server
	grpc   *grpc.Server
	conns  *connTable
	budget *budget
	maxReq int
	reaper sync.WaitGroup
	// foreign counts (and logs, rate-limited) calls naming another
	// connection's registration.
	foreign rateLog

	stopping     chan struct{} // closed by SetNotServing: waits for budget end
	stoppingOnce sync.Once

	lis atomic.Pointer[listener] // what Serve accepts on (StopAccepting)
	// resultsOnly: the daemon is stopping and its connections stay open
	// only for their clients to read the results of the jobs it drained
	// (StopAccepting).
	resultsOnly atomic.Bool
}

// resultsOnlyMethods are the calls a stopping daemon still answers while
// clients read their results: those and letting go of a registration.
var resultsOnlyMethods = map[string]bool{"Completions": true, "Unregister": true, "Stats": true}

var _ pb.KVOffloadServer = (*Server)(nil)

// New builds the gRPC server with the API, health and reflection services.
func New(svc *offload.Service, log *slog.Logger, cfg Config) *Server {
	d := DefaultConfig
	if cfg.MaxConnections == 0 {
		cfg.MaxConnections = d.MaxConnections
	}
	if cfg.MaxConnectionsPerUID == 0 {
		cfg.MaxConnectionsPerUID = d.MaxConnectionsPerUID
	}
	if cfg.MaxInflightRequestBytes == 0 {
		cfg.MaxInflightRequestBytes = d.MaxInflightRequestBytes
	}
	if cfg.ReceiveTimeout == 0 {
		cfg.ReceiveTimeout = d.ReceiveTimeout
	}
	s := &Server{svc: svc, log: log, health: health.NewServer(), stopping: make(chan struct{})}
	s.maxReq = MaxRequestBytes(svc.Limits())
	s.budget = newBudget(max(cfg.MaxInflightRequestBytes, int64(s.maxReq)), int64(s.maxReq), cfg.ReceiveTimeout)
	s.conns = newConnTable(cfg.MaxConnections, cfg.MaxConnectionsPerUID, log, s.connClosed)
	s.registerMetrics(cfg.Registerer)
	s.grpc = grpc.NewServer(
		grpc.Creds(peerCreds{}),
		grpc.MaxRecvMsgSize(s.maxReq),
		// Replies carrying results are bounded by the service (a
		// Completions reply is cut to it): the send limit allows it.
		grpc.MaxSendMsgSize(max(MaxMessageBytes, svc.Limits().MaxReplyBytes())),
		grpc.ConnectionTimeout(HandshakeTimeout),
		grpc.MaxConcurrentStreams(MaxStreamsPerConn),
		grpc.StaticStreamWindowSize(streamWindowBytes),
		grpc.MaxHeaderListSize(maxHeaderBytes),
		grpc.StreamInterceptor(s.guardStream),
	)
	s.grpc.RegisterService(s.guardUnary(&pb.KVOffload_ServiceDesc), s)
	s.grpc.RegisterService(s.guardUnary(&healthpb.Health_ServiceDesc), s.health)
	reflection.Register(s.grpc)
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	s.health.SetServingStatus(pb.KVOffload_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	return s
}

// Serve serves on lis (a unix socket) until Stop. Every connection is
// admitted within the connection bounds and known by the peer the kernel
// recorded for it.
func (s *Server) Serve(lis net.Listener) error {
	l := &listener{Listener: lis, t: s.conns}
	s.lis.Store(l)
	return s.grpc.Serve(l)
}

// StopAccepting closes the listener (with the daemon's socket: a successor
// may take the path) and keeps the connections open, but answers only
// Completions, Unregister, Stats and health from then on: a stopping
// daemon's clients read the results of the jobs it drained on the
// connections they have. Serve returns the listener's error. Stop ends
// the connections.
func (s *Server) StopAccepting() {
	s.resultsOnly.Store(true)
	if l := s.lis.Load(); l != nil {
		l.Close()
	}
}

// MaxRequestBytes is the largest request this server reads.
func (s *Server) MaxRequestBytes() int { return s.maxReq }

// InflightRequestBytes reports the request bytes booked now (see budget).
func (s *Server) InflightRequestBytes() int64 {
	s.budget.mu.Lock()
	defer s.budget.mu.Unlock()
	return s.budget.used
}

// Connections reports the connections open now.
func (s *Server) Connections() int { return s.conns.count() }

// SetNotServing flips health to NOT_SERVING: the first step of a shutdown.
func (s *Server) SetNotServing() {
	s.health.Shutdown()
	s.stoppingOnce.Do(func() { close(s.stopping) })
}

// Stop stops gracefully until deadline, then closes every connection,
// those still in their handshake included, and waits for the
// unregistrations of closed connections. It returns by the deadline unless
// an unregistration waits for copies still running; ctx ending stops that
// wait too.
func (s *Server) Stop(deadline time.Time) {
	s.SetNotServing()
	done := make(chan struct{})
	go func() { s.grpc.GracefulStop(); close(done) }()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		s.log.Warn("graceful stop timed out; closing connections", "open", s.conns.count())
		// grpc's Stop waits for connections still in their handshake:
		// close them all first.
		s.conns.closeAll()
		s.grpc.Stop()
		<-done
	}
	s.conns.closeAll()
	s.reaper.Wait()
}

// connClosed releases what a closed connection held: its leases' pins at
// once (nobody else may use them), and its registrations once their jobs
// drain, then their regions are unmapped.
func (s *Server) connClosed(connID uint64, regs []uint64) {
	s.svc.ReleaseOwner(offload.Owner(connID))
	if len(regs) == 0 {
		return
	}
	s.reaper.Add(1)
	go func() {
		defer s.reaper.Done()
		for _, id := range regs {
			if err := s.svc.Unregister(id); err == nil {
				s.log.Info("connection closed; registration released", "registration", id, "conn", connID)
			}
			s.conns.forget(id)
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
	case errors.Is(err, offload.ErrBacklog), errors.Is(err, offload.ErrLimit), errors.Is(err, dma.ErrLimit):
		code = codes.ResourceExhausted
	case errors.Is(err, offload.ErrShuttingDown):
		return stoppingError(err.Error())
	// The remote tier missed an invalidation's record (a master down):
	// the call did its part here, and a retry of it may complete it.
	case errors.Is(err, offload.ErrRemoteUnrecorded):
		code = codes.Unavailable
	// The disk's faults, by codes.go's litmus test: out of space is
	// RESOURCE_EXHAUSTED ("the entire file system is out of space"); a
	// directory that refuses writes will not accept a retry until someone
	// fixes it, FAILED_PRECONDITION; a device error may pass, UNAVAILABLE.
	case errors.Is(err, offload.ErrDiskFull):
		code = codes.ResourceExhausted
	case errors.Is(err, offload.ErrDiskReadOnly):
		code = codes.FailedPrecondition
	case errors.Is(err, offload.ErrDiskFailed):
		code = codes.Unavailable
	case errors.Is(err, context.Canceled):
		code = codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		code = codes.DeadlineExceeded
	}
	return status.Error(code, err.Error())
}

func invalid(msg string) error { return status.Error(codes.InvalidArgument, msg) }

// RefusalKey is the trailer metadata key the daemon sets on a call it
// refused whole because it is stopping (its value is RefusalStopping):
// nothing of the call ran, by the daemon's own decision, so a client may
// send its jobs again to the next daemon. A transport failure never
// carries it (docs/api.md, Errors).
const (
	RefusalKey      = "kvoffload-refusal"
	RefusalStopping = "daemon-stopping"
)

// stopping is the status of a call refused because the daemon is
// stopping; the handler's wrapper (guardUnary, WatchEvents) sees it and
// sets the RefusalKey trailer.
type stopping struct{ st *status.Status }

func (e stopping) Error() string              { return e.st.Err().Error() }
func (e stopping) GRPCStatus() *status.Status { return e.st }

func stoppingError(msg string) error {
	return stopping{status.New(codes.Unavailable, msg)}
}

// isStopping reports whether err is a stopping daemon's refusal.
func isStopping(err error) bool {
	var st stopping
	return errors.As(err, &st)
}

// refusalTrailer marks a stopping daemon's refusal on the call's trailer.
var refusalTrailer = metadata.Pairs(RefusalKey, RefusalStopping)

// Register implements pb.KVOffloadServer.
func (s *Server) Register(ctx context.Context, req *pb.RegisterRequest) (*pb.RegisterResponse, error) {
	info, ok := peerOf(ctx)
	if !ok || !info.HasCred {
		return nil, status.Error(codes.PermissionDenied, "Register needs a unix-socket connection: the daemon checks region files against the peer's credentials")
	}
	if err := checkProtocol(req); err != nil {
		s.log.Warn("refused a client of another API protocol", "client", req.GetClientName(), "err", status.Convert(err).Message())
		return nil, err
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
			if max := s.svc.Limits().MaxRegionName; len(m.ShmPath) > max {
				return nil, invalid("regions[" + strconv.Itoa(i) + "].shm_path is longer than " + strconv.Itoa(max) + " bytes")
			}
			sp.ShmPath = m.ShmPath
		case *pb.Region_Cuda:
			sp.CUDA = &dma.IPCMemory{Handle: m.Cuda.GetHandle(), Device: int(m.Cuda.GetDevice()), DeviceUUID: m.Cuda.GetDeviceUuid(), AllocSize: m.Cuda.GetAllocSize()}
		default:
			return nil, invalid("regions[" + strconv.Itoa(i) + "] names no memory: set shm_path or cuda")
		}
		specs[i] = sp
	}
	if max := s.svc.Limits().MaxFingerprint; len(req.GetRegistrationKey()) > max {
		return nil, invalid("registration_key is longer than " + strconv.Itoa(max) + " bytes")
	}
	reg, joined, err := s.svc.Register(req.GetFingerprint(), lay, specs, info.Peer, req.GetClientName())
	if err != nil {
		return nil, toStatus(err)
	}
	if err := s.svc.SetRegistrationKey(reg, req.GetRegistrationKey()); err != nil {
		if uerr := s.svc.Unregister(reg.ID); uerr != nil {
			s.log.Warn("releasing a registration whose key was refused", "registration", reg.ID, "err", uerr)
		}
		return nil, toStatus(err)
	}
	if !s.conns.addRegistration(info, reg.ID) {
		// The connection closed while the regions were being mapped:
		// nobody can name this registration, and the connection's
		// release has already run without it.
		if err := s.svc.Unregister(reg.ID); err != nil {
			s.log.Warn("releasing a registration whose connection closed during Register", "registration", reg.ID, "err", err)
		}
		return nil, status.Error(codes.Canceled, "the connection closed during Register")
	}
	proto := req.GetProtocolVersion()
	if proto == 0 {
		proto = 1
	}
	return &pb.RegisterResponse{RegistrationId: reg.ID, NamespaceId: reg.Namespace().ID, JoinedExisting: joined,
		DaemonVersion: Version, ProtocolVersion: proto}, nil
}

// Unregister implements pb.KVOffloadServer.
func (s *Server) Unregister(ctx context.Context, req *pb.UnregisterRequest) (*pb.UnregisterResponse, error) {
	reg, err := s.registration(ctx, req.GetRegistrationId(), "Unregister")
	if err != nil {
		return nil, err
	}
	if err := s.svc.Unregister(reg.ID); err != nil {
		return nil, toStatus(err)
	}
	s.conns.forget(reg.ID)
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

// FindRegistrations implements pb.KVOffloadServer.
func (s *Server) FindRegistrations(ctx context.Context, req *pb.FindRegistrationsRequest) (*pb.FindRegistrationsResponse, error) {
	found, err := s.svc.FindRegistrations(req.GetKeys())
	if err != nil {
		return nil, toStatus(err)
	}
	out := &pb.FindRegistrationsResponse{Found: make([]*pb.FoundRegistrations, len(found))}
	for i, fps := range found {
		out.Found[i] = &pb.FoundRegistrations{Fingerprints: fps}
	}
	return out, nil
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

// ReleaseLeases implements pb.KVOffloadServer.
func (s *Server) ReleaseLeases(ctx context.Context, req *pb.ReleaseLeasesRequest) (*pb.ReleaseLeasesResponse, error) {
	n, err := s.svc.ReleaseLeases(ownerOf(ctx), req.GetLeaseIds())
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.ReleaseLeasesResponse{Released: uint32(n)}, nil
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
	reg, err := s.registration(ctx, req.GetRegistrationId(), op.String())
	if err != nil {
		return nil, err
	}
	jobs := make([]offload.Job, len(req.GetJobs()))
	for i, j := range req.GetJobs() {
		if j.GetKeys() == nil {
			return nil, invalid("jobs[" + strconv.Itoa(i) + "].keys is missing")
		}
		jobs[i] = offload.Job{ID: j.GetJobId(), RequestID: j.GetRequestId(), Keys: keysOf(j.GetKeys()), BlockIDs: j.GetBlockIds(), LeaseID: j.GetLeaseId()}
	}
	c, err := reg.Transfer(ctx, ownerOf(ctx), op, jobs, req.GetWait(), req.GetReadyEvent(), req.AckSeq)
	if err != nil {
		return nil, toStatus(err)
	}
	out := &pb.TransferResponse{Results: toResults(c.Results), More: c.More}
	if !req.GetWait() && req.AckSeq != nil {
		out.Pending = uint32(c.Pending)
	}
	return out, nil
}

func toResults(rs []offload.Result) []*pb.JobResult {
	if len(rs) == 0 {
		return nil
	}
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
	reg, err := s.registration(ctx, req.GetRegistrationId(), "Completions")
	if err != nil {
		return nil, err
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
		ProtocolVersion: ProtocolVersion, MinProtocolVersion: MinProtocolVersion,
	}
	for _, t := range st.Tiers {
		out.Tiers = append(out.Tiers, &pb.TierStats{Name: t.Name, CapacityBytes: t.CapacityBytes, UsedBytes: t.UsedBytes, Blocks: t.Blocks})
	}
	for _, n := range st.Namespaces {
		out.Namespaces = append(out.Namespaces, &pb.NamespaceStats{NamespaceId: n.ID, Fingerprint: n.Fingerprint, Registrations: uint32(n.Registrations), Blocks: n.Blocks})
	}
	if r := st.DiskRecovery; r != nil {
		out.DiskRecovery = &pb.DiskRecovery{State: pb.RecoveryState(r.State), SlotsTotal: r.SlotsTotal, SlotsScanned: r.SlotsScanned,
			BytesTotal: r.BytesTotal, BytesScanned: r.BytesScanned, BlocksRecovered: r.Blocks, BadSlots: r.Bad,
			ElapsedMs: uint64(r.Elapsed.Milliseconds())}
	}
	return out, nil
}
