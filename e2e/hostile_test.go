package e2e

// The adversarial suite: clients that run as another user (testenv.StartAs,
// uid 65534 in the socket's group, as --socket-mode 0660 lets in) and try
// to reach what is not theirs, flood the daemon, or vanish mid-call. Each
// test checks that the daemon stays up, answers each with the right code,
// and keeps nothing of theirs afterwards: registrations, mappings (counted
// in /proc/self/maps: the daemon runs in the test process), pins,
// connections. Goroutines are checked for the whole package by TestMain.

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/offload"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/rpc/server"
)

// mapsWith counts the lines of this process's memory map that name a file
// whose path starts with prefix.
func mapsWith(t testing.TB, prefix string) int {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.Contains(sc.Text(), " "+prefix) {
			n++
		}
	}
	return n
}

// metric is the value of a metric without labels in the daemon's registry.
func metric(t testing.TB, d *testenv.Daemon, name string) float64 {
	t.Helper()
	mfs, err := d.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		m := mf.GetMetric()[0]
		if c := m.GetCounter(); c != nil {
			return c.GetValue()
		}
		return m.GetGauge().GetValue()
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// registrations counts the live registrations.
func registrations(d *testenv.Daemon) int {
	n := 0
	for _, ns := range d.Svc.Stats().Namespaces {
		n += ns.Registrations
	}
	return n
}

// shmDir makes a directory under /dev/shm, root's, mode 0755, removed when
// the test ends.
func shmDir(t testing.TB) string {
	t.Helper()
	dir := fmt.Sprintf("/dev/shm/kvo-%s-%d", strings.ReplaceAll(t.Name(), "/", "-"), os.Getpid())
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// file creates path with size bytes, owner uid:gid and mode.
func file(t testing.TB, path string, size int, uid, gid int, mode os.FileMode) string {
	t.Helper()
	if err := os.WriteFile(path, make([]byte, size), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(path, uid, gid); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
	return path
}

func code(err error) codes.Code { return status.Code(err) }

// TestRegistrationsBelongToTheirConnection: a registration id names the
// registration only on the connection that made it. A client of another
// user gets NOT_FOUND for Store (which would copy the victim's engine
// memory into the cache), Load (which would write into it), Completions and
// Unregister; another connection of the same process for all but
// Completions, which it may read, also once the owner's connection has
// closed and the registration drains.
func TestRegistrationsBelongToTheirConnection(t *testing.T) {
	testenv.NeedRoot(t)
	gate := testenv.NewGate()
	d := testenv.Start(t, testenv.Options{SharedSocket: true, Wrap: gate.Wrap})
	victim := register(t, d, small, "victim")
	hs := victim.hashes(1, 4)
	victim.store(t, 1, hs, seq(0, 4))
	rid := victim.reg.RegistrationId

	h := testenv.StartAs(t, d.Socket, testenv.Nobody)
	for _, c := range []testenv.Cmd{
		{Op: "store", Reg: rid, JobID: 7, Hashes: victim.hashes(2, 4), Blocks: seq(8, 4), Wait: true},
		{Op: "load", Reg: rid, JobID: 8, Hashes: hs, Blocks: seq(20, 4), Wait: true},
		{Op: "completions", Reg: rid},
		{Op: "unregister", Reg: rid},
	} {
		if rep := h.Do(c); rep.Code != codes.NotFound {
			t.Errorf("another user's %s naming registration %d: %v %q, want NOT_FOUND", c.Op, rid, rep.Code, rep.Msg)
		}
	}
	// Refused exactly as an id nobody has: ids reveal nothing.
	mine := h.Do(testenv.Cmd{Op: "completions", Reg: rid})
	none := h.Do(testenv.Cmd{Op: "completions", Reg: rid + 1000})
	if mine.Code != none.Code || strings.ReplaceAll(mine.Msg, fmt.Sprint(rid), "N") != strings.ReplaceAll(none.Msg, fmt.Sprint(rid+1000), "N") {
		t.Errorf("refusal %v %q differs from an unknown id's %v %q", mine.Code, mine.Msg, none.Code, none.Msg)
	}

	if n := metric(t, d, "kvoffload_foreign_registration_calls_total"); n != 5 {
		t.Errorf("kvoffload_foreign_registration_calls_total is %v after 5 calls naming another connection's registration", n)
	}
	other := d.Client(t)
	if _, err := other.Store(ctx(t), rid, []*pb.Job{testenv.Job(9, victim.hashes(3, 4), seq(8, 4))}, true); code(err) != codes.NotFound {
		t.Errorf("another connection's Store: %v, want NOT_FOUND", err)
	}
	// Completions of the same process may come over another connection
	// (so that a connector reconnecting drains its old registration).
	if _, err := other.Completions(ctx(t), rid, 0); err != nil {
		t.Errorf("Completions from another connection of the owner's process: %v", err)
	}
	if _, err := other.API.Unregister(ctx(t), &pb.UnregisterRequest{RegistrationId: rid}); code(err) != codes.NotFound {
		t.Errorf("another connection's Unregister: %v, want NOT_FOUND", err)
	}
	// Nothing reached the victim: the blocks a Load would have written
	// are zero, nothing else was cached, and the registration works.
	for b := 20; b < 24; b++ {
		for l := 0; l < small.Layers; l++ {
			for _, x := range small.Segment(victim.r, l, b) {
				if x != 0 {
					t.Fatalf("engine block %d of the victim was written", b)
				}
			}
		}
	}
	if lr := victim.lookup(t, victim.hashes(2, 4)); lr.Ready != 0 {
		t.Fatalf("a refused Store cached %d blocks", lr.Ready)
	}
	victim.verify(t, victim.load(t, 2, hs, seq(30, 4)), hs, seq(30, 4))

	// The owner's connection breaks with a copy in flight: the same
	// process may read Completions over its new connection; the other
	// user still may not.
	gate.Hold()
	more := victim.hashes(4, 2)
	for i, hh := range more {
		small.Fill(victim.r, 40+i, hh)
	}
	if _, err := victim.c.Store(ctx(t), rid, []*pb.Job{testenv.Job(3, more, seq(40, 2))}, false); err != nil {
		t.Fatal(err)
	}
	gate.Arrived(1)
	victim.c.Close()
	waitFor(t, "the owner's process to read Completions over a new connection", func() bool {
		r, err := other.Completions(ctx(t), rid, 0)
		return err == nil && r.Pending == 1
	})
	if rep := h.Do(testenv.Cmd{Op: "completions", Reg: rid}); rep.Code != codes.NotFound {
		t.Errorf("another user's Completions of a draining registration: %v, want NOT_FOUND", rep.Code)
	}
	if _, err := other.Store(ctx(t), rid, []*pb.Job{testenv.Job(4, more, seq(40, 2))}, true); code(err) != codes.NotFound {
		t.Errorf("Store naming a draining registration from another connection: %v, want NOT_FOUND", err)
	}
	gate.Release()
	waitFor(t, "the registration to be released", func() bool { return registrations(d) == 0 })
	if d.Host.MappedBytes() != 0 || d.Svc.CPU().Pinned() != 0 {
		t.Fatalf("left behind: %d bytes mapped, %d slots pinned", d.Host.MappedBytes(), d.Svc.CPU().Pinned())
	}
}

// TestRegionAccessIsThePeers: the daemon maps a region file only if the
// client could open it itself, read-write, by that path: directories above
// it, supplementary groups and the group class all count, and nothing but
// a plain regular file beneath --shm-dir is taken.
func TestRegionAccessIsThePeers(t *testing.T) {
	testenv.NeedRoot(t)
	d := testenv.Start(t, testenv.Options{SharedSocket: true, Quiet: true})
	m := testenv.Model{Layers: 1, SegBytes: 4096, Blocks: 4}
	size := m.RegionBytes()
	dir := shmDir(t)
	nobody, grp := int(testenv.Nobody.UID), testenv.SocketGroup
	priv := filepath.Join(dir, "private")
	if err := os.Mkdir(priv, 0o700); err != nil {
		t.Fatal(err)
	}
	open := filepath.Join(dir, "open")
	if err := os.Mkdir(open, 0o755); err != nil {
		t.Fatal(err)
	}
	rootOnly := file(t, filepath.Join(dir, "root-0600"), size, 0, 0, 0o600)
	hard := filepath.Join(dir, "hardlink-to-root-0600")
	if err := os.Link(rootOnly, hard); err != nil {
		t.Fatal(err)
	}
	own := file(t, filepath.Join(dir, "own"), size, nobody, nobody, 0o600)
	link := filepath.Join(dir, "symlink-to-own")
	if err := os.Symlink(own, link); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o666); err != nil {
		t.Fatal(err)
	}
	os.Chown(fifo, nobody, nobody)
	os.Chmod(fifo, 0o666)

	cases := []struct {
		name, path string
		want       codes.Code
	}{
		{"own file", own, codes.OK},
		{"world-writable file in a 0755 directory", file(t, filepath.Join(open, "f"), size, 0, 0, 0o666), codes.OK},
		{"group file, group is a supplementary group", file(t, filepath.Join(dir, "group-0660"), size, 0, grp, 0o660), codes.OK},
		{"another user's 0600 file", rootOnly, codes.InvalidArgument},
		{"0666 file in a directory only root may enter", file(t, filepath.Join(priv, "f"), size, 0, 0, 0o666), codes.InvalidArgument},
		{"own file in a directory only root may enter", file(t, filepath.Join(priv, "own"), size, nobody, nobody, 0o600), codes.InvalidArgument},
		{"group class denies though others may", file(t, filepath.Join(dir, "group-0606"), size, 0, grp, 0o606), codes.InvalidArgument},
		{"read-only for the client", file(t, filepath.Join(dir, "ro-0644"), size, 0, 0, 0o644), codes.InvalidArgument},
		{"hard link to another user's 0600 file", hard, codes.InvalidArgument},
		{"symlink to its own file", link, codes.InvalidArgument},
		{"FIFO", fifo, codes.InvalidArgument},
		{"directory", open, codes.InvalidArgument},
		{"empty file", file(t, filepath.Join(dir, "empty"), 0, nobody, nobody, 0o600), codes.InvalidArgument},
		{"/proc/self/mem", "/proc/self/mem", codes.InvalidArgument},
		{"the daemon's /proc root", fmt.Sprintf("/proc/%d/root%s", os.Getpid(), rootOnly), codes.InvalidArgument},
		{"path with ..", dir + "/open/../root-0600", codes.InvalidArgument},
		{"path too long", "/dev/shm/" + strings.Repeat("x", offload.DefaultLimits.MaxRegionName), codes.InvalidArgument},
	}
	h := testenv.StartAs(t, d.Socket, testenv.Nobody)
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rep := h.Do(testenv.Cmd{Op: "register", Path: tc.path, Model: m, Fingerprint: fmt.Sprint("access-", i)})
			if rep.Code != tc.want {
				t.Fatalf("register %s: %v %q, want %v", tc.path, rep.Code, rep.Msg, tc.want)
			}
		})
	}
	// Root, whose files these are, may map any of them.
	if _, err := d.Client(t).Register(ctx(t), []byte("root"), m.Layout(), m.Regions(&testenv.Region{Path: filepath.Join(priv, "f")}), "root"); err != nil {
		t.Fatalf("root registering its own file: %v", err)
	}
	h.Kill()
	waitFor(t, "the client's registrations to be released", func() bool { return registrations(d) == 1 })
	if n := mapsWith(t, dir); n != 1 {
		t.Fatalf("%d mappings of the test's files remain, want root's 1", n)
	}
}

