package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
)

// The CPU tier's persistent arena (--cpu-arena-dir), through the real
// binary: what survives a kill -9, what never comes back.

// arenaModel has 64 KiB blocks: a 16 MiB arena holds 256.
var arenaModel = testenv.Model{Layers: 2, SegBytes: 32 << 10, Blocks: 64}

// arenaDir is a fresh 0700 directory on tmpfs.
func arenaDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "kvo-arena-")
	if err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func arenaArgs(sock, metrics, dir string, extra ...string) []string {
	return append([]string{"--socket", sock, "--metrics-addr", metrics, "--cpu-bytes", "16MiB", "--cpu-chunk-bytes", "4MiB",
		"--cpu-arena-dir", dir}, extra...)
}

// metric reads one unlabelled sample from a scrape.
func metric(t *testing.T, text, name string) float64 {
	t.Helper()
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("no %s in the metrics", name)
	return 0
}

// waitCPURecovered waits until the CPU tier's recovery has ended and
// returns the blocks it brought back and the records it dropped.
func waitCPURecovered(t *testing.T, metrics string) (blocks, dropped int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		text := scrape(t, metrics)
		if st := metric(t, text, "kvoffload_cpu_recovery_state"); st == 2 || st == 0 {
			return int(metric(t, text, "kvoffload_cpu_recovered_blocks")), int(metric(t, text, "kvoffload_cpu_recovery_dropped_blocks"))
		}
		if time.Now().After(deadline) {
			t.Fatal("the CPU tier's recovery did not end")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// lookupTier reports whether h is offered, and from which tier.
func lookupTier(t *testing.T, c *client.Client, ns uint32, h []byte) (bool, pb.Tier) {
	t.Helper()
	lr, err := c.Lookup(context.Background(), []uint32{ns}, testenv.Keys(h), 0)
	if err != nil {
		t.Fatal(err)
	}
	if lr.Ready == 0 {
		return false, 0
	}
	return true, lr.Tiers[0]
}

// loadExact loads h into engine block b and insists on every byte.
func loadExact(t *testing.T, c *client.Client, reg *pb.RegisterResponse, r *testenv.Region, id uint64, h []byte, b int) {
	t.Helper()
	clear(arenaModel.Segment(r, 0, b))
	clear(arenaModel.Segment(r, 1, b))
	res, err := c.Load(context.Background(), reg.RegistrationId, []*pb.Job{testenv.Job(id, [][]byte{h}, []uint32{uint32(b)})}, true)
	if err != nil || !res[0].Ok {
		t.Fatalf("load of block %x offered after the restart: %v %v", h[:8], res, err)
	}
	if err := arenaModel.Check(r, b, h); err != nil {
		t.Fatalf("block %x after the restart: %v", h[:8], err)
	}
}

// TestCPUArenaSurvivesKill9: a daemon killed with SIGKILL while stores are
// in flight, restarted on the same --cpu-arena-dir, serves at once and
// brings back from the CPU tier, byte-exact, every block it reported
// stored, except those invalidated before the kill; the re-registered
// engine (same fingerprint) joins the recovered namespace.
func TestCPUArenaSurvivesKill9(t *testing.T) {
	bin := buildDaemon(t)
	dir := arenaDir(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	args := arenaArgs(sock, metrics, dir)
	proc, c, exited := startDaemon(t, bin, args...)
	ctx := context.Background()
	r := testenv.NewRegion(t, arenaModel.RegionBytes())
	reg, err := c.Register(ctx, []byte("arena-kill9"), arenaModel.Layout(), arenaModel.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	hs := arenaModel.Hashes(25, 200)
	var stored [][]byte
	for step := 0; step < 40; step++ { // 160 blocks, 4 a job, each waited for
		part := hs[step*4 : step*4+4]
		blocks := []uint32{0, 1, 2, 3}
		for i, h := range part {
			arenaModel.Fill(r, int(blocks[i]), h)
		}
		res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(uint64(step), part, blocks)}, true)
		if err != nil || !res[0].Ok {
			t.Fatalf("store: %v %v", res, err)
		}
		stored = append(stored, part...)
	}
	// Then more stores, not waited for, and the kill while they copy.
	for step := 40; step < 50; step++ {
		part := hs[step*4 : step*4+4]
		blocks := []uint32{uint32(4 + (step-40)*4), uint32(5 + (step-40)*4), uint32(6 + (step-40)*4), uint32(7 + (step-40)*4)}
		for i, h := range part {
			arenaModel.Fill(r, int(blocks[i]), h)
		}
		if _, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(uint64(step), part, blocks)}, false); err != nil {
			t.Fatal(err)
		}
	}
	// Ten invalidated (their slots free, nothing stored after into
	// them): they must stay gone.
	invalidated := stored[:10]
	if n, err := c.Invalidate(ctx, []uint32{reg.NamespaceId}, testenv.Keys(invalidated...)); err != nil || n != 10 {
		t.Fatalf("invalidate: %d %v", n, err)
	}
	if err := proc.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-exited
	os.Remove(sock) // a stale socket, as a killed daemon leaves

	began := time.Now()
	_, c2, _ := startDaemon(t, bin, args...)
	serving := time.Since(began)
	blocks, dropped := waitCPURecovered(t, metrics)
	t.Logf("restart on a 16MiB arena: SERVING after %v (process start included), recovery done after %v: %d blocks back, %d records dropped",
		serving, time.Since(began), blocks, dropped)
	if blocks < len(stored)-len(invalidated) {
		t.Fatalf("%d blocks recovered, want at least the %d reported stored and not invalidated", blocks, len(stored)-len(invalidated))
	}
	reg2, err := c2.Register(ctx, []byte("arena-kill9"), arenaModel.Layout(), arenaModel.Regions(r), "test")
	if err != nil || !reg2.JoinedExisting {
		t.Fatalf("the re-registered engine did not join the recovered namespace: %v %v", reg2, err)
	}
	for i, h := range stored {
		ok, tier := lookupTier(t, c2, reg2.NamespaceId, h)
		if i < len(invalidated) {
			if ok {
				t.Fatalf("block %d, invalidated before the kill, is offered after the restart", i)
			}
			continue
		}
		if !ok || tier != pb.Tier_TIER_CPU {
			t.Fatalf("block %d, stored before the kill: offered %v from %v, want the CPU tier", i, ok, tier)
		}
		loadExact(t, c2, reg2, r, uint64(1000+i), h, 60)
	}
	// The stores in flight at the kill: whichever came back is whole.
	for i, h := range hs[160:200] {
		if ok, _ := lookupTier(t, c2, reg2.NamespaceId, h); ok {
			loadExact(t, c2, reg2, r, uint64(2000+i), h, 61)
		}
	}
}

