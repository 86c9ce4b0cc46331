// Package client is the reference Go client of kvoffloadd: a thin layer over
// the generated kvoffload.v1 stubs that dials the unix socket and packs keys.
// Other clients (the Python one) must behave the same on the same inputs.
package client

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// Client is a connection to one daemon. It is safe for concurrent use.
type Client struct {
	conn *grpc.ClientConn
	API  pb.KVOffloadClient

	mu struct {
		sync.Mutex
		// acked is, per registration, the seq of the last result
		// Completions returned: the next call acknowledges it.
		acked map[uint64]uint64
	}
}

// ErrDaemonStopping is wrapped in the error of a call the daemon refused
// whole because it is stopping (UNAVAILABLE with the trailer
// kvoffload-refusal: daemon-stopping, docs/api.md, Errors): nothing of
// the call ran, so its jobs may go to the next daemon. A transport failure
// (UNAVAILABLE too) never wraps it: such a call may have been accepted.
// status.Code still reads the call's code.
var ErrDaemonStopping = errors.New("the daemon is stopping and refused the call whole")

// The trailer a stopping daemon sets on a call it refused (rpc/server's
// RefusalKey and RefusalStopping).
const (
	refusalKey      = "kvoffload-refusal"
	refusalStopping = "daemon-stopping"
)

// markStopping wraps ErrDaemonStopping in the error of a call whose
// trailer says the daemon refused it because it is stopping.
func markStopping(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	var tr metadata.MD
	err := invoker(ctx, method, req, reply, cc, append(opts, grpc.Trailer(&tr))...)
	if err != nil {
		for _, v := range tr.Get(refusalKey) {
			if v == refusalStopping {
				return fmt.Errorf("%w (%w)", err, ErrDaemonStopping)
			}
		}
	}
	return err
}

// Dial connects to the daemon's unix socket. The connection is made lazily;
// the first call fails if nobody listens.
func Dial(socket string, opts ...grpc.DialOption) (*Client, error) {
	opts = append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20), grpc.MaxCallSendMsgSize(16<<20)),
		grpc.WithChainUnaryInterceptor(markStopping),
	}, opts...)
	conn, err := grpc.NewClient("unix:"+socket, opts...)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", socket, err)
	}
	c := &Client{conn: conn, API: pb.NewKVOffloadClient(conn)}
	c.mu.acked = map[uint64]uint64{}
	return c, nil
}

// Close closes the connection; the daemon then releases every registration
// made over it.
func (c *Client) Close() error { return c.conn.Close() }

// Conn is the underlying connection.
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Healthy reports whether the daemon's health service says SERVING.
func (c *Client) Healthy(ctx context.Context) (bool, error) {
	r, err := healthpb.NewHealthClient(c.conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return false, err
	}
	return r.GetStatus() == healthpb.HealthCheckResponse_SERVING, nil
}

// Keys packs block hashes of one group, each hashBytes long, into a KeyList.
// It refuses hashes of another length.
func Keys(group uint32, hashBytes int, hashes ...[]byte) (*pb.KeyList, error) {
	buf := make([]byte, 0, len(hashes)*hashBytes)
	for i, h := range hashes {
		if len(h) != hashBytes {
			return nil, fmt.Errorf("hash %d is %d bytes, want %d", i, len(h), hashBytes)
		}
		buf = append(buf, h...)
	}
	return &pb.KeyList{Group: group, Hashes: buf}, nil
}

// Register registers regions (one per layout segment) under a fingerprint.
func (c *Client) Register(ctx context.Context, fingerprint []byte, layout *pb.Layout, regions []*pb.Region, name string) (*pb.RegisterResponse, error) {
	return c.API.Register(ctx, &pb.RegisterRequest{Fingerprint: fingerprint, Layout: layout, Regions: regions, ClientName: name})
}

// Resolve returns the namespace id of each fingerprint (0 where unknown).
func (c *Client) Resolve(ctx context.Context, fingerprints ...[]byte) ([]uint32, error) {
	r, err := c.API.Resolve(ctx, &pb.ResolveRequest{Fingerprints: fingerprints})
	return r.GetNamespaceIds(), err
}

// Lookup returns how many leading keys are ready in every namespace.
func (c *Client) Lookup(ctx context.Context, namespaces []uint32, keys *pb.KeyList, leaseMs uint32) (*pb.LookupResponse, error) {
	return c.API.Lookup(ctx, &pb.LookupRequest{NamespaceIds: namespaces, Keys: keys, LeaseMs: leaseMs})
}

