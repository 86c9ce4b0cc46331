package e2e

import (
	"bytes"
	"sync"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// eventRecorder notes the ready event of every batch that reaches the copy
// engine.
type eventRecorder struct {
	dma.Engine
	mu     sync.Mutex
	stores [][]byte
	loads  [][]byte
}

func (r *eventRecorder) Submit(b *dma.Batch) {
	r.mu.Lock()
	if b.ToArena {
		r.stores = append(r.stores, bytes.Clone(b.ReadyEvent))
	} else {
		r.loads = append(r.loads, bytes.Clone(b.ReadyEvent))
	}
	r.mu.Unlock()
	r.Engine.Submit(b)
}

// TestReadyEventReachesTheCopies: a request's ready_event reaches the copy
// engine with the batch of every job, for loads as for stores. A load must
// wait for the engine's kernels still reading its destination blocks (a
// preempted request's forward pass, with async scheduling), as a store
// waits for the kernels writing its source blocks.
func TestReadyEventReachesTheCopies(t *testing.T) {
	rec := &eventRecorder{}
	d := testenv.Start(t, testenv.Options{Wrap: func(e dma.Engine) dma.Engine {
		rec.Engine = e
		return rec
	}})
	e := register(t, d, testenv.Model{Layers: 2, Blocks: 16, SegBytes: 4096}, "ready-event")
	hs := e.hashes(7, 4)
	for i, h := range hs {
		e.m.Fill(e.r, i, h)
	}
	storeEv := bytes.Repeat([]byte{0x5e}, 64)
	loadEv := bytes.Repeat([]byte{0x1d}, 64)
	sres, err := e.c.API.Store(ctx(t), &pb.TransferRequest{
		RegistrationId: e.reg.RegistrationId, Wait: true, ReadyEvent: storeEv,
		Jobs: []*pb.Job{testenv.Job(1, hs[:2], seq(0, 2)), testenv.Job(2, hs[2:], seq(2, 2))},
	})
	if err != nil || !sres.Results[0].Ok || !sres.Results[1].Ok {
		t.Fatalf("Store: %v %v", sres, err)
	}
	lres, err := e.c.API.Load(ctx(t), &pb.TransferRequest{
		RegistrationId: e.reg.RegistrationId, Wait: true, ReadyEvent: loadEv,
		Jobs: []*pb.Job{testenv.Job(3, hs[:2], seq(8, 2)), testenv.Job(4, hs[2:], seq(12, 2))},
	})
	if err != nil || !lres.Results[0].Ok || !lres.Results[1].Ok {
		t.Fatalf("Load: %v %v", lres, err)
	}
	e.verify(t, lres.Results[0], hs[:2], seq(8, 2))
	e.verify(t, lres.Results[1], hs[2:], seq(12, 2))
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.stores) != 2 || len(rec.loads) != 2 {
		t.Fatalf("%d store and %d load batches, want 2 and 2", len(rec.stores), len(rec.loads))
	}
	for i := range 2 {
		if !bytes.Equal(rec.stores[i], storeEv) {
			t.Errorf("store batch %d carries ready event %x, want the request's", i, rec.stores[i])
		}
		if !bytes.Equal(rec.loads[i], loadEv) {
			t.Errorf("load batch %d carries ready event %x, want the request's", i, rec.loads[i])
		}
	}
}

// arenaRecorder notes SetArena calls and, at SetArena(nil), that the arena
// is still mapped (it reads it: an unmapped arena would crash the test).
type arenaRecorder struct {
	dma.Engine
	mu       sync.Mutex
	arena    []byte
	released bool
	sum      byte
}

func (r *arenaRecorder) SetArena(mem []byte) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if mem == nil {
		r.released = true
		for _, b := range r.arena[:4096] {
			r.sum += b
		}
	} else {
		r.arena = mem
	}
	return r.Engine.SetArena(mem)
}

// TestArenaReleasedBeforeUnmap: the daemon's shutdown tells the copy engine
// to let go of the arena (CUDA: cuMemHostUnregister) while the arena is
// still mapped; unmapping first and unregistering after, on a GPU node,
// hands the driver an address that is no longer there.
func TestArenaReleasedBeforeUnmap(t *testing.T) {
	rec := &arenaRecorder{}
	d := testenv.Start(t, testenv.Options{Wrap: func(e dma.Engine) dma.Engine {
		rec.Engine = e
		return rec
	}})
	d.Stop(t)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.arena == nil || !rec.released {
		t.Fatalf("SetArena calls: set %v, released %v; want the arena released at shutdown", rec.arena != nil, rec.released)
	}
}

// gatedEngine holds every batch with a ready event until the test lets it
// go, as the CUDA engine holds one until the event completes.
type gatedEngine struct {
	dma.Engine
	gated chan *dma.Batch
}

func (g *gatedEngine) Submit(b *dma.Batch) {
	if len(b.ReadyEvent) > 0 {
		g.gated <- b
		return
	}
	g.Engine.Submit(b)
}

// TestStoreOfAClosedConnectionIsAbandoned: a store waiting for its ready
// event is abandoned once its connection closes (its engine may have died
// mid-forward, with its event's state up to the driver); one whose client
// is still connected is not. The CUDA engine asks Abandoned when the event
// completes and fails the batch instead of copying (dma/cuda's
// TestEngineAbandonedBatchIsNotIssued); the block is then never offered.
func TestStoreOfAClosedConnectionIsAbandoned(t *testing.T) {
	g := &gatedEngine{gated: make(chan *dma.Batch, 4)}
	d := testenv.Start(t, testenv.Options{Wrap: func(e dma.Engine) dma.Engine {
		g.Engine = e
		return g
	}})
	m := testenv.Model{Layers: 2, Blocks: 16, SegBytes: 4096}
	e := register(t, d, m, "abandoned")
	hs := e.hashes(3, 1)
	e.m.Fill(e.r, 0, hs[0])
	if _, err := e.c.API.Store(ctx(t), &pb.TransferRequest{
		RegistrationId: e.reg.RegistrationId, ReadyEvent: bytes.Repeat([]byte{0x5e}, 64),
		Jobs: []*pb.Job{testenv.Job(1, hs, seq(0, 1))},
	}); err != nil {
		t.Fatal(err)
	}
	b := <-g.gated
	if b.Abandoned == nil || b.Abandoned() {
		t.Fatal("a store of a connected client reads as abandoned (or cannot be asked)")
	}
	e.c.Close() // the engine dies: its connection closes
	waitFor(t, "the store to read as abandoned", b.Abandoned)
	b.Done(dma.ErrCopy) // what the CUDA engine then does
	other := d.Client(t)
	ns, err := other.Resolve(ctx(t), []byte("abandoned"))
	if err != nil {
		t.Fatal(err)
	}
	if ns[0] != 0 {
		lr, err := other.Lookup(ctx(t), ns, testenv.Keys(hs...), 0)
		if err != nil || lr.Ready != 0 {
			t.Fatalf("the abandoned block is offered: %+v %v", lr, err)
		}
	}
}
