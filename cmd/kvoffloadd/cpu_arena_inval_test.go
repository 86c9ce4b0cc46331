package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
)

// arenaChunks maps each block a stopped daemon's arena file has a valid
// record for (by hash) to its chunk.
func arenaChunks(t *testing.T, dir string) map[string]int {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, cpu.ArenaFileName))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sb := make([]byte, 64)
	if _, err := f.ReadAt(sb, 0); err != nil {
		t.Fatal(err)
	}
	le := binary.LittleEndian
	recordsOff, arenaBytes, chunkBytes := int64(le.Uint64(sb[40:])), int(le.Uint64(sb[24:])), int(le.Uint64(sb[32:]))
	recs := make([]byte, arenaBytes/4096*cpu.RecordBytes) // the records only, not the arena
	if _, err := f.ReadAt(recs, recordsOff); err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	var buf [slot.HeaderSize]byte
	for i := 0; i < arenaBytes/4096; i++ {
		r := recs[i*cpu.RecordBytes : (i+1)*cpu.RecordBytes]
		if r[0] == 0 && bytes.Equal(r, make([]byte, cpu.RecordBytes)) {
			continue
		}
		copy(buf[:cpu.RecordBytes], r)
		if hd, err := slot.Decode(buf[:]); err == nil {
			out[string(hd.Key())] = i * 4096 / chunkBytes
		}
	}
	return out
}

