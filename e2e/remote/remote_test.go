// Package remote_test runs kvoffloadd's remote tier end to end: two real
// daemons (service, gRPC server, unix socket, /dev/shm regions) sharing one
// real Redis Cluster, and the cluster broken in the ways a real one breaks.
package remote_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/offload"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

func TestMain(m *testing.M) { os.Exit(rediscluster.Main(m)) }

func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// nodeOpts shape one daemon of the fleet.
type nodeOpts struct {
	timeout time.Duration // default 2 s
	mac     *remote.MAC
	write   offload.WriteMode
	queue   int
	disk    bool
	diskDir string // the disk tier's directory (default a new one, with disk)
	asks    int    // MaxLookupKeys
	// publishers is RemoteConfig.Publishers; wrapStore, when set, wraps
	// the node's store (to gate it); wrap wraps its copy engine.
	publishers int
	wrapStore  func(remote.Store) remote.Store
	wrap       func(dma.Engine) dma.Engine
	// waitReplicas is RedisConfig.WaitReplicas (--remote-wait-replicas).
	waitReplicas int
	// stateDir is RemoteConfig.StateDir (--remote-state-dir).
	stateDir string
}

// startNode starts a daemon whose remote tier is the shared cluster.
func startNode(t *testing.T, c *rediscluster.Cluster, o nodeOpts) *testenv.Daemon {
	t.Helper()
	if o.timeout == 0 {
		o.timeout = 2 * time.Second
	}
	var store remote.Store
	store, err := remote.NewRedis(remote.RedisConfig{Addrs: c.Addrs()[:1], Timeout: o.timeout, WaitReplicas: o.waitReplicas})
	if err != nil {
		t.Fatal(err)
	}
	if o.wrapStore != nil {
		store = o.wrapStore(store)
	}
	// One chunk for the arena: the policy's capacity is the chunks a
	// class holds, and a class grows only when it has fewer free slots
	// than a store asks for, so several chunks would make stores near a
	// chunk's end REJECTED while the arena is mostly free.
	opts := testenv.Options{Quiet: true, CPUBytes: 64 << 20, ChunkBytes: 64 << 20, Remote: &offload.RemoteConfig{
		Store: store, MAC: o.mac, Timeout: o.timeout, Write: o.write, Queue: o.queue, MaxLookupKeys: o.asks, Publishers: o.publishers,
		StateDir: o.stateDir,
	}, Wrap: o.wrap}
	switch {
	case o.diskDir != "":
		opts.DiskDirs = []string{o.diskDir}
	case o.disk:
		opts.DiskDirs = []string{t.TempDir()}
	}
	return testenv.Start(t, opts)
}

var fpSeq atomic.Uint32

// fingerprint is a namespace fingerprint no other test (or earlier run on
// the same cluster) uses.
func fingerprint(t *testing.T) string {
	return fmt.Sprintf("%s-%d-%d-%d", t.Name(), os.Getpid(), time.Now().UnixNano(), fpSeq.Add(1))
}

// engine is one client's registered KV cache on a daemon.
type engine struct {
	d   *testenv.Daemon
	m   testenv.Model
	r   *testenv.Region
	c   *client.Client
	reg *pb.RegisterResponse
}

var model = testenv.Model{Layers: 4, SegBytes: 16 << 10, Blocks: 64, HashBytes: 16}