// TestShrunkRegionFailsCopiesNotTheDaemon: a client that truncates its
// region file after registering turns the daemon's copies into memory
// faults; they fail those blocks (DMA_ERROR) and the daemon serves on.
func TestShrunkRegionFailsCopiesNotTheDaemon(t *testing.T) {
	testenv.NeedRoot(t)
	d := testenv.Start(t, testenv.Options{SharedSocket: true, Quiet: true})
	victim := register(t, d, small, "victim")
	vh := victim.hashes(1, 4)
	victim.store(t, 1, vh, seq(0, 4))

	m := testenv.Model{Layers: 2, SegBytes: 16 << 10, Blocks: 8}
	path := file(t, filepath.Join(shmDir(t), "shrinks"), m.RegionBytes(), int(testenv.Nobody.UID), int(testenv.Nobody.GID), 0o600)
	h := testenv.StartAs(t, d.Socket, testenv.Nobody)
	reg := h.Do(testenv.Cmd{Op: "register", Path: path, Model: m, Fingerprint: "shrinks"})
	if reg.Code != codes.OK {
		t.Fatalf("register: %v %s", reg.Code, reg.Msg)
	}
	hs := [][]byte{m.Hash(5, 0), m.Hash(5, 1)}
	h.Do(testenv.Cmd{Op: "fill", Path: path, Model: m, Hashes: hs, Blocks: seq(0, 2)})
	if rep := h.Do(testenv.Cmd{Op: "store", Reg: reg.Reg, JobID: 1, Hashes: hs, Blocks: seq(0, 2), Wait: true}); rep.Code != codes.OK || !rep.OK {
		t.Fatalf("store before the shrink: %+v", rep)
	}
	h.Do(testenv.Cmd{Op: "truncate", Path: path, Size: 0})
	for _, c := range []testenv.Cmd{
		{Op: "store", Reg: reg.Reg, JobID: 2, Hashes: [][]byte{m.Hash(6, 0)}, Blocks: seq(3, 1), Wait: true},
		{Op: "load", Reg: reg.Reg, JobID: 3, Hashes: hs, Blocks: seq(4, 2), Wait: true},
	} {
		rep := h.Do(c)
		if rep.Code != codes.OK || rep.OK || len(rep.Statuses) == 0 {
			t.Fatalf("%s into a shrunk region: %+v, want its blocks failed", c.Op, rep)
		}
		for _, st := range rep.Statuses {
			if st != pb.BlockStatus_BLOCK_STATUS_DMA_ERROR {
				t.Fatalf("%s into a shrunk region: block status %v, want DMA_ERROR", c.Op, st)
			}
		}
	}
	victim.verify(t, victim.load(t, 2, vh, seq(10, 4)), vh, seq(10, 4))
	h.Kill()
	waitFor(t, "the client's registration to be released", func() bool { return registrations(d) == 1 })
	if n := d.Svc.CPU().Pinned(); n != 0 {
		t.Fatalf("%d slots pinned", n)
	}
}