// TestCPUArenaInvalidateDuringRecoveryIsDurable: an Invalidate answered
// while the arena's recovery has not reached the blocks it names (keys, or
// a whole namespace as reset_cache sends) holds across the next stop, a
// kill -9 or a SIGTERM: after the restart none of them is offered, and
// every other block comes back byte-exact.
func TestCPUArenaInvalidateDuringRecoveryIsDurable(t *testing.T) {
	bin := buildDaemon(t)
	dir := arenaDir(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	args := []string{"--socket", sock, "--metrics-addr", metrics, "--cpu-bytes", "64MiB", "--cpu-chunk-bytes", "4MiB", "--cpu-arena-dir", dir}
	ctx := context.Background()
	m := arenaModel // 64 KiB blocks: 1024 in the arena, 64 a chunk
	r := testenv.NewRegion(t, m.RegionBytes())
	prints := [][]byte{[]byte("inval-a"), []byte("inval-b"), []byte("inval-c")}
	// Engine block b holds fill[b]'s bytes; hash j of a namespace is
	// stored from engine block j%64.
	fill := m.Hashes(41, m.Blocks)
	for b, h := range fill {
		m.Fill(r, b, h)
	}
	hs := [][][]byte{m.Hashes(42, 600), m.Hashes(43, 150), m.Hashes(44, 150)}
	register := func(c *client.Client, i int) *pb.RegisterResponse {
		t.Helper()
		reg, err := c.Register(ctx, prints[i], m.Layout(), m.Regions(r), "test")
		if err != nil {
			t.Fatal(err)
		}
		return reg
	}

	// Run 1: 900 blocks, A's last ones stored last; a clean stop.
	proc, c, exited := startDaemon(t, bin, args...)
	regs := []*pb.RegisterResponse{register(c, 0), register(c, 1), register(c, 2)}
	store := func(i int, part [][]byte) {
		t.Helper()
		for at := 0; at < len(part); at += m.Blocks {
			n := min(m.Blocks, len(part)-at)
			res, err := c.Store(ctx, regs[i].RegistrationId, []*pb.Job{testenv.Job(uint64(at), part[at:at+n], testenv.Seq(0, n))}, true)
			if err != nil || !res[0].Ok {
				t.Fatalf("store: %v %v", res, err)
			}
		}
	}
	store(0, hs[0][:512]) // a multiple of 64: hash j from engine block j%64
	store(1, hs[1])
	store(2, hs[2])
	store(0, hs[0][512:])
	proc.Process.Signal(syscall.SIGTERM)
	<-exited

	// The blocks of A recovery reaches last: its chunks are verified in
	// order.
	chunks := arenaChunks(t, dir)
	for i := range hs {
		for _, h := range hs[i] {
			if _, ok := chunks[string(h)]; !ok {
				t.Fatalf("block %x of namespace %d has no record after a clean stop", h[:8], i)
			}
		}
	}
	late := make([]int, len(hs[0]))
	for j := range late {
		late[j] = j
	}
	sort.SliceStable(late, func(a, b int) bool { return chunks[string(hs[0][late[a]])] > chunks[string(hs[0][late[b]])] })
	gone := map[int]bool{}
	pick := func(from int) [][]byte {
		var out [][]byte
		for _, j := range late[from : from+16] {
			out = append(out, hs[0][j])
			gone[j] = true
		}
		return out
	}
	k1, k2 := pick(0), pick(16)

	// Runs 2 and 3: recovery held after two chunks (--debug-hold-cpu-
	// recovery), the Invalidates answer while A's last blocks and most of
	// the reset namespace are not filed yet; then a kill -9, then a
	// SIGTERM.
	held := append(args[:len(args):len(args)], "--debug-checks", "--debug-hold-cpu-recovery")
	for run, stop := range []syscall.Signal{syscall.SIGKILL, syscall.SIGTERM} {
		keys, whole := k1, 1
		if run == 1 {
			keys, whole = k2, 2
		}
		proc, c, exited := startDaemon(t, bin, held...)
		ids, err := c.Resolve(ctx, prints...)
		if err != nil || ids[0] == 0 || ids[whole] == 0 {
			t.Fatalf("the arena's namespaces at the start: %v %v", ids, err)
		}
		letChunks(t, metrics, "2")
		waitMetric(t, metrics, "kvoffload_cpu_recovered_blocks", func(v float64) bool { return v > 0 })
		if _, err := c.Invalidate(ctx, []uint32{ids[0]}, testenv.Keys(keys...)); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Invalidate(ctx, []uint32{ids[whole]}, nil); err != nil {
			t.Fatal(err)
		}
		text := scrape(t, metrics)
		if state, blocks := metric(t, text, "kvoffload_cpu_recovery_state"), metric(t, text, "kvoffload_cpu_recovered_blocks"); state != 1 || blocks >= 900 {
			t.Fatalf("run %d: after the Invalidates, recovery state %v with %v blocks filed: want it held", run+2, state, blocks)
		}
		proc.Process.Signal(stop)
		<-exited
		os.Remove(sock)
	}

	// Run 4: nothing invalidated comes back; the rest does.
	_, c, _ = startDaemon(t, bin, args...)
	blocks, dropped := waitCPURecovered(t, metrics)
	if want := len(hs[0]) - len(gone); blocks != want {
		t.Fatalf("recovered %d blocks (%d dropped), want %d: A's but the 32 invalidated, none of B or C (reset)", blocks, dropped, want)
	}
	regs = []*pb.RegisterResponse{register(c, 0), register(c, 1), register(c, 2)}
	for i := range hs {
		for j, h := range hs[i] {
			ok, tier := lookupTier(t, c, regs[i].NamespaceId, h)
			if i > 0 || gone[j] {
				if ok {
					t.Fatalf("block %d of namespace %d, invalidated during recovery before the stop, is offered after the restart", j, i)
				}
				continue
			}
			if !ok || tier != pb.Tier_TIER_CPU {
				t.Fatalf("block %d of A: offered %v from %v, want the CPU tier", j, ok, tier)
			}
		}
	}
	// A sample loaded byte-exact (engine block 63 is the target).
	for j := 0; j < len(hs[0]); j += 97 {
		if gone[j] {
			continue
		}
		clear(m.Segment(r, 0, 63))
		clear(m.Segment(r, 1, 63))
		res, err := c.Load(ctx, regs[0].RegistrationId, []*pb.Job{testenv.Job(uint64(5000+j), [][]byte{hs[0][j]}, []uint32{63})}, true)
		if err != nil || !res[0].Ok {
			t.Fatalf("load of block %d: %v %v", j, res, err)
		}
		if err := m.Check(r, 63, fill[j%m.Blocks]); err != nil {
			t.Fatalf("block %d after the restarts: %v", j, err)
		}
	}
}

// letChunks lets a daemon's held CPU recovery (--debug-hold-cpu-recovery)
// verify n more chunks ("all": run to its end).
func letChunks(t *testing.T, metrics, n string) {
	t.Helper()
	resp, err := http.Post("http://"+metrics+"/debug/cpu-recovery?chunks="+n, "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/debug/cpu-recovery?chunks=%s: %s %s", n, resp.Status, b)
	}
}