// Store submits store jobs; with wait it returns their results.
func (c *Client) Store(ctx context.Context, registration uint64, jobs []*pb.Job, wait bool) ([]*pb.JobResult, error) {
	r, err := c.API.Store(ctx, &pb.TransferRequest{RegistrationId: registration, Jobs: jobs, Wait: wait})
	return r.GetResults(), err
}

// Load submits load jobs; with wait it returns their results.
func (c *Client) Load(ctx context.Context, registration uint64, jobs []*pb.Job, wait bool) ([]*pb.JobResult, error) {
	r, err := c.API.Load(ctx, &pb.TransferRequest{RegistrationId: registration, Jobs: jobs, Wait: wait})
	return r.GetResults(), err
}

// Submit sends jobs of op (OP_STORE or OP_LOAD) without waiting for them,
// acknowledges what this client has read of the registration (the cursor,
// as Completions), and returns the reply: the registration's finished
// results after the cursor, in seq order (this request's own among them if
// they finished already), pending, and more when not all fit (docs/api.md,
// Results on a Store or Load). A client that sends a Store or Load every
// step reads its results this way, without a Completions call; the cursor
// moves as Completions moves it.
func (c *Client) Submit(ctx context.Context, op pb.Op, registration uint64, jobs []*pb.Job) (*pb.TransferResponse, error) {
	c.mu.Lock()
	ack := c.mu.acked[registration]
	c.mu.Unlock()
	req := &pb.TransferRequest{RegistrationId: registration, Jobs: jobs, AckSeq: &ack}
	var r *pb.TransferResponse
	var err error
	switch op {
	case pb.Op_OP_STORE:
		r, err = c.API.Store(ctx, req)
	case pb.Op_OP_LOAD:
		r, err = c.API.Load(ctx, req)
	default:
		return nil, fmt.Errorf("submit: op %v is neither a store nor a load", op)
	}
	if err == nil {
		c.read(registration, r.GetResults())
	}
	return r, err
}

// read moves the registration's cursor past results just received.
func (c *Client) read(registration uint64, rs []*pb.JobResult) {
	if len(rs) == 0 {
		return
	}
	c.mu.Lock()
	c.mu.acked[registration] = max(c.mu.acked[registration], rs[len(rs)-1].GetSeq())
	c.mu.Unlock()
}

// Completions returns finished jobs, waiting up to waitMs for one. It
// acknowledges the results the previous call returned for the registration
// (the cursor, docs/api.md): the daemon keeps a result until the call after
// the one that returned it, so a reply lost with the connection comes again
// on the next call. Read one registration's completions from one goroutine.
func (c *Client) Completions(ctx context.Context, registration uint64, waitMs uint32) (*pb.CompletionsResponse, error) {
	c.mu.Lock()
	ack := c.mu.acked[registration]
	c.mu.Unlock()
	r, err := c.API.Completions(ctx, &pb.CompletionsRequest{RegistrationId: registration, WaitMs: waitMs, AckSeq: &ack})
	if err == nil {
		c.read(registration, r.GetResults())
	}
	return r, err
}

// WaitJobs reads completions until every job id in ids has finished, and
// returns their results by job id.
func (c *Client) WaitJobs(ctx context.Context, registration uint64, ids ...uint64) (map[uint64]*pb.JobResult, error) {
	want := make(map[uint64]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	got := make(map[uint64]*pb.JobResult, len(ids))
	for len(got) < len(want) {
		r, err := c.Completions(ctx, registration, 1000)
		if err != nil {
			return got, err
		}
		for _, jr := range r.GetResults() {
			if want[jr.GetJobId()] {
				got[jr.GetJobId()] = jr
			}
		}
	}
	return got, nil
}

// Invalidate drops keys (or, with keys nil, every block) of namespaces.
func (c *Client) Invalidate(ctx context.Context, namespaces []uint32, keys *pb.KeyList) (uint64, error) {
	r, err := c.API.Invalidate(ctx, &pb.InvalidateRequest{NamespaceIds: namespaces, Keys: keys})
	return r.GetRemoved(), err
}

// Stats returns the daemon's statistics.
func (c *Client) Stats(ctx context.Context) (*pb.StatsResponse, error) {
	return c.API.Stats(ctx, &pb.StatsRequest{})
}

// Unregister releases a registration.
func (c *Client) Unregister(ctx context.Context, registration uint64) error {
	_, err := c.API.Unregister(ctx, &pb.UnregisterRequest{RegistrationId: registration})
	if err == nil {
		c.mu.Lock()
		delete(c.mu.acked, registration)
		c.mu.Unlock()
	}
	return err
}
