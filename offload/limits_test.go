package offload_test

import (
	"math"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvoffloadd/kvoffloadd/offload"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// maximal builds the largest reply the limits allow: every job of the
// largest request with the longest request id, every block failed, every
// number at its longest varint.
func maximal(l offload.Limits, jobs int) []*pb.JobResult {
	per := l.MaxBlocksPerRequest / jobs
	out := make([]*pb.JobResult, jobs)
	hash := make([]byte, 32)
	for j := range out {
		jr := &pb.JobResult{JobId: math.MaxUint64, RequestId: strings.Repeat("r", l.MaxRequestID), Op: pb.Op_OP_LOAD,
			Blocks: math.MaxUint32, Bytes: math.MaxUint64, Seq: math.MaxUint64}
		for i := 0; i < per; i++ {
			jr.Failures = append(jr.Failures, &pb.BlockFailure{Index: math.MaxUint32, BlockId: math.MaxUint32, Hash: hash, Status: pb.BlockStatus_BLOCK_STATUS_CANCELLED})
		}
		out[j] = jr
	}
	return out
}

// TestMaxReplyBytesBoundsTheWire: MaxReplyBytes, the bound every reply
// carrying results is held to, is at least what protobuf encodes for the
// largest reply the request bounds allow, and fits a client's 16 MiB
// receive limit.
func TestMaxReplyBytesBoundsTheWire(t *testing.T) {
	l := offload.DefaultLimits
	bound := l.MaxReplyBytes()
	if bound > 16<<20 {
		t.Fatalf("MaxReplyBytes %d exceeds the clients' 16 MiB receive limit", bound)
	}
	transfer := &pb.TransferResponse{Results: maximal(l, l.MaxJobsPerRequest)}
	if n := proto.Size(transfer); n > bound {
		t.Fatalf("the largest Transfer reply is %d bytes, MaxReplyBytes %d", n, bound)
	}
	// One result of the largest job fits in a Completions reply alone.
	one := &pb.CompletionsResponse{Results: maximal(l, 1), Pending: math.MaxUint32, More: true}
	if n := proto.Size(one); n > bound {
		t.Fatalf("the largest single result is %d bytes, MaxReplyBytes %d", n, bound)
	}
	t.Logf("largest Transfer reply %d bytes, largest result %d, bound %d", proto.Size(transfer), proto.Size(one), bound)
}