// TestRegisterRacingCloseIsReleased: a connection that closes while its
// Register is still mapping regions leaves nothing mapped.
func TestRegisterRacingCloseIsReleased(t *testing.T) {
	gate := testenv.NewGate()
	d := testenv.Start(t, testenv.Options{Wrap: gate.Wrap})
	r := testenv.NewRegion(t, small.RegionBytes())
	c, err := client.Dial(d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	gate.HoldOpens()
	errc := make(chan error, 1)
	go func() {
		_, err := c.Register(ctx(t), []byte("racing"), small.Layout(), small.Regions(r), "racing")
		errc <- err
	}()
	gate.OpenArrived()
	c.Close()
	waitFor(t, "the daemon to see the connection close", func() bool { return d.Srv.Connections() == 0 })
	gate.ReleaseOpens()
	if err := <-errc; err == nil {
		t.Fatal("Register over a closed connection reported success")
	}
	// Once its regions are mapped, only a release unmaps them.
	waitFor(t, "the racing Register to map its regions", func() bool { return gate.Opened() == small.Layers })
	waitFor(t, "the racing registration to be released", func() bool {
		return registrations(d) == 0 && d.Host.MappedBytes() == 0
	})
	if n := mapsWith(t, r.Path); n != 1 {
		t.Fatalf("%d mappings of the region file, want only the test's own", n)
	}
}

// TestRegistrationFloodIsBounded: a client registering 1-page files as
// fast as it can (at base, until the daemon's memory map is full and the Go
// runtime dies) gets RESOURCE_EXHAUSTED at its uid's bound; other users go
// on registering until the total bound; everything the client mapped goes
// with it. A huge sparse file is refused by the mapped-bytes bound.
func TestRegistrationFloodIsBounded(t *testing.T) {
	testenv.NeedRoot(t)
	const perUID, total = 48, 64
	d := testenv.Start(t, testenv.Options{SharedSocket: true, Quiet: true, MaxMappedBytes: 1 << 30,
		Limits: offload.Limits{MaxRegions: total, MaxRegionsPerUID: perUID, MaxRegistrationsPerUID: 1000, MaxRegistrations: 1000}})
	dir := shmDir(t)
	os.Chmod(dir, 0o777)
	prefix := filepath.Join(dir, "flood")
	h := testenv.StartAs(t, d.Socket, testenv.Nobody)
	rep := h.Do(testenv.Cmd{Op: "register_many", Path: prefix, N: 10 * perUID, Fingerprint: "flood"})
	if rep.Count != perUID || rep.Code != codes.ResourceExhausted {
		t.Fatalf("flood: %d registered, then %v %q; want %d, then RESOURCE_EXHAUSTED", rep.Count, rep.Code, rep.Msg, perUID)
	}
	if n := mapsWith(t, prefix); n != perUID {
		t.Fatalf("%d mappings of the flood's files, want %d", n, perUID)
	}
	// Another process of the same user is the same peer uid: no more.
	h2 := testenv.StartAs(t, d.Socket, testenv.Nobody)
	if rep := h2.Do(testenv.Cmd{Op: "register_many", Path: prefix + "-2", N: 1, Fingerprint: "flood"}); rep.Code != codes.ResourceExhausted {
		t.Fatalf("a second process of the flooding uid: %v, want RESOURCE_EXHAUSTED", rep.Code)
	}
	// Other users are not locked out by one user's flood, up to the total.
	var mine []*engine
	m := testenv.Model{Layers: 1, SegBytes: 4096, Blocks: 1}
	for i := 0; ; i++ {
		r := testenv.NewRegion(t, m.RegionBytes())
		reg, err := d.Client(t).Register(ctx(t), []byte("root"), m.Layout(), m.Regions(r), "root")
		if err != nil {
			if code(err) != codes.ResourceExhausted || i != total-perUID {
				t.Fatalf("root's registration %d: %v; want RESOURCE_EXHAUSTED at %d", i, err, total-perUID)
			}
			break
		}
		mine = append(mine, &engine{reg: reg})
	}
	// A sparse 1 TiB file maps no memory but a terabyte of address space.
	h.Do(testenv.Cmd{Op: "close"})
	waitFor(t, "the flood's registrations to be released", func() bool { return registrations(d) == len(mine) })
	huge := file(t, filepath.Join(dir, "huge"), 0, int(testenv.Nobody.UID), int(testenv.Nobody.GID), 0o600)
	if err := os.Truncate(huge, 1<<40); err != nil {
		t.Fatal(err)
	}
	if rep := h.Do(testenv.Cmd{Op: "register", Path: huge, Model: m, Fingerprint: "huge"}); rep.Code != codes.ResourceExhausted {
		t.Fatalf("registering a 1 TiB sparse file: %v %q, want RESOURCE_EXHAUSTED", rep.Code, rep.Msg)
	}
	if n := mapsWith(t, prefix); n != 0 {
		t.Fatalf("%d mappings of the flood's files remain after its client left", n)
	}
}

// TestConnectionFloodIsBounded: one user's connections past its bound are
// closed at accept; others still connect and work; the flood's connections
// go when it does.
func TestConnectionFloodIsBounded(t *testing.T) {
	testenv.NeedRoot(t)
	const perUID = 8
	d := testenv.Start(t, testenv.Options{SharedSocket: true, Quiet: true, Server: server.Config{MaxConnectionsPerUID: perUID, MaxConnections: 4 * perUID}})
	h := testenv.StartAs(t, d.Socket, testenv.Nobody)
	rep := h.Do(testenv.Cmd{Op: "connections", N: 3 * perUID})
	if rep.Count != perUID {
		t.Fatalf("%d of %d connections of one uid served (%v), want %d", rep.Count, 3*perUID, rep.Codes, perUID)
	}
	e := register(t, d, small, "other-user")
	hs := e.hashes(1, 2)
	if res := e.store(t, 1, hs, seq(0, 2)); !res.Ok {
		t.Fatalf("another user's store during the flood: %+v", res)
	}
	if n := metric(t, d, "kvoffload_connections_refused_total"); n < 2*perUID {
		t.Errorf("kvoffload_connections_refused_total is %v, want at least %d", n, 2*perUID)
	}
	h.Kill()
	waitFor(t, "the flood's connections to close", func() bool { return d.Srv.Connections() == 1 })
}

// TestOversizedRequestsAreRefused: requests larger than the largest valid
// one are refused (RESOURCE_EXHAUSTED) before they are read, many at once,
// and the largest valid requests still pass.
func TestOversizedRequestsAreRefused(t *testing.T) {
	testenv.NeedRoot(t)
	d := testenv.Start(t, testenv.Options{SharedSocket: true, Quiet: true})
	e := register(t, d, small, "m")
	h := testenv.StartAs(t, d.Socket, testenv.Nobody)
	rep := h.Do(testenv.Cmd{Op: "big_lookups", NS: []uint32{e.reg.NamespaceId}, N: 8, Bytes: 16_000_000})
	if rep.Codes[codes.ResourceExhausted.String()] != 8 {
		t.Fatalf("8 Lookups of 16 MB: %v, want all RESOURCE_EXHAUSTED", rep.Codes)
	}
	// The largest request the bounds allow: every job and block, ids and
	// request ids at their widest.
	lim := offload.DefaultLimits
	jobs := make([]*pb.Job, lim.MaxJobsPerRequest)
	per := lim.MaxBlocksPerRequest / lim.MaxJobsPerRequest
	for j := range jobs {
		hs := make([][]byte, per)
		for i := range hs {
			hs[i] = e.m.Hash(uint64(j), i)
		}
		jobs[j] = &pb.Job{JobId: ^uint64(0) - uint64(j), RequestId: strings.Repeat("r", offload.DefaultLimits.MaxRequestID), Keys: testenv.Keys(hs...),
			BlockIds: make([]uint32, per), LeaseId: ^uint64(0)}
		for i := range jobs[j].BlockIds {
			jobs[j].BlockIds[i] = ^uint32(0)
		}
	}
	_, err := e.c.Load(ctx(t), e.reg.RegistrationId, jobs, true)
	if code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), "block_ids") {
		t.Fatalf("the largest Load: %v; want it read and refused for its block ids", err)
	}
	keys := make([][]byte, lim.MaxKeysPerLookup)
	for i := range keys {
		keys[i] = e.m.Hash(7, i)
	}
	if _, err := e.c.Lookup(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(keys...), 0); err != nil {
		t.Fatalf("the largest Lookup: %v", err)
	}
	e.verify(t, e.store(t, 1, e.hashes(1, 2), seq(0, 2)), e.hashes(1, 2), seq(0, 2))
}

