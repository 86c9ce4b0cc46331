package e2e

// Tests of the model-based test's findings on leases and Invalidate (N1,
// N2 in the notes of issue 9's work): a lease pins the ready prefix and
// nothing past it, and after an Invalidate returns no lease, load or disk
// slot hands out the invalidated bytes, nor reports a block CORRUPT that
// the device never damaged.

import (
	"fmt"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// ranks registers one engine per fingerprint over one connection, as a
// scheduler and its tensor-parallel workers would share a node.
func ranks(t testing.TB, d *testenv.Daemon, m testenv.Model, n int) (*client.Client, []*engine) {
	t.Helper()
	c := d.Client(t)
	es := make([]*engine, n)
	for i := range es {
		r := testenv.NewRegion(t, m.RegionBytes())
		reg, err := c.Register(ctx(t), []byte(fmt.Sprintf("%s-rank%d", t.Name(), i)), m.Layout(), m.Regions(r), t.Name())
		if err != nil {
			t.Fatal(err)
		}
		es[i] = &engine{d: d, m: m, r: r, c: c, reg: reg}
	}
	return c, es
}

func nsIDs(es []*engine) []uint32 {
	ids := make([]uint32, len(es))
	for i, e := range es {
		ids[i] = e.reg.NamespaceId
	}
	return ids
}

// TestLeaseOnlyOverTheReadyPrefix (finding N1): a Lookup with a lease over
// two namespaces pinned a key in the first before finding it missing in the
// second, and returned a lease pinning it even when nothing was ready in
// both. The lease pins exactly the prefix ready everywhere; no prefix, no
// lease.
func TestLeaseOnlyOverTheReadyPrefix(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	c, es := ranks(t, d, small, 2)
	hs := es[0].hashes(1, 4)
	es[0].store(t, 1, hs, seq(0, 4))
	es[1].store(t, 2, hs[2:], seq(2, 2)) // rank 1 lacks the first two

	lr, err := c.Lookup(ctx(t), nsIDs(es), testenv.Keys(hs...), 10_000)
	if err != nil {
		t.Fatal(err)
	}
	if lr.Ready != 0 || lr.LeaseId != 0 {
		t.Fatalf("nothing is ready in both ranks; got ready %d and lease %d", lr.Ready, lr.LeaseId)
	}
	if n := d.Svc.CPU().Pinned(); n != 0 {
		t.Fatalf("a lookup that offered nothing left %d slots pinned", n)
	}

	// Rank 1 gets the first key: a prefix of one. The second key, ready in
	// rank 0 only, stays unpinned.
	es[1].store(t, 3, hs[:1], seq(0, 1))
	lr, err = c.Lookup(ctx(t), nsIDs(es), testenv.Keys(hs...), 10_000)
	if err != nil || lr.Ready != 1 || lr.LeaseId == 0 {
		t.Fatalf("lookup: %+v %v", lr, err)
	}
	if n := d.Svc.CPU().Pinned(); n != 2 {
		t.Fatalf("the lease pins %d slots, want the prefix's 2 (one per rank)", n)
	}
	// A key twice in the prefix is pinned once.
	lr2, err := c.Lookup(ctx(t), nsIDs(es), testenv.Keys(hs[0], hs[0], hs[1]), 10_000)
	if err != nil || lr2.Ready != 2 || lr2.LeaseId == 0 {
		t.Fatalf("lookup with a repeated key: %+v %v", lr2, err)
	}
	if n := d.Svc.CPU().Pinned(); n != 2 {
		t.Fatalf("%d slots pinned after a second lease on the same prefix", n)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	for i, e := range es {
		job := testenv.Job(uint64(10+i), hs[:1], seq(40, 1))
		job.LeaseId = lr.LeaseId
		out, err := c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{job}, true)
		if err != nil || !out[0].Ok {
			t.Fatalf("rank %d: %+v %v", i, out, err)
		}
		e.verify(t, out[0], hs[:1], seq(40, 1))
	}
}

// loadLeased loads hs into engine blocks from 40 on, naming lease, and
// returns the result, checked.
func (e *engine) loadLeased(t testing.TB, id uint64, hs [][]byte, lease uint64) *pb.JobResult {
	t.Helper()
	blocks := seq(40, len(hs))
	for _, b := range blocks {
		clear(e.m.Segment(e.r, 0, int(b)))
	}
	job := testenv.Job(id, hs, blocks)
	job.LeaseId = lease
	out, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{job}, true)
	if err != nil {
		t.Fatal(err)
	}
	e.verify(t, out[0], hs, blocks)
	return out[0]
}

// statuses lists a load's per-block statuses in job order.
func statuses(res *pb.JobResult, n int) []pb.BlockStatus {
	out := make([]pb.BlockStatus, n)
	for _, f := range res.Failures {
		out[f.Index] = f.Status
	}
	return out
}

const (
	stOK      = pb.BlockStatus_BLOCK_STATUS_OK
	stMissing = pb.BlockStatus_BLOCK_STATUS_MISSING
)

