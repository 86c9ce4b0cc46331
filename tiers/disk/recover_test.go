package disk_test

import (
	"strings"
	"sync"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

const (
	recPayload = 5000            // 12 KiB slots: 85 per 1 MiB chunk
	recWindow  = 256 << 10       // smaller than a chunk read, larger than a block read
	recChunks  = 12              // per file
	recFilled  = 2*recChunks - 4 // chunks written before the restart: file 1 keeps 4 free
)

// filledTier writes recFilled chunks' worth of blocks over two files
// (file 0 whole, file 1 but its last 4 chunks), closes it and returns its
// config and what it holds by slot.
func filledTier(t *testing.T, fsys vfs.FS) (disk.Config, map[slots.SlotID]block) {
	t.Helper()
	cfg := disk.Config{Dirs: []string{"/disk/a", "/disk/b"}, BytesPerDir: recChunks * chunk, ChunkBytes: chunk,
		FS: fsys, Direct: true, Logger: quiet()}
	tier := open(t, cfg)
	perChunk := int(chunk / disk.SlotBytes(recPayload))
	var bs []block
	for i := range recFilled * perChunk {
		bs = append(bs, newBlock(i, recPayload, 32))
	}
	want := map[slots.SlotID]block{}
	buf := arena(t, 8192)
	for i, s := range alloc(t, tier, recPayload, bs) {
		bs[i].fill(buf)
		if err := writeSync(tier, s, bs[i].meta, buf); err != nil {
			t.Fatal(err)
		}
		tier.Unpin(s)
		want[s] = bs[i]
	}
	if err := tier.Close(); err != nil {
		t.Fatal(err)
	}
	return cfg, want
}

// owner plays the offload service's part of recovery: it keeps the first
// copy of each key, erases or declines the keys it is told to.
type recOwner struct {
	t       testing.TB
	mu      sync.Mutex
	kept    map[slots.SlotID]disk.Recovered
	byKey   map[index.Key]bool
	erase   map[index.Key]bool
	decline map[index.Key]bool
}

func newRecOwner(t testing.TB) *recOwner {
	return &recOwner{t: t, kept: map[slots.SlotID]disk.Recovered{}, byKey: map[index.Key]bool{},
		erase: map[index.Key]bool{}, decline: map[index.Key]bool{}}
}

func (o *recOwner) recoverer() disk.Recoverer {
	return disk.Recoverer{
		Key: func(r disk.Recovered) (index.Key, bool) { return keyOf(r), true },
		File: func(rs []disk.Recovered, keys []index.Key) []disk.Verdict {
			o.mu.Lock()
			defer o.mu.Unlock()
			v := make([]disk.Verdict, len(rs))
			for i, r := range rs {
				switch k := keys[i]; {
				case o.erase[k]:
					v[i] = disk.Erase
				case o.decline[k] || o.byKey[k]:
					v[i] = disk.Decline
				default:
					o.kept[r.Slot], o.byKey[k] = r, true
					v[i] = disk.Keep
				}
			}
			return v
		},
	}
}

func (o *recOwner) snapshot() map[slots.SlotID]disk.Recovered {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make(map[slots.SlotID]disk.Recovered, len(o.kept))
	for s, r := range o.kept {
		out[s] = r
	}
	return out
}

// Recovery runs in the background: blocks come online chunk by chunk and
// read back byte-exact while the rest is still being scanned; writes made
// meanwhile never land in a chunk recovery has not scanned; every block
// comes back in the end, and each file logs a line.
func TestRecoveryInBackground(t *testing.T) {
	inner := vfs.NewMem()
	cfg, want := filledTier(t, inner)
	gate := testenv.NewGateFS(inner, recWindow, 3)
	cfg.FS = gate
	var logs logRecorder
	cfg.Logger = logs.logger(-4)
	tier := open(t, cfg)
	t.Cleanup(gate.Release) // first, should the test fail: Close waits for recovery
	o := newRecOwner(t)
	if err := tier.Recover(o.recoverer()); err != nil {
		t.Fatal(err)
	}
	// Four readers per file, every one now held at the gate: recovery is
	// stuck in the middle.
	gate.Waiting(8)
	st := tier.Recovery()
	if st.State != disk.RecoveryRunning || st.SlotsScanned == 0 || st.SlotsScanned >= st.SlotsTotal || tier.Held() == 0 {
		t.Fatalf("mid-recovery progress: %+v, %d chunks held", st, tier.Held())
	}
	if st.SlotsTotal != uint64(recFilled*int(chunk/disk.SlotBytes(recPayload))) {
		t.Errorf("SlotsTotal %d, want the slots of %d chunks", st.SlotsTotal, recFilled)
	}
	online := o.snapshot()
	if len(online) == 0 || len(online) == len(want) || uint64(len(online)) != st.Blocks {
		t.Fatalf("%d blocks online mid-recovery (progress says %d), of %d", len(online), st.Blocks, len(want))
	}
	for s := range online {
		if err := readBlock(t, tier, s, want[s]); err != nil {
			t.Fatalf("slot %d online mid-recovery: %v", s, err)
		}
	}
	// New blocks get slots now, in free chunks only.
	var fresh []block
	for i := range 300 {
		fresh = append(fresh, newBlock(100000+i, recPayload, 32))
	}
	freshAt := map[slots.SlotID]block{}
	buf := arena(t, 8192)
	for i, s := range alloc(t, tier, recPayload, fresh) {
		if _, ok := want[s]; ok {
			if _, on := online[s]; !on {
				t.Fatalf("Alloc handed out slot %d, which recovery has not looked at", s)
			}
		}
		fresh[i].fill(buf)
		if err := writeSync(tier, s, fresh[i].meta, buf); err != nil {
			t.Fatal(err)
		}
		tier.Unpin(s)
		freshAt[s] = fresh[i]
	}

	gate.Release()
	<-tier.RecoveryDone()
	st = tier.Recovery()
	got := o.snapshot()
	if st.State != disk.RecoveryDone || st.SlotsScanned != st.SlotsTotal || st.Bad != 0 || len(got) != len(want) || tier.Held() != 0 {
		t.Fatalf("after recovery: %+v, %d of %d blocks, %d chunks held", st, len(got), len(want), tier.Held())
	}
	for s, b := range want {
		if r, ok := got[s]; !ok || keyOf(r) != b.key {
			t.Fatalf("slot %d: recovered %+v, want %v", s, r, b.key)
		}
		if err := readBlock(t, tier, s, b); err != nil {
			t.Fatalf("slot %d: %v", s, err)
		}
	}
	for s, b := range freshAt {
		if err := readBlock(t, tier, s, b); err != nil {
			t.Fatalf("slot %d written during recovery: %v", s, err)
		}
	}
	if _, n := tier.Usage(); n != uint64(len(want)+len(freshAt)) {
		t.Errorf("Usage: %d blocks, want %d", n, len(want)+len(freshAt))
	}
	files := 0
	for _, l := range logs.lines() {
		if strings.Contains(l, "file recovered") {
			files++
		}
	}
	if files != 2 {
		t.Errorf("%d per-file recovery log lines, want 2: %v", files, logs.lines())
	}
}

// Shutdown during recovery: the reads in flight finish and nothing more
// is read; a later start gets everything back.
func TestRecoveryStopsAtOnce(t *testing.T) {
	inner := vfs.NewMem()
	cfg, want := filledTier(t, inner)
	gate := testenv.NewGateFS(inner, recWindow, 2)
	cfg.FS = gate
	tier, err := disk.Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gate.Release(); tier.Close() })
	o := newRecOwner(t)
	if err := tier.Recover(o.recoverer()); err != nil {
		t.Fatal(err)
	}
	gate.Waiting(8)
	before := gate.Passed()
	tier.StopRecovery()
	gate.Release()
	if err := tier.Close(); err != nil {
		t.Fatal(err)
	}
	if extra := gate.Passed() - before; extra > 8 {
		t.Errorf("%d recovery reads after the stop, want at most the 8 in flight", extra)
	}
	if st := tier.Recovery(); st.State != disk.RecoveryStopped || st.SlotsScanned >= st.SlotsTotal {
		t.Errorf("after a stop: %+v", st)
	}
	cfg.FS = inner
	tier = open(t, cfg)
	if got := recovered(t, tier); len(got) != len(want) {
		t.Fatalf("after a stopped recovery, the next start recovered %d of %d blocks", len(got), len(want))
	}
}