// TestClientKilledMidCallLeavesNothing: a client killed while its waited
// store is still copying loses nothing of the daemon: the copy drains, its
// registration and mappings go, no slot stays pinned.
func TestClientKilledMidCallLeavesNothing(t *testing.T) {
	testenv.NeedRoot(t)
	gate := testenv.NewGate()
	d := testenv.Start(t, testenv.Options{SharedSocket: true, Wrap: gate.Wrap})
	m := testenv.Model{Layers: 2, SegBytes: 16 << 10, Blocks: 8}
	path := file(t, filepath.Join(shmDir(t), "region"), m.RegionBytes(), int(testenv.Nobody.UID), int(testenv.Nobody.GID), 0o600)
	h := testenv.StartAs(t, d.Socket, testenv.Nobody)
	reg := h.Do(testenv.Cmd{Op: "register", Path: path, Model: m, Fingerprint: "killed"})
	if reg.Code != codes.OK {
		t.Fatalf("register: %v %s", reg.Code, reg.Msg)
	}
	hs := [][]byte{m.Hash(1, 0), m.Hash(1, 1)}
	h.Do(testenv.Cmd{Op: "fill", Path: path, Model: m, Hashes: hs, Blocks: seq(0, 2)})
	gate.Hold()
	stored := make(chan error, 1)
	go func() {
		_, err := h.TryDo(testenv.Cmd{Op: "store", Reg: reg.Reg, JobID: 1, Hashes: hs, Blocks: seq(0, 2), Wait: true})
		stored <- err
	}()
	gate.Arrived(1)
	h.Kill()
	<-stored
	gate.Release()
	waitFor(t, "the killed client's registration to be released", func() bool {
		return registrations(d) == 0 && d.Host.MappedBytes() == 0 && d.Srv.Connections() == 0
	})
	if n := d.Svc.CPU().Pinned(); n != 0 {
		t.Fatalf("%d slots pinned", n)
	}
	if n := mapsWith(t, path); n != 0 {
		t.Fatalf("%d mappings of the killed client's file remain", n)
	}
}

