package e2e

// Tests of finding N4 of the model-based test: invalidated blocks came back
// after a restart from disk copies the index no longer named (a copy freed
// without erasing it, or the named copy when the daemon was killed before
// its erase landed). Invalidate now records a durable mark that recovery
// honours (offload/marks.go, docs/disk-format.md).

import (
	"encoding/json"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// offered reports, per key, whether a Lookup of it alone offers it.
func (e *engine) offered(t testing.TB, hs [][]byte) []bool {
	t.Helper()
	out := make([]bool, len(hs))
	for i, h := range hs {
		out[i] = e.lookup(t, [][]byte{h}).Ready == 1
	}
	return out
}

func wantOffered(t testing.TB, what string, got []bool, want ...bool) {
	t.Helper()
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("%s: offered %v, want %v", what, got, want)
		}
	}
}

// catalogMarks counts the invalidation marks the disk tier's catalog holds.
func catalogMarks(t testing.TB, d *testenv.Daemon) int {
	t.Helper()
	n := 0
	for _, meta := range d.Svc.Disk().Namespaces() {
		var m struct {
			Before uint64            `json:"invalidated_before"`
			Keys   []json.RawMessage `json:"invalidated"`
		}
		if err := json.Unmarshal(meta, &m); err != nil {
			t.Fatal(err)
		}
		if m.Before != 0 {
			n++
		}
		n += len(m.Keys)
	}
	return n
}

// TestInvalidatedAfterAFailedReadStaysGone: a read that failed with EIO
// quarantines the slot, whose bytes may well be intact; the key, dropped
// from the index, was invalidated after (nothing to erase), and came back
// at the next start from that slot. Stored again after the invalidation,
// it does come back (the mark covers only older copies); and the marks go
// once a recovery has looked at every chunk.
func TestInvalidatedAfterAFailedReadStaysGone(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	o.WriteThrough = true // a block stored again reaches the disk at once
	fs := faultFS(t, "read-eio=1")
	fs.Pause()
	o.DiskFS = fs
	d := testenv.Start(t, o)
	e := register(t, d, small, "m")
	k := diskOnly(t, e, 3)
	fs.Resume()
	res := e.load(t, 1, k[:2], seq(40, 2))
	fs.Pause()
	for _, f := range res.Failures {
		if f.Status != pb.BlockStatus_BLOCK_STATUS_IO_ERROR {
			t.Fatalf("load: %+v", res)
		}
	}
	if len(res.Failures) != 2 {
		t.Fatalf("load: %+v", res)
	}
	if n, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(k[:2]...)); err != nil || n != 0 {
		t.Fatalf("invalidate: %d %v", n, err)
	}
	e.store(t, 2, k[1:2], seq(1, 1)) // stored again after its invalidation
	flush(t, d)
	if catalogMarks(t, d) != 2 {
		t.Fatalf("%d invalidation marks in the catalog, want 2", catalogMarks(t, d))
	}
	d.Stop(t)

	o.DiskFS = nil
	d2 := testenv.Start(t, o) // returns once recovery is done
	e2 := register(t, d2, small, "m")
	wantOffered(t, "after a clean restart", e2.offered(t, k), false, true, true)
	e2.verify(t, e2.load(t, 3, k[1:], seq(40, 2)), k[1:], seq(40, 2))
	if n := catalogMarks(t, d2); n != 0 {
		t.Fatalf("%d invalidation marks left after a full recovery", n)
	}
	if err := d2.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestInvalidateSurvivesKill9: the daemon is killed right after Invalidate
// returned, before the erases of the disk copies landed (held back here,
// the files copied as they are). The invalidated blocks used to come back;
// the marks Invalidate recorded before returning make recovery erase them,
// for keys and for a whole namespace, and keep the others.
func TestInvalidateSurvivesKill9(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	o.DiskBytes = 16 << 20
	o.WriteThrough = true
	gate := testenv.NewDiskGate()
	o.DiskFS = gate
	d := testenv.Start(t, o)
	a, b := register(t, d, small, "a"), register(t, d, small, "b")
	ka, kb := a.hashes(1, 4), b.hashes(2, 4)
	a.store(t, 1, ka, seq(0, 4))
	b.store(t, 2, kb, seq(0, 4))
	flush(t, d)
	gate.Hold()
	if n, err := a.c.Invalidate(ctx(t), []uint32{a.reg.NamespaceId}, testenv.Keys(ka[:2]...)); err != nil || n != 2 {
		t.Fatalf("invalidate keys: %d %v", n, err)
	}
	if n, err := b.c.Invalidate(ctx(t), []uint32{b.reg.NamespaceId}, nil); err != nil || n != 4 {
		t.Fatalf("invalidate a namespace: %d %v", n, err)
	}
	gate.Waiting(6) // every erase is held
	killed := testenv.CopyDir(t, dir)
	gate.Release()
	d.Stop(t)

	o2 := diskOpts(killed)
	o2.DiskBytes = o.DiskBytes
	d2 := testenv.Start(t, o2)
	a2, b2 := register(t, d2, small, "a"), register(t, d2, small, "b")
	wantOffered(t, "keys invalidated before the kill", a2.offered(t, ka), false, false, true, true)
	wantOffered(t, "a namespace invalidated before the kill", b2.offered(t, kb), false, false, false, false)
	a2.verify(t, a2.load(t, 3, ka[2:], seq(40, 2)), ka[2:], seq(40, 2))
	if err := d2.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}