func register(t *testing.T, d *testenv.Daemon, m testenv.Model, fp string) *engine {
	t.Helper()
	r := testenv.NewRegion(t, m.RegionBytes())
	c := d.Client(t)
	reg, err := c.Register(ctx(t), []byte(fp), m.Layout(), m.Regions(r), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	return &engine{d: d, m: m, r: r, c: c, reg: reg}
}

func (e *engine) hashes(seed uint64, n int) [][]byte { return e.m.Hashes(seed, n) }

func seq(from, n int) []uint32 { return testenv.Seq(from, n) }

var jobSeq atomic.Uint64

func (e *engine) store(t *testing.T, hs [][]byte, blocks []uint32) *pb.JobResult {
	t.Helper()
	for i, h := range hs {
		e.m.Fill(e.r, int(blocks[i]), h)
	}
	res, err := e.c.Store(ctx(t), e.reg.RegistrationId, []*pb.Job{testenv.Job(jobSeq.Add(1), hs, blocks)}, true)
	if err != nil {
		t.Fatal(err)
	}
	if !res[0].Ok {
		t.Fatalf("store: %+v", res[0])
	}
	return res[0]
}

func (e *engine) lookup(t *testing.T, hs [][]byte) *pb.LookupResponse {
	t.Helper()
	r, err := e.c.Lookup(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(hs...), 0)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// poison fills engine blocks with bytes that belong to no key, so a load
// that reports a block failed can be checked to have written nothing there.
func (e *engine) poison(blocks []uint32) {
	for _, b := range blocks {
		e.m.Fill(e.r, int(b), bytes.Repeat([]byte{0xee}, 16))
	}
}

// load loads hs into blocks and checks every block: OK ones hold exactly
// their key's bytes, failed ones hold what was there before (nothing was
// written into them). It returns the status of each block.
func (e *engine) load(t *testing.T, hs [][]byte, blocks []uint32) []pb.BlockStatus {
	t.Helper()
	e.poison(blocks)
	res, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{testenv.Job(jobSeq.Add(1), hs, blocks)}, true)
	if err != nil {
		t.Fatal(err)
	}
	st := make([]pb.BlockStatus, len(hs))
	for _, f := range res[0].Failures {
		if f.BlockId != blocks[f.Index] || !bytes.Equal(f.Hash, hs[f.Index]) {
			t.Fatalf("failure %+v does not name block %d / its key", f, blocks[f.Index])
		}
		st[f.Index] = f.Status
	}
	for i, b := range blocks {
		if st[i] == pb.BlockStatus_BLOCK_STATUS_OK {
			if err := e.m.Check(e.r, int(b), hs[i]); err != nil {
				t.Fatalf("block %d reported loaded: %v", i, err)
			}
		} else if err := e.m.Check(e.r, int(b), bytes.Repeat([]byte{0xee}, 16)); err != nil {
			t.Fatalf("block %d reported %v, but its engine block was written: %v", i, st[i], err)
		}
	}
	return st
}

// invalidateMissed invalidates keys (nil: the namespace whole) on e's
// node while some master misses the generation records: the call answers
// UNAVAILABLE (other nodes may load the blocks until the records are
// written: docs/api.md), having dropped them on the node all the same.
func invalidateMissed(t *testing.T, e *engine, keys *pb.KeyList) {
	t.Helper()
	_, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, keys)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "not yet recorded in the remote tier") {
		t.Fatalf("Invalidate with a master missing its records: %v; want UNAVAILABLE, not yet recorded in the remote tier", err)
	}
}

func flush(t *testing.T, d *testenv.Daemon) {
	t.Helper()
	if err := d.Svc.FlushRemote(ctx(t)); err != nil {
		t.Fatal(err)
	}
}

func metric(t *testing.T, d *testenv.Daemon, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := d.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{}
	for i := 0; i+1 < len(labels); i += 2 {
		want[labels[i]] = labels[i+1]
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.Metric {
			for _, lp := range m.Label {
				if v, ok := want[lp.GetName()]; ok && v != lp.GetValue() {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			}
		}
	}
	return sum
}

func count(st []pb.BlockStatus) map[pb.BlockStatus]int {
	out := map[pb.BlockStatus]int{}
	for _, s := range st {
		out[s]++
	}
	return out
}

const (
	okSt      = pb.BlockStatus_BLOCK_STATUS_OK
	missingSt = pb.BlockStatus_BLOCK_STATUS_MISSING
	ioSt      = pb.BlockStatus_BLOCK_STATUS_IO_ERROR
	corruptSt = pb.BlockStatus_BLOCK_STATUS_CORRUPT
)