// TestStalledRequestsDoNotStarveOthers: a client that sends request
// headers and never the message holds what the daemon booked to receive
// them, but no more than its uid's share of the in-flight budget: another
// user's calls go through at once. When the receive timeout passes, the
// staller's connection is closed and what it held comes back.
func TestStalledRequestsDoNotStarveOthers(t *testing.T) {
	testenv.NeedRoot(t)
	one := int64(server.MaxRequestBytes(offload.DefaultLimits))
	d := testenv.Start(t, testenv.Options{SharedSocket: true, Quiet: true,
		Server: server.Config{MaxInflightRequestBytes: 4 * one, ReceiveTimeout: 5 * time.Second}})
	e := register(t, d, small, "m")
	h := testenv.StartAs(t, d.Socket, testenv.Nobody)
	h.Do(testenv.Cmd{Op: "stall", N: 8})
	waitFor(t, "the stalled requests to hold their uid's share", func() bool { return d.Srv.InflightRequestBytes() == one })
	// Well within the receive timeout: these need not wait for it.
	quick, cancel := context.WithTimeout(context.Background(), 4*time.Second)
	defer cancel()
	for i := 0; i < 8; i++ {
		if _, err := e.c.Lookup(quick, []uint32{e.reg.NamespaceId}, testenv.Keys(e.hashes(1, 4)...), 0); err != nil {
			t.Fatalf("another user's Lookup %d while one user stalls: %v", i, err)
		}
	}
	waitFor(t, "the staller's connection to be closed", func() bool {
		return d.Srv.Connections() == 1 && d.Srv.InflightRequestBytes() == 0
	})
}
