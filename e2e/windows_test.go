package e2e

// A sliding-window group's lookup (docs/vllm.md, Hybrid models): the
// connector asks for a window's keys last first, so that the daemon's
// count of leading ready keys is the window's trailing run. Nothing in the
// daemon may assume a Lookup's keys come in prefix order.

import (
	"slices"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// TestLookupOfAWindowLastFirst: of six keys the daemon holds all but the
// second; asked last first, the ready count is the trailing run of four,
// the lease pins exactly those four, and a Load of them in prefix order
// naming the lease moves the right bytes.
func TestLookupOfAWindowLastFirst(t *testing.T) {
	d := testenv.Start(t, testenv.Options{})
	c, es := ranks(t, d, small, 1)
	e := es[0]
	hs := e.hashes(7, 6)
	e.store(t, 1, hs[:1], seq(0, 1))
	e.store(t, 2, hs[2:], seq(2, 4))

	rev := slices.Clone(hs)
	slices.Reverse(rev)
	lr, err := c.Lookup(ctx(t), nsIDs(es), testenv.Keys(rev...), 10_000)
	if err != nil {
		t.Fatal(err)
	}
	if lr.Ready != 4 || lr.LeaseId == 0 {
		t.Fatalf("reversed window: ready %d lease %d, want the trailing run of 4 with a lease", lr.Ready, lr.LeaseId)
	}
	if n := d.Svc.CPU().Pinned(); n != 4 {
		t.Fatalf("the lease pins %d slots, want the run's 4", n)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	res := e.loadLeased(t, 10, hs[2:], lr.LeaseId)
	wantStatuses(t, res, []pb.BlockStatus{stOK, stOK, stOK, stOK}...)
	// The lease's pins went with the load.
	if n := d.Svc.CPU().Pinned(); n != 0 {
		t.Fatalf("%d slots still pinned after the leased load", n)
	}
}