// The owner's verdicts: an erased block never comes back (its header is
// zeros), a declined one frees its slot but may come back as itself.
func TestRecoveryVerdicts(t *testing.T) {
	inner := vfs.NewMem()
	cfg, want := filledTier(t, inner)
	o := newRecOwner(t)
	var erased, declined []slots.SlotID
	for s, b := range want {
		switch len(erased) + len(declined) {
		case 0, 2, 4:
			o.erase[b.key] = true
			erased = append(erased, s)
		case 1, 3:
			o.decline[b.key] = true
			declined = append(declined, s)
		}
	}
	tier := open(t, cfg)
	if err := tier.Recover(o.recoverer()); err != nil {
		t.Fatal(err)
	}
	<-tier.RecoveryDone()
	st := tier.Recovery()
	if st.Erased != 3 || st.Declined != 2 || st.Blocks != uint64(len(want)-5) {
		t.Fatalf("verdicts: %+v", st)
	}
	if _, n := tier.Usage(); n != uint64(len(want)-5) || tier.Pinned() != 0 {
		t.Fatalf("Usage %d blocks, %d pinned; want %d, 0", n, tier.Pinned(), len(want)-5)
	}
	if err := tier.Close(); err != nil {
		t.Fatal(err)
	}
	tier = open(t, cfg)
	got := recovered(t, tier)
	for _, s := range erased {
		if _, ok := got[s]; ok {
			t.Errorf("erased slot %d came back", s)
		}
	}
	for _, s := range declined {
		if r, ok := got[s]; !ok || keyOf(r) != want[s].key {
			t.Errorf("declined slot %d did not come back as itself: %+v", s, r)
		}
	}
	if len(got) != len(want)-3 {
		t.Errorf("%d blocks came back, want %d", len(got), len(want)-3)
	}
}

// A recovery window the device fails is read again slot by slot: one
// failed read costs nothing when the slots themselves read fine.
func TestRecoveryWindowError(t *testing.T) {
	inner := vfs.NewMem()
	cfg, want := filledTier(t, inner)
	efs, err := errorfs.New(inner, errorfs.Options{Match: onlySlotFiles})
	if err != nil {
		t.Fatal(err)
	}
	cfg.FS = efs
	tier := open(t, cfg)
	efs.FailAtIndex(efs.Ops()) // the first recovery read
	got := recovered(t, tier)
	if efs.Counts()[errorfs.Index] != 1 {
		t.Fatal("no recovery read failed")
	}
	if len(got) != len(want) {
		t.Fatalf("recovered %d of %d blocks after one failed window", len(got), len(want))
	}
	if st := tier.Recovery(); st.Bad != 0 {
		t.Errorf("%d bad slots", st.Bad)
	}
}