func wantStatuses(t testing.TB, res *pb.JobResult, want ...pb.BlockStatus) {
	t.Helper()
	got := statuses(res, len(want))
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("statuses %v, want %v", got, want)
		}
	}
}

// TestInvalidateReachesLeases (finding N2): a Load naming a lease taken
// before an Invalidate returned the invalidated blocks, reported OK. The
// invalidated keys are MISSING (or, once stored again, their new copy);
// the lease's other blocks still load.
func TestInvalidateReachesLeases(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	c, es := ranks(t, d, small, 2)
	hs := es[0].hashes(1, 4)
	for i, e := range es {
		e.store(t, uint64(1+i), hs, seq(0, 4))
	}
	lr, err := c.Lookup(ctx(t), nsIDs(es), testenv.Keys(hs...), 10_000)
	if err != nil || lr.Ready != 4 {
		t.Fatal(lr, err)
	}
	// Keys 1 and 2 of both ranks go; key 2 is stored again in rank 1.
	if n, err := c.Invalidate(ctx(t), nsIDs(es), testenv.Keys(hs[1:3]...)); err != nil || n != 4 {
		t.Fatalf("invalidate: %d %v", n, err)
	}
	es[1].store(t, 3, hs[2:3], seq(2, 1))
	if n := d.Svc.CPU().Pinned(); n != 4 {
		t.Fatalf("%d slots pinned, want the lease's 4 left", n)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	wantStatuses(t, es[0].loadLeased(t, 10, hs, lr.LeaseId), stOK, stMissing, stMissing, stOK)
	wantStatuses(t, es[1].loadLeased(t, 11, hs, lr.LeaseId), stOK, stMissing, stOK, stOK)
	if n := d.Svc.CPU().Pinned(); n != 0 {
		t.Fatalf("%d slots pinned after both ranks loaded", n)
	}

	// A whole namespace: its lease pins go, the other rank's stay.
	lr, err = c.Lookup(ctx(t), nsIDs(es), testenv.Keys(hs[:1]...), 10_000)
	if err != nil || lr.Ready != 1 {
		t.Fatal(lr, err)
	}
	if _, err := c.Invalidate(ctx(t), nsIDs(es[:1]), nil); err != nil {
		t.Fatal(err)
	}
	if n := d.Svc.CPU().Pinned(); n != 1 {
		t.Fatalf("%d slots pinned, want rank 1's", n)
	}
	wantStatuses(t, es[0].loadLeased(t, 12, hs[:1], lr.LeaseId), stMissing)
	wantStatuses(t, es[1].loadLeased(t, 13, hs[:1], lr.LeaseId), stOK)
	// A lease whose every pin was invalidated is gone.
	lr, err = c.Lookup(ctx(t), nsIDs(es[1:]), testenv.Keys(hs[:1]...), 10_000)
	if err != nil || lr.Ready != 1 {
		t.Fatal(lr, err)
	}
	if _, err := c.Invalidate(ctx(t), nsIDs(es[1:]), nil); err != nil {
		t.Fatal(err)
	}
	if n := d.Svc.CPU().Pinned(); n != 0 {
		t.Fatalf("%d slots pinned after the lease's only block was invalidated", n)
	}
	wantStatuses(t, es[1].loadLeased(t, 14, hs[:1], lr.LeaseId), stMissing)
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestInvalidateReachesEvictedLeasedBlocks: a lease keeps a block through
// eviction (here a chunk moving to another block size); an Invalidate of
// the evicted key finds no index entry, and used to leave the lease's pin,
// so a later Load through the lease returned the invalidated bytes. The
// evicted blocks not invalidated still load through the lease.
func TestInvalidateReachesEvictedLeasedBlocks(t *testing.T) {
	// Two 4 MiB chunks of 16 small blocks each.
	d := testenv.Start(t, testenv.Options{CPUBytes: 8 << 20, ChunkBytes: 4 << 20, Quiet: true})
	e := register(t, d, small, "m")
	hs := e.hashes(1, 20)
	e.store(t, 1, hs[:16], seq(0, 16))
	e.store(t, 2, hs[16:], seq(16, 4)) // the second chunk
	lr, err := e.leaseLookup(t, e.c, hs)
	if err != nil || lr.Ready != 20 {
		t.Fatal(lr, err)
	}
	// Another block size takes a chunk: the blocks there leave the index,
	// their slots held by the lease.
	other := register(t, d, testenv.Model{Layers: 2, SegBytes: 64 << 10, Blocks: 8}, "other")
	other.store(t, 3, other.hashes(9, 1), seq(0, 1))
	var evicted [][]byte
	for _, h := range hs {
		if e.lookup(t, [][]byte{h}).Ready == 0 {
			evicted = append(evicted, h)
		}
	}
	if len(evicted) < 2 {
		t.Fatalf("%d leased blocks evicted by the chunk move, want 2 or more", len(evicted))
	}
	invalidated := evicted[:len(evicted)/2]
	if n, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(invalidated...)); err != nil || n != 0 {
		t.Fatalf("invalidate of evicted keys: %d %v", n, err)
	}
	res := e.loadLeased(t, 4, hs, lr.LeaseId)
	gone := map[string]bool{}
	for _, h := range invalidated {
		gone[string(h)] = true
	}
	got := statuses(res, len(hs))
	for i, h := range hs {
		want := stOK
		if gone[string(h)] {
			want = stMissing
		}
		if got[i] != want {
			t.Fatalf("block %d: %v, want %v (%d of %d evicted, %d of them invalidated)", i, got[i], want, len(evicted), len(hs), len(invalidated))
		}
	}
	if n := d.Svc.CPU().Pinned(); n != 0 {
		t.Fatalf("%d slots pinned after the lease was used", n)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// diskOnly stores blocks until some live only on disk and returns up to n
// of them.
func diskOnly(t testing.TB, e *engine, n int) [][]byte {
	t.Helper()
	stored := storeMany(t, e, 1, 128) // 4x the CPU tier
	var out [][]byte
	for _, h := range stored {
		r, err := e.c.API.Lookup(ctx(t), &pb.LookupRequest{NamespaceIds: []uint32{e.reg.NamespaceId}, Keys: testenv.Keys(h), Peek: true})
		if err != nil {
			t.Fatal(err)
		}
		if r.Ready == 1 && r.Tiers[0] == pb.Tier_TIER_DISK {
			out = append(out, h)
			if len(out) == n {
				break
			}
		}
	}
	if len(out) < n {
		t.Fatalf("%d blocks only on disk, want %d", len(out), n)
	}
	return out
}

// TestInvalidateUnderDiskLease (finding N2, disk): a lease pinning a block
// only on disk; Invalidate zeroed the slot's header under the pin, and the
// Load through the lease read the zeros: CORRUPT, and a checksum failure
// counted that the device never had. It is MISSING, nothing is counted,
// and the header is erased (the block does not come back at a restart).
func TestInvalidateUnderDiskLease(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	d := testenv.Start(t, o)
	e := register(t, d, small, "disk")
	k := diskOnly(t, e, 2)
	lr, err := e.leaseLookup(t, e.c, k)
	if err != nil || lr.Ready != 2 || lr.Tiers[0] != pb.Tier_TIER_DISK {
		t.Fatal(lr, err)
	}
	if n, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(k[0])); err != nil || n != 1 {
		t.Fatalf("invalidate: %d %v", n, err)
	}
	flush(t, d)
	wantStatuses(t, e.loadLeased(t, 1, k, lr.LeaseId), stMissing, stOK)
	if n := counter(t, d.Registry, "kvoffload_disk_checksum_failures_total", nil); n != 0 {
		t.Fatalf("%v checksum failures counted on a healthy disk", n)
	}
	flush(t, d)
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	d.Stop(t)
	d2 := testenv.Start(t, o)
	e2 := register(t, d2, small, "disk")
	if lr := e2.lookup(t, k[:1]); lr.Ready != 0 {
		t.Fatal("the invalidated block came back after a restart")
	}
	if lr := e2.lookup(t, k[1:]); lr.Ready != 1 {
		t.Fatal("the block next to it did not come back")
	}
}

// TestInvalidateDuringDiskRead: Invalidate zeroed the header of a disk
// slot a load was reading; the load failed CORRUPT (and counted a checksum
// failure). The erase waits for the read: the load, accepted before the
// Invalidate, gets the block whole, and the header is erased after it.
func TestInvalidateDuringDiskRead(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	gate := testenv.NewDiskGate()
	o.DiskFS = gate
	d := testenv.Start(t, o)
	e := register(t, d, small, "disk")
	k := diskOnly(t, e, 1)
	gate.HoldReads()
	blocks := seq(40, 1)
	if _, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{testenv.Job(1, k, blocks)}, false); err != nil {
		t.Fatal(err)
	}
	gate.ReadsWaiting(1)
	if n, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(k...)); err != nil || n != 1 {
		t.Fatalf("invalidate: %d %v", n, err)
	}
	gate.ReleaseReads()
	got, err := e.c.WaitJobs(ctx(t), e.reg.RegistrationId, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !got[1].Ok {
		t.Fatalf("a load accepted before the Invalidate failed: %+v", got[1])
	}
	e.verify(t, got[1], k, blocks)
	if n := counter(t, d.Registry, "kvoffload_disk_checksum_failures_total", nil); n != 0 {
		t.Fatalf("%v checksum failures counted on a healthy disk", n)
	}
	if lr := e.lookup(t, k); lr.Ready != 0 {
		t.Fatal("the invalidated block is offered")
	}
	flush(t, d)
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	d.Stop(t)
	o.DiskFS = nil
	d2 := testenv.Start(t, o)
	if lr := register(t, d2, small, "disk").lookup(t, k); lr.Ready != 0 {
		t.Fatal("the invalidated block came back after a restart")
	}
}