// arenaSlotOf finds the slot whose record names hash h in a stopped
// daemon's arena file, and returns the file's bytes, the record's offset
// and the payload's.
func arenaSlotOf(t *testing.T, file []byte, h []byte) (recOff, payloadOff int) {
	t.Helper()
	le := binary.LittleEndian
	recordsOff, arenaOff, arenaBytes := int(le.Uint64(file[40:])), int(le.Uint64(file[48:])), int(le.Uint64(file[24:]))
	var buf [slot.HeaderSize]byte
	for i := 0; i < arenaBytes/4096; i++ {
		off := recordsOff + i*cpu.RecordBytes
		copy(buf[:cpu.RecordBytes], file[off:off+cpu.RecordBytes])
		hd, err := slot.Decode(buf[:])
		if err == nil && bytes.Equal(hd.Key(), h) {
			return off, arenaOff + i*4096
		}
	}
	t.Fatalf("no record names block %x", h[:8])
	return 0, 0
}

// TestCPUArenaNeverServesTornSlots: blocks damaged in the arena file while
// the daemon is stopped (a payload byte changed, a torn record, a record
// whose checksum is not its payload's) are never served after the
// restart, nor is a record copied to another slot's place; the others
// are, byte-exact. A second daemon on the same
// directory is refused.
func TestCPUArenaNeverServesTornSlots(t *testing.T) {
	bin := buildDaemon(t)
	dir := arenaDir(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	args := arenaArgs(sock, metrics, dir)
	proc, c, exited := startDaemon(t, bin, args...)
	ctx := context.Background()
	r := testenv.NewRegion(t, arenaModel.RegionBytes())
	reg, err := c.Register(ctx, []byte("arena-torn"), arenaModel.Layout(), arenaModel.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	hs := arenaModel.Hashes(26, 32)
	for i := 0; i < len(hs); i += 8 {
		blocks := []uint32{0, 1, 2, 3, 4, 5, 6, 7}
		for j, h := range hs[i : i+8] {
			arenaModel.Fill(r, j, h)
		}
		if res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(uint64(i), hs[i:i+8], blocks)}, true); err != nil || !res[0].Ok {
			t.Fatalf("store: %v %v", res, err)
		}
	}

	// A second daemon on the same directory.
	second := exec.Command(bin, arenaArgs(filepath.Join(t.TempDir(), "kv2.sock"), "", dir)...)
	out, err := second.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "in use by another kvoffloadd") {
		t.Fatalf("a second daemon on the same --cpu-arena-dir: %v\n%s", err, out)
	}

	proc.Process.Signal(syscall.SIGKILL)
	<-exited
	os.Remove(sock)

	path := filepath.Join(dir, cpu.ArenaFileName)
	file, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	_, p0 := arenaSlotOf(t, file, hs[0])
	file[p0+12345] ^= 0x01 // a payload byte
	r1, _ := arenaSlotOf(t, file, hs[1])
	file[r1+100] ^= 0x80 // a torn or rotten record
	r2, _ := arenaSlotOf(t, file, hs[2])
	var buf [slot.HeaderSize]byte
	copy(buf[:], file[r2:r2+cpu.RecordBytes])
	hd, err := slot.Decode(buf[:])
	if err != nil {
		t.Fatal(err)
	}
	hd.PayloadSum ^= 1 // a well-formed record whose payload is not the one in the slot
	if err := slot.Encode(hd, buf[:]); err != nil {
		t.Fatal(err)
	}
	copy(file[r2:], buf[:cpu.RecordBytes])
	// A good record copied to another slot's place (a misdirected write):
	// it names its own slot, not this one, and its block stays itself.
	r3, _ := arenaSlotOf(t, file, hs[3])
	le := binary.LittleEndian
	last := int(le.Uint64(file[40:])) + (int(le.Uint64(file[24:]))/4096-1)*cpu.RecordBytes
	if !bytes.Equal(file[last:last+cpu.RecordBytes], make([]byte, cpu.RecordBytes)) {
		t.Fatal("the arena's last slot holds a block: the test needs it empty")
	}
	copy(file[last:], file[r3:r3+cpu.RecordBytes])
	if err := os.WriteFile(path, file, 0o600); err != nil {
		t.Fatal(err)
	}

	_, c2, _ := startDaemon(t, bin, args...)
	blocks, dropped := waitCPURecovered(t, metrics)
	if blocks != len(hs)-3 || dropped != 4 {
		t.Fatalf("recovered %d blocks, dropped %d; want %d and 4", blocks, dropped, len(hs)-3)
	}
	reg2, err := c2.Register(ctx, []byte("arena-torn"), arenaModel.Layout(), arenaModel.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range hs {
		ok, _ := lookupTier(t, c2, reg2.NamespaceId, h)
		if i < 3 {
			if ok {
				t.Fatalf("damaged block %d is offered", i)
			}
			res, err := c2.Load(ctx, reg2.RegistrationId, []*pb.Job{testenv.Job(uint64(100+i), [][]byte{h}, []uint32{9})}, true)
			if err != nil || res[0].Ok {
				t.Fatalf("a load of damaged block %d: %v %v, want it failed", i, res, err)
			}
			continue
		}
		if !ok {
			t.Fatalf("intact block %d is not offered", i)
		}
		loadExact(t, c2, reg2, r, uint64(200+i), h, 10)
	}
}