// waitMetric waits until an unlabelled metric satisfies ok.
func waitMetric(t *testing.T, metrics, name string, ok func(float64) bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !ok(metric(t, scrape(t, metrics), name)) {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not reach the value wanted in 30s", name)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// arenaCatalog decodes the namespace catalog beside an arena.
func arenaCatalog(t *testing.T, dir string) map[[32]byte][]byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, cpu.CatalogFileName))
	if err != nil {
		t.Fatal(err)
	}
	ns, err := disk.DecodeCatalog(b)
	if err != nil {
		t.Fatal(err)
	}
	return ns
}

// TestCPUArenaCatalogKeepsOnlyLiveNamespaces: namespaces made and emptied
// one after another (an RL fleet resetting its engines) leave the arena's
// catalog once the daemon drops them, so the file holds no more entries
// than the daemon keeps namespaces; the blocks of the namespace that
// stays come back after a kill -9.
func TestCPUArenaCatalogKeepsOnlyLiveNamespaces(t *testing.T) {
	bin := buildDaemon(t)
	dir := arenaDir(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	args := arenaArgs(sock, metrics, dir, "--namespace-linger", "1ms")
	ctx := context.Background()
	m := arenaModel
	r := testenv.NewRegion(t, m.RegionBytes())
	proc, c, exited := startDaemon(t, bin, args...)
	keep, err := c.Register(ctx, []byte("catalog-keep"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	hs := m.Hashes(51, 8)
	for i, h := range hs {
		m.Fill(r, i, h)
	}
	if res, err := c.Store(ctx, keep.RegistrationId, []*pb.Job{testenv.Job(1, hs, testenv.Seq(0, len(hs)))}, true); err != nil || !res[0].Ok {
		t.Fatalf("store: %v %v", res, err)
	}
	const churn = 40
	for i := 0; i < churn; i++ {
		reg, err := c.Register(ctx, []byte("catalog-churn-"+strconv.Itoa(i)), m.Layout(), m.Regions(r), "test")
		if err != nil {
			t.Fatal(err)
		}
		h := m.Hashes(uint64(100+i), 1)
		m.Fill(r, 9, h[0])
		if res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(uint64(10+i), h, []uint32{9})}, true); err != nil || !res[0].Ok {
			t.Fatalf("store: %v %v", res, err)
		}
		if _, err := c.Invalidate(ctx, []uint32{reg.NamespaceId}, nil); err != nil { // reset_cache
			t.Fatal(err)
		}
		if err := c.Unregister(ctx, reg.RegistrationId); err != nil {
			t.Fatal(err)
		}
	}
	// The daemon drops them within its sweep (a second); the catalog
	// follows.
	waitMetric(t, metrics, "kvoffload_namespaces", func(v float64) bool { return v == 1 })
	deadline := time.Now().Add(30 * time.Second)
	for n := len(arenaCatalog(t, dir)); n != 1; n = len(arenaCatalog(t, dir)) {
		if time.Now().After(deadline) {
			t.Fatalf("the arena's catalog holds %d namespaces, the daemon keeps 1", n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// A new namespace after the drops: the catalog holds the two.
	if _, err := c.Register(ctx, []byte("catalog-new"), m.Layout(), m.Regions(r), "test"); err != nil {
		t.Fatal(err)
	}
	if n := len(arenaCatalog(t, dir)); n != 2 {
		t.Fatalf("after one more namespace the arena's catalog holds %d, want 2", n)
	}
	proc.Process.Signal(syscall.SIGKILL)
	<-exited
	os.Remove(sock)
	_, c2, _ := startDaemon(t, bin, args...)
	if blocks, _ := waitCPURecovered(t, metrics); blocks != len(hs) {
		t.Fatalf("recovered %d blocks, want the %d of the namespace kept", blocks, len(hs))
	}
	reg2, err := c2.Register(ctx, []byte("catalog-keep"), m.Layout(), m.Regions(r), "test")
	if err != nil || !reg2.JoinedExisting {
		t.Fatalf("register again: %v %v", reg2, err)
	}
	for i, h := range hs {
		loadExact(t, c2, reg2, r, uint64(100+i), h, 20)
	}
}

// TestCPUArenaOversizedCatalogKeepsTheBlocks: a namespace catalog beside
// the arena past the size this daemon reads whole (an older daemon kept
// every namespace ever made in it) does not cost the arena its blocks:
// the start keeps the namespaces the records name, and every block comes
// back byte-exact.
func TestCPUArenaOversizedCatalogKeepsTheBlocks(t *testing.T) {
	bin := buildDaemon(t)
	dir := arenaDir(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	args := arenaArgs(sock, metrics, dir)
	ctx := context.Background()
	m := arenaModel
	r := testenv.NewRegion(t, m.RegionBytes())
	proc, c, exited := startDaemon(t, bin, args...)
	reg, err := c.Register(ctx, []byte("catalog-big"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	hs := m.Hashes(61, 16)
	for i, h := range hs {
		m.Fill(r, i, h)
	}
	if res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(1, hs, testenv.Seq(0, len(hs)))}, true); err != nil || !res[0].Ok {
		t.Fatalf("store: %v %v", res, err)
	}
	proc.Process.Signal(syscall.SIGTERM)
	<-exited
	// 70 entries of 1 MiB besides the real one: past the 64 MiB read whole.
	ns := arenaCatalog(t, dir)
	for i := range 70 {
		var d [32]byte
		d[0], d[1] = 0xee, byte(i)
		ns[d] = bytes.Repeat([]byte{'x'}, disk.MaxNamespaceMeta)
	}
	if err := os.WriteFile(filepath.Join(dir, cpu.CatalogFileName), disk.EncodeCatalog(ns), 0o600); err != nil {
		t.Fatal(err)
	}
	_, c2, _ := startDaemon(t, bin, args...)
	if blocks, dropped := waitCPURecovered(t, metrics); blocks != len(hs) {
		t.Fatalf("recovered %d blocks (%d dropped), want %d", blocks, dropped, len(hs))
	}
	reg2, err := c2.Register(ctx, []byte("catalog-big"), m.Layout(), m.Regions(r), "test")
	if err != nil || !reg2.JoinedExisting {
		t.Fatalf("register again: %v %v", reg2, err)
	}
	for i, h := range hs {
		loadExact(t, c2, reg2, r, uint64(100+i), h, 20)
	}
	// The daemon's own catalog is small again.
	if n := len(arenaCatalog(t, dir)); n != 1 {
		t.Fatalf("the catalog holds %d namespaces after the start, want 1", n)
	}
}

// TestCPUArenaRecoveredCopiesOnDiskAreClean: blocks that come back both
// from the arena and from the disk tier are clean CPU copies: with the
// CPU tier full of them, a store takes their slots (the blocks stay on
// disk) instead of failing NO_SPACE.
func TestCPUArenaRecoveredCopiesOnDiskAreClean(t *testing.T) {
	bin := buildDaemon(t)
	dir := arenaDir(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	diskArgs := []string{"--disk-dir", t.TempDir(), "--disk-bytes", "64MiB", "--disk-chunk-bytes", "4MiB", "--write-through"}
	args := arenaArgs(sock, metrics, dir, diskArgs...)
	ctx := context.Background()
	m := arenaModel
	r := testenv.NewRegion(t, m.RegionBytes())
	proc, c, exited := startDaemon(t, bin, args...)
	reg, err := c.Register(ctx, []byte("arena-clean"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	// 192 blocks of 64 KiB: three quarters of the 16 MiB arena (a store
	// past the free slots would wait on the disk writes), all written to
	// disk.
	hs := m.Hashes(71, 192)
	for at := 0; at < len(hs); at += m.Blocks {
		for j := range m.Blocks {
			m.Fill(r, j, hs[at+j])
		}
		if res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(uint64(at), hs[at:at+m.Blocks], testenv.Seq(0, m.Blocks))}, true); err != nil || !res[0].Ok {
			t.Fatalf("store: %v %v", res, err)
		}
	}
	// Every one on disk too before the stop.
	waitMetric(t, metrics, "kvoffload_cpu_clean_blocks", func(v float64) bool { return v == float64(len(hs)) })
	waitMetric(t, metrics, "kvoffload_disk_queued_writes", func(v float64) bool { return v == 0 })
	proc.Process.Signal(syscall.SIGTERM)
	<-exited

	proc2, c2, exited2 := startDaemon(t, bin, args...)
	blocks, _ := waitCPURecovered(t, metrics)
	waitMetric(t, metrics, "kvoffload_disk_recovering", func(v float64) bool { return v == 0 })
	text := scrape(t, metrics)
	clean := metric(t, text, "kvoffload_cpu_clean_blocks")
	inCPU, onDisk := metric(t, text, `kvoffload_tier_blocks{tier="cpu"}`), metric(t, text, `kvoffload_tier_blocks{tier="disk"}`)
	t.Logf("after the restart: %d blocks back from the arena, %v from the disk tier; %v in the CPU tier, %v of them clean, %v on disk; %s",
		blocks, metric(t, text, "kvoffload_disk_recovered_blocks_total"), inCPU, clean, onDisk, grepMetric(text, "kvoffload_evictions_total"))
	// Every block comes back from both tiers and stays in both: the
	// arena's three full chunks are past the CPU policy's capacity by its
	// reserve (an eighth of their slots), and its recovery gives the class
	// the free fourth chunk for that rather than evicting 24 of them.
	if blocks != len(hs) || inCPU != float64(len(hs)) || clean != float64(len(hs)) || onDisk != float64(len(hs)) {
		t.Fatalf("%d blocks back from the arena, %v in the CPU tier, %v of them clean, %v on disk: want all %d everywhere", blocks, inCPU, clean, onDisk, len(hs))
	}
	reg2, err := c2.Register(ctx, []byte("arena-clean"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	// As many new blocks as the CPU tier holds: each store must find a
	// slot, free or given up by a clean copy. Each waits until the
	// write-through copies of the one before have landed: a copy holds
	// its CPU slot until then, and a store that found the tier full of
	// them (no clean copy left, 16 disk writes queued, 217..278 of 448
	// blocks on disk, in 2 of 13 runs) was refused NO_SPACE, the
	// back-pressure of a disk slower than the stores, not a clean copy
	// kept.
	fresh := m.Hashes(72, 256)
	for at := 0; at < len(fresh); at += m.Blocks {
		waitMetric(t, metrics, "kvoffload_cpu_clean_blocks", func(v float64) bool {
			return v == metric(t, scrape(t, metrics), `kvoffload_tier_blocks{tier="cpu"}`)
		})
		res, err := c2.Store(ctx, reg2.RegistrationId, []*pb.Job{testenv.Job(uint64(1000+at), fresh[at:at+m.Blocks], testenv.Seq(0, m.Blocks))}, true)
		if err != nil {
			t.Fatal(err)
		}
		if !res[0].Ok {
			tx := scrape(t, metrics)
			t.Logf("at the refusal: %s | %s | %s | %s | %s", grepMetric(tx, "kvoffload_store_no_space_total"), grepMetric(tx, "kvoffload_cpu_clean_blocks"), grepMetric(tx, "kvoffload_disk_queued_writes"), grepMetric(tx, "kvoffload_evictions_total"), grepMetric(tx, "kvoffload_tier_blocks"))
			t.Fatalf("store of blocks %d..%d with the CPU tier full of clean copies: %d failures", at, at+m.Blocks, len(res[0].Failures))
		}
	}
	text = scrape(t, metrics)
	t.Logf("clean dropped %v, policy evictions %s, no space %s", metric(t, text, "kvoffload_cpu_clean_dropped_total"), grepMetric(text, "kvoffload_evictions_total"), grepMetric(text, "kvoffload_store_no_space_total"))

	// The disk tier alone: a restart without the arena brings back from
	// disk every block on disk before the SIGTERM (writes still landing
	// then may add to them), the first 192 byte-exact.
	onDisk = metric(t, scrape(t, metrics), `kvoffload_tier_blocks{tier="disk"}`)
	proc2.Process.Signal(syscall.SIGTERM)
	<-exited2
	_, c3, _ := startDaemon(t, bin, append([]string{"--socket", sock, "--metrics-addr", metrics, "--cpu-bytes", "16MiB", "--cpu-chunk-bytes", "4MiB"}, diskArgs...)...)
	waitMetric(t, metrics, "kvoffload_disk_recovering", func(v float64) bool { return v == 0 })
	text = scrape(t, metrics)
	t.Logf("without the arena: %v blocks on disk before the stop, %v recovered", onDisk, metric(t, text, "kvoffload_disk_recovered_blocks_total"))
	if got := metric(t, text, "kvoffload_disk_recovered_blocks_total"); onDisk < float64(len(hs)) || got < onDisk {
		t.Fatalf("%v blocks back from the disk tier, %v there before the SIGTERM: want every one", got, onDisk)
	}
	reg3, err := c3.Register(ctx, []byte("arena-clean"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range hs {
		loadExact(t, c3, reg3, r, uint64(5000+i), h, 0)
	}
}

func grepMetric(text, name string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, name) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "; ")
}
