package remote_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// TestInvalidationSoak drives node A with seeded random traffic over a
// few keys: recomputes (a store of a new version of a block, racing an
// Invalidate of it), invalidations, loads, publishes whose SET is reported
// timed out and lands later (after invalidations), and reshardings of the
// slots the keys live in; node B, sharing the namespace, invalidates
// blocks A stored moments before (A's publish still to come). Every
// block's bytes name its version. Whenever a
// version's Invalidate began after its Store returned, that version is
// dead: no load of A and no read of the cluster by a reader that checks
// generations as every node does may return it (B's invalidations: no
// read of the cluster; A's own copies are A's). An Invalidate that
// answers UNAVAILABLE (a record write met a resharding's MOVED) is
// counted; the cluster is read once its records are written. KVO_SOAK_ROUNDS makes it
// longer (the default is short for the package's tests).
func TestInvalidationSoak(t *testing.T) {
	rounds := 300
	if v, err := strconv.Atoi(os.Getenv("KVO_SOAK_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("KVO_SOAK_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (KVO_SOAK_SEED), %d rounds", seed, rounds)
	rng := rand.New(rand.NewPCG(seed, 1))

	c := rediscluster.ForTest(t)
	late := &soakStore{held: map[int]func(){}}
	a := startNode(t, c, nodeOpts{wrapStore: func(s remote.Store) remote.Store { late.Store = s; return late }})
	fp := fingerprint(t)
	ea := register(t, a, model, fp)
	b := startNode(t, c, nodeOpts{})
	eb := register(t, b, model, fp)
	reader, err := remote.NewRedis(remote.RedisConfig{Addrs: c.Addrs()[:1], Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reader.Close() })

	const nkeys = 8
	hs := ea.hashes(141, nkeys)
	keys := make([]string, nkeys)
	for i, h := range hs {
		keys[i], _ = a.Svc.RemoteKey(ea.reg.NamespaceId, 0, h)
	}
	var version uint64
	dead := map[uint64]bool{}         // versions A invalidated after their store returned
	deadRemote := map[uint64]bool{}   // versions B invalidated after their store returned
	stored := make([][]uint64, nkeys) // versions whose store returned, not yet dead
	unrecorded := 0                   // Invalidates answered UNAVAILABLE
	fill := func(b int, k int, v uint64) {
		ea.m.Fill(ea.r, b, hs[k])
		binary.LittleEndian.PutUint64(ea.m.Segment(ea.r, 0, b), v)
	}
	versionIn := func(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }
	invalidate := func(ks []int) error {
		var list [][]byte
		for _, k := range ks {
			list = append(list, hs[k])
			for _, v := range stored[k] {
				dead[v] = true
			}
			stored[k] = nil
		}
		_, err := ea.c.Invalidate(context.Background(), []uint32{ea.reg.NamespaceId}, testenv.Keys(list...))
		if status.Code(err) == codes.Unavailable {
			unrecorded++ // dropped on A; its records are retried
			return nil
		}
		return err
	}
	// B invalidates key k: what A stored before is dead in the cluster.
	invalidateB := func(k int) error {
		for _, v := range stored[k] {
			deadRemote[v] = true
		}
		_, err := eb.c.Invalidate(context.Background(), []uint32{eb.reg.NamespaceId}, testenv.Keys(hs[k]))
		if status.Code(err) == codes.Unavailable {
			unrecorded++
			return nil
		}
		return err
	}
	check := func(round int) {
		t.Helper()
		// A's own loads.
		for k := range hs {
			b := uint32(10 + k)
			res, err := ea.c.Load(ctx(t), ea.reg.RegistrationId, []*pb.Job{testenv.Job(jobSeq.Add(1), hs[k:k+1], []uint32{b})}, true)
			if err != nil {
				t.Fatal(err)
			}
			if len(res[0].Failures) == 0 {
				if v := versionIn(ea.m.Segment(ea.r, 0, int(b))); dead[v] {
					t.Fatalf("seed %d round %d: A loaded version %d of key %d, invalidated after it was stored", seed, round, v, k)
				}
			}
		}
		// Any node's read of the cluster, once A's records are written
		// (until then a master that missed them serves the old values to
		// the other nodes: docs/remote.md, What is not done).
		waitFor(t, func() error {
			for _, d := range []*testenv.Daemon{a, b} {
				if k, n := d.Svc.RemotePendingDeletes(); k+n != 0 {
					return fmt.Errorf("%d keys and %d namespaces still to record", k, n)
				}
			}
			return nil
		})
		fs := make([]remote.Fetch, nkeys)
		for k := range fs {
			fs[k] = remote.Fetch{Key: keys[k], Head: make([]byte, remote.HeaderSize), Body: make([]byte, model.Layers*model.SegBytes)}
		}
		reader.Get(context.Background(), fs)
		for k, f := range fs {
			if f.Err != nil || f.Size == 0 || f.Torn || !remote.StampOf(f.Head).Current(f.Gen, f.NSGen) {
				continue // not served
			}
			if v := versionIn(f.Body); dead[v] || deadRemote[v] {
				t.Fatalf("seed %d round %d: the cluster serves version %d of key %d, invalidated after it was stored", seed, round, v, k)
			}
		}
	}
	for round := 0; round < rounds; round++ {
		switch p := rng.IntN(100); {
		case p < 40: // a recompute racing an Invalidate of the same key
			k := rng.IntN(nkeys)
			version++
			v := version
			fill(k, k, v)
			var wg sync.WaitGroup
			var res []*pb.JobResult
			wg.Add(2)
			go func() {
				defer wg.Done()
				var err error
				res, err = ea.c.Store(context.Background(), ea.reg.RegistrationId, []*pb.Job{testenv.Job(jobSeq.Add(1), hs[k:k+1], []uint32{uint32(k)})}, true)
				if err != nil {
					t.Error(err)
				}
			}()
			go func() {
				defer wg.Done()
				// Only the versions stored before count as dead: this
				// one races it.
				if err := invalidate([]int{k}); err != nil {
					t.Error(err)
				}
			}()
			wg.Wait()
			if res != nil && res[0].Ok {
				stored[k] = append(stored[k], v)
			}
		case p < 55: // a store of a new version after an Invalidate
			k := rng.IntN(nkeys)
			if err := invalidate([]int{k}); err != nil {
				t.Fatal(err)
			}
			version++
			fill(k, k, version)
			if p >= 48 {
				// A's publisher looks at the cluster only after B's
				// invalidation, below.
				late.holdLooks()
			}
			// Not ea.store: it fills the block again, over its version.
			res, err := ea.c.Store(ctx(t), ea.reg.RegistrationId, []*pb.Job{testenv.Job(jobSeq.Add(1), hs[k:k+1], []uint32{uint32(k)})}, true)
			if err != nil {
				t.Fatal(err)
			}
			if res[0].Ok {
				stored[k] = append(stored[k], version)
			}
			if p >= 48 {
				// B invalidates it before A's publish is done.
				if err := invalidateB(k); err != nil {
					t.Fatal(err)
				}
			}
			late.releaseLooks()
		case p < 70: // invalidations
			ks := rng.Perm(nkeys)[:1+rng.IntN(3)]
			if err := invalidate(ks); err != nil {
				t.Fatal(err)
			}
		case p < 80: // hold the next SETs: reported timed out, landing later
			late.arm(1 + rng.IntN(3))
		case p < 92: // the held SETs land now
			late.release()
		case p < 93: // reshard the slot of a key
			k := rng.IntN(nkeys)
			from, err := c.NodeFor(ctx(t), keys[k])
			if err != nil {
				t.Fatal(err)
			}
			slot, err := c.KeySlot(ctx(t), keys[k])
			if err != nil {
				t.Fatal(err)
			}
			if err := c.MoveSlot(ctx(t), slot, c.Node((from.Index()+1)%len(c.Nodes()))); err != nil {
				t.Fatal(err)
			}
		default:
			if err := a.Svc.FlushRemote(ctx(t)); err != nil {
				t.Fatal(err)
			}
		}
		// The stores and invalidations run dead versions and live ones
		// through the racing paths; stale bytes must never come back.
		if err := a.Svc.FlushRemote(ctx(t)); err != nil {
			t.Fatal(err)
		}
		check(round)
		if t.Failed() {
			return
		}
	}
	late.release()
	check(rounds)
	t.Logf("%d rounds: %d versions invalidated by A, %d by B, none loaded or served; %d Invalidates answered UNAVAILABLE (records retried)",
		rounds, len(dead), len(deadRemote), unrecorded)
}

// soakStore holds, once armed, the next SETs: each reported timed out at
// once and sent when release is called. Between holdLooks and
// releaseLooks it holds the publisher's looks at the cluster (Gets of
// headers only).
type soakStore struct {
	remote.Store
	mu    sync.Mutex
	hold  int
	seq   int
	held  map[int]func()
	looks chan struct{} // closed by releaseLooks
}

func (s *soakStore) holdLooks() {
	s.mu.Lock()
	s.looks = make(chan struct{})
	s.mu.Unlock()
}

func (s *soakStore) releaseLooks() {
	s.mu.Lock()
	if s.looks != nil {
		close(s.looks)
		s.looks = nil
	}
	s.mu.Unlock()
}

func (s *soakStore) Get(ctx context.Context, fs []remote.Fetch) error {
	s.mu.Lock()
	looks := s.looks
	s.mu.Unlock()
	if looks != nil && len(fs) > 0 && len(fs[0].Head) > 0 && fs[0].Body == nil {
		<-looks
	}
	return s.Store.Get(ctx, fs)
}

func (s *soakStore) arm(n int) {
	s.mu.Lock()
	s.hold += n
	s.mu.Unlock()
}

func (s *soakStore) release() {
	s.mu.Lock()
	held := s.held
	s.held = map[int]func(){}
	s.mu.Unlock()
	for _, send := range held {
		send()
	}
}

func (s *soakStore) Set(ctx context.Context, items []remote.Item) []error {
	s.mu.Lock()
	if s.hold == 0 {
		s.mu.Unlock()
		return s.Store.Set(ctx, items)
	}
	s.hold--
	cp := make([]remote.Item, len(items))
	for i, it := range items {
		cp[i] = it
		cp[i].Value = append([]byte(nil), it.Value...)
	}
	s.seq++
	s.held[s.seq] = func() { s.Store.Set(context.Background(), cp) }
	s.mu.Unlock()
	errs := make([]error, len(items))
	for i := range errs {
		errs[i] = remote.ErrUnavailable
	}
	return errs
}
