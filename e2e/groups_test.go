package e2e

import (
	"bytes"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// TestOneStoreOfGroupsSharingASlotSizeFitsTheTier: a hybrid model's groups
// of one slot size share a CPU class. One Store naming all of them (a
// connector's one call per step) must take the room the tier has for all
// of them, not evict or refuse while chunks are free: the class used to
// grow for each group's keys in turn, and the policy then judged every
// group's admission against room for one group.
func TestOneStoreOfGroupsSharingASlotSizeFitsTheTier(t *testing.T) {
	// 4 MiB of 1 MiB chunks, 64 KiB slots: 64 slots; the store takes 48.
	d := testenv.Start(t, testenv.Options{CPUBytes: 4 << 20, ChunkBytes: 1 << 20, Quiet: true})
	m := testenv.Model{Layers: 2, SegBytes: 64 << 10, Blocks: 3 * 24}
	l := m.Layout()
	l.Segments[1].Group = 1 // layer 1 is a second group of the same slot size
	r := testenv.NewRegion(t, m.RegionBytes())
	c := d.Client(t)
	reg, err := c.Register(ctx(t), []byte("two-groups"), l, m.Regions(r), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	const n = 24
	hs := [2][][]byte{m.Hashes(1, n), m.Hashes(2, n)}
	blocks := [2][]uint32{seq(0, n), seq(n, n)}
	want := [2][][]byte{}
	for g := range 2 {
		for i, h := range hs[g] {
			m.Fill(r, int(blocks[g][i]), h)
			want[g] = append(want[g], bytes.Clone(m.Segment(r, g, int(blocks[g][i]))))
		}
	}
	jobs := make([]*pb.Job, 2)
	for g := range jobs {
		jobs[g] = testenv.Job(uint64(g+1), hs[g], blocks[g])
		jobs[g].Keys.Group = uint32(g)
	}
	res, err := c.Store(ctx(t), reg.RegistrationId, jobs, true)
	if err != nil {
		t.Fatal(err)
	}
	for g, jr := range res {
		if !jr.Ok || len(jr.Failures) > 0 {
			t.Errorf("group %d: %d of %d blocks not stored with room for all: %+v", g, len(jr.Failures), n, jr.Failures)
		}
	}
	if ev := d.Svc.Stats().Evictions; ev != 0 {
		t.Errorf("%d blocks evicted from a tier with room for every block stored", ev)
	}
	for g := range 2 {
		keys := testenv.Keys(hs[g]...)
		keys.Group = uint32(g)
		lr, err := c.Lookup(ctx(t), []uint32{reg.NamespaceId}, keys, 0)
		if err != nil {
			t.Fatal(err)
		}
		if lr.Ready != n {
			t.Errorf("group %d: %d of %d blocks ready after storing them into an unfilled tier", g, lr.Ready, n)
		}
	}
	// They load back intact, into other engine blocks.
	clear(r.Mem)
	for g := range 2 {
		job := testenv.Job(uint64(10+g), hs[g], seq(2*n, n))
		job.Keys.Group = uint32(g)
		lres, err := c.Load(ctx(t), reg.RegistrationId, []*pb.Job{job}, true)
		if err != nil {
			t.Fatal(err)
		}
		if !lres[0].Ok {
			t.Fatalf("group %d: load failed: %+v", g, lres[0].Failures)
		}
		for i := range n {
			if !bytes.Equal(m.Segment(r, g, 2*n+i), want[g][i]) {
				t.Fatalf("group %d block %d: loaded bytes differ from the stored ones", g, i)
			}
		}
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}