// TestCPUArenaOtherSizeDiscarded: an arena file of another --cpu-bytes is
// discarded with a log line, never used; the daemon serves, empty.
func TestCPUArenaOtherSizeDiscarded(t *testing.T) {
	bin := buildDaemon(t)
	dir := arenaDir(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	proc, c, exited := startDaemon(t, bin, arenaArgs(sock, "", dir)...)
	_, r, h := storeOne(t, c, arenaModel, "arena-size", 27)
	proc.Process.Signal(syscall.SIGKILL)
	<-exited
	os.Remove(sock)

	var logs bytes.Buffer
	d := exec.Command(bin, append(arenaArgs(sock, "", dir), "--cpu-bytes", "20MiB")...)
	d.Stderr = &logs
	if err := d.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { d.Wait(); close(done) }()
	defer func() { d.Process.Kill(); <-done }()
	c2, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	waitHealthy(t, c2, d, done, &logs)
	reg2, err := c2.Register(context.Background(), []byte("arena-size"), arenaModel.Layout(), arenaModel.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	if ok, _ := lookupTier(t, c2, reg2.NamespaceId, h); ok {
		t.Fatal("a block of an arena of another size is offered")
	}
	d.Process.Signal(syscall.SIGTERM)
	<-done
	if !strings.Contains(logs.String(), "cannot be used; it is discarded") || !strings.Contains(logs.String(), "16777216 bytes in 4194304-byte chunks") {
		t.Fatalf("no log line says the arena was discarded and why:\n%s", logs.String())
	}
}

// TestCPUArenaPrivateWithoutTheOption: without --cpu-arena-dir the arena is
// anonymous memory of the process (it goes with it); with it, the arena is
// the file in the directory.
func TestCPUArenaPrivateWithoutTheOption(t *testing.T) {
	bin := buildDaemon(t)
	arenaMapped := func(extra ...string) string {
		sock := filepath.Join(t.TempDir(), "kv.sock")
		proc, _, exited := startDaemon(t, bin, append([]string{"--socket", sock, "--metrics-addr", "", "--cpu-bytes", "16MiB"}, extra...)...)
		maps, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(proc.Process.Pid), "maps"))
		proc.Process.Signal(syscall.SIGKILL)
		<-exited
		if err != nil {
			t.Fatal(err)
		}
		var files []string
		for _, line := range strings.Split(string(maps), "\n") {
			if strings.Contains(line, cpu.ArenaFileName) {
				files = append(files, line)
			}
		}
		return strings.Join(files, "\n")
	}
	if m := arenaMapped(); m != "" {
		t.Fatalf("without --cpu-arena-dir the daemon maps an arena file:\n%s", m)
	}
	dir := arenaDir(t)
	if m := arenaMapped("--cpu-arena-dir", dir); !strings.Contains(m, filepath.Join(dir, cpu.ArenaFileName)) {
		t.Fatalf("with --cpu-arena-dir the arena is not the file there: %q", m)
	}
}

