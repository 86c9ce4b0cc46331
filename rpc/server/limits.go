package server

import (
	"strings"
	"sync"

	"google.golang.org/protobuf/proto"

	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/offload"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// MaxRequestBytes is the request limit for lim: the largest request a
// client within every bound can send (maximalRequests), rounded up, with
// room to spare. grpc refuses a larger message from its 5-byte header,
// before allocating anything for it (RESOURCE_EXHAUSTED).
func MaxRequestBytes(lim offload.Limits) int {
	maxReqCache.Lock()
	defer maxReqCache.Unlock()
	if n, ok := maxReqCache.m[lim]; ok {
		return n
	}
	largest := 0
	for _, m := range maximalRequests(lim) {
		largest = max(largest, proto.Size(m))
	}
	const round = 64 << 10
	n := (largest + round + round - 1) / round * round
	maxReqCache.m[lim] = n
	return n
}

// maxReqCache keeps MaxRequestBytes per Limits: building the maximal
// requests takes tens of milliseconds.
var maxReqCache = struct {
	sync.Mutex
	m map[offload.Limits]int
}{m: map[offload.Limits]int{}}

// maximalRequests builds the largest request of each kind that every bound
// allows: each field at its widest encoding (ids and lengths near 2^64,
// strings at their bound).
func maximalRequests(lim offload.Limits) []proto.Message {
	const (
		big64 = ^uint64(0)
		big32 = ^uint32(0)
	)
	hashes := func(n int) []byte { return make([]byte, n*layout.MaxHashBytes) }
	// Store/Load: every job as wide as it can be, the blocks spread over
	// them.
	transfer := &pb.TransferRequest{RegistrationId: big64, Wait: true, ReadyEvent: make([]byte, lim.MaxReadyEvent)}
	jobs, blocks := lim.MaxJobsPerRequest, lim.MaxBlocksPerRequest
	for j := 0; j < jobs; j++ {
		n := blocks / jobs
		if j < blocks%jobs {
			n++
		}
		ids := make([]uint32, n)
		for i := range ids {
			ids[i] = big32
		}
		transfer.Jobs = append(transfer.Jobs, &pb.Job{JobId: big64, LeaseId: big64, RequestId: strings.Repeat("r", lim.MaxRequestID),
			Keys: &pb.KeyList{Group: big32, Hashes: hashes(n)}, BlockIds: ids})
	}
	nsIDs := make([]uint32, lim.MaxNamespaces)
	for i := range nsIDs {
		nsIDs[i] = big32
	}
	lookup := &pb.LookupRequest{NamespaceIds: nsIDs, Keys: &pb.KeyList{Group: big32, Hashes: hashes(lim.MaxKeysPerLookup)}, LeaseMs: big32, Peek: true}
	invalidate := &pb.InvalidateRequest{NamespaceIds: nsIDs, Keys: lookup.Keys}
	register := &pb.RegisterRequest{Fingerprint: make([]byte, lim.MaxFingerprint), ClientName: strings.Repeat("c", lim.MaxClientName),
		Layout: &pb.Layout{HashBytes: big32}, RegistrationKey: make([]byte, lim.MaxFingerprint)}
	for i := 0; i < layout.MaxSegments; i++ {
		register.Layout.Segments = append(register.Layout.Segments, &pb.Segment{Group: big32, Bytes: big64})
		r := &pb.Region{Offset: big64, BlockStride: big64, NumBlocks: big32}
		// The wider of the two kinds of memory.
		path := &pb.Region{Memory: &pb.Region_ShmPath{ShmPath: strings.Repeat("p", lim.MaxRegionName)}}
		cuda := &pb.Region{Memory: &pb.Region_Cuda{Cuda: &pb.CudaIpcMemory{Handle: make([]byte, lim.MaxRegionName), Device: -1, AllocSize: big64}}}
		if proto.Size(path) >= proto.Size(cuda) {
			r.Memory = path.Memory
		} else {
			r.Memory = cuda.Memory
		}
		register.Regions = append(register.Regions, r)
	}
	resolve := &pb.ResolveRequest{}
	for i := 0; i < lim.MaxNamespaces; i++ {
		resolve.Fingerprints = append(resolve.Fingerprints, make([]byte, lim.MaxFingerprint))
	}
	find := &pb.FindRegistrationsRequest{Keys: resolve.Fingerprints}
	return []proto.Message{transfer, lookup, invalidate, register, resolve, find,
		&pb.CompletionsRequest{RegistrationId: big64, WaitMs: big32, MaxJobs: big32}, &pb.UnregisterRequest{RegistrationId: big64}}
}