// TestCPUArenaRecoveryMeanwhile: while the CPU tier's recovery is held
// before it files the arena's blocks, the daemon serves, offers none of
// them (none is verified yet), takes stores, and an Invalidate of keys
// recovery has not reached yet holds: once recovery ends those stay gone,
// the keys stored again keep their new copy, and the rest come back
// byte-exact.
func TestCPUArenaRecoveryMeanwhile(t *testing.T) {
	dir := arenaDir(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	args := arenaArgs(sock, metrics, dir)
	ctx := context.Background()
	r := testenv.NewRegion(t, arenaModel.RegionBytes())
	c, stop := runInProcess(t, args, io.Discard)
	reg, err := c.Register(ctx, []byte("arena-meanwhile"), arenaModel.Layout(), arenaModel.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	hs := arenaModel.Hashes(29, 48)
	for i := 0; i < len(hs); i += 16 {
		blocks := make([]uint32, 16)
		for j, h := range hs[i : i+16] {
			blocks[j] = uint32(j)
			arenaModel.Fill(r, j, h)
		}
		if res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(uint64(i), hs[i:i+16], blocks)}, true); err != nil || !res[0].Ok {
			t.Fatalf("store: %v %v", res, err)
		}
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	gate, held := make(chan struct{}), make(chan struct{}, 1)
	var once sync.Once
	open := func() { once.Do(func() { close(gate) }) }
	testHookCPURecovery = func() {
		select {
		case held <- struct{}{}:
		default:
		}
		<-gate
	}
	t.Cleanup(func() { open(); testHookCPURecovery = nil })
	c2, stop2 := runInProcess(t, args, io.Discard)
	t.Cleanup(open) // before stop2's cleanup: Close waits for recovery
	<-held
	reg2, err := c2.Register(ctx, []byte("arena-meanwhile"), arenaModel.Layout(), arenaModel.Regions(r), "test")
	if err != nil || !reg2.JoinedExisting {
		t.Fatalf("register while recovery runs: %v %v", reg2, err)
	}
	for i, h := range hs {
		if ok, _ := lookupTier(t, c2, reg2.NamespaceId, h); ok {
			t.Fatalf("block %d is offered before recovery verified it", i)
		}
	}
	if n, err := c2.Invalidate(ctx, []uint32{reg2.NamespaceId}, testenv.Keys(hs[:4]...)); err != nil || n != 0 {
		t.Fatalf("invalidate while recovery runs: %d %v (nothing of them is in the index yet)", n, err)
	}
	again := hs[4:8]
	for j, h := range again {
		arenaModel.Fill(r, j, h)
	}
	if res, err := c2.Store(ctx, reg2.RegistrationId, []*pb.Job{testenv.Job(100, again, []uint32{0, 1, 2, 3})}, true); err != nil || !res[0].Ok {
		t.Fatalf("store while recovery runs: %v %v", res, err)
	}
	open()
	blocks, dropped := waitCPURecovered(t, metrics)
	if want := len(hs) - 4 - len(again); blocks != want || dropped != 0 {
		t.Fatalf("recovered %d blocks (dropped %d), want %d: all but the invalidated and the stored again", blocks, dropped, want)
	}
	for i, h := range hs {
		ok, tier := lookupTier(t, c2, reg2.NamespaceId, h)
		if i < 4 {
			if ok {
				t.Fatalf("block %d, invalidated while recovery was held, is offered", i)
			}
			continue
		}
		if !ok || tier != pb.Tier_TIER_CPU {
			t.Fatalf("block %d: offered %v from %v, want the CPU tier", i, ok, tier)
		}
		loadExact(t, c2, reg2, r, uint64(200+i), h, 20)
	}
	if err := stop2(); err != nil {
		t.Fatal(err)
	}
}
