package disk_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

const (
	chunk = 1 << 20 // small chunks: many per file, cheap to scan
	nsID  = 7       // the index's namespace id in tests
)

var testNS = [32]byte{0xAB, 0xCD, 1, 2, 3}

var (
	directOnce sync.Once
	directOK   bool
)

// backend is a filesystem and where a tier's directories go in it.
type backend struct {
	name   string
	fs     vfs.FS
	root   string
	direct bool
}

// osDirect reports whether the test machine's temporary directory takes
// O_DIRECT; the OS backend runs without it where not.
func osDirect(t *testing.T) bool {
	directOnce.Do(func() {
		err := vfs.ProbeDirect(os.TempDir())
		directOK = err == nil
		if err != nil {
			t.Logf("%s refuses O_DIRECT, OS cases run buffered: %v", os.TempDir(), err)
		}
	})
	return directOK
}

func backends(t *testing.T) []backend {
	return []backend{
		{name: "os", fs: vfs.Default, root: t.TempDir(), direct: osDirect(t)},
		{name: "mem", fs: vfs.NewMem(), root: "/disk", direct: true},
	}
}

func (b backend) dirs(n int) []string {
	d := make([]string, n)
	for i := range d {
		d[i] = filepath.Join(b.root, fmt.Sprintf("nvme%d", i))
	}
	return d
}

func (b backend) config(nDirs int, bytesPerDir uint64) disk.Config {
	return disk.Config{Dirs: b.dirs(nDirs), BytesPerDir: bytesPerDir, ChunkBytes: chunk, FS: b.fs, Direct: b.direct, Logger: quiet()}
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// logRecorder keeps log records at or above a level.
type logRecorder struct {
	mu   sync.Mutex
	recs []string
}

func (r *logRecorder) logger(level slog.Level) *slog.Logger {
	return slog.New(recHandler{r: r, level: level})
}

func (r *logRecorder) lines() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.recs...)
}

type recHandler struct {
	r     *logRecorder
	level slog.Level
	attrs []slog.Attr
}

func (h recHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= h.level }
func (h recHandler) Handle(_ context.Context, rec slog.Record) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s %s", rec.Level, rec.Message)
	rec.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
	h.r.mu.Lock()
	h.r.recs = append(h.r.recs, b.String())
	h.r.mu.Unlock()
	return nil
}
func (h recHandler) WithAttrs(as []slog.Attr) slog.Handler {
	h.attrs = append(h.attrs, as...)
	return h
}
func (h recHandler) WithGroup(string) slog.Handler { return h }

func open(t testing.TB, cfg disk.Config) *disk.Tier {
	t.Helper()
	tier, err := disk.Open(cfg)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tier.Close() })
	return tier
}

// arena returns n bytes of page-aligned memory outside the Go heap, as a
// CPU-tier slot would be.
func arena(t testing.TB, n uint64) []byte {
	t.Helper()
	b, err := vfs.AlignedBuffer(int(max(n, 1)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { vfs.FreeBuffer(b) })
	return b[:n]
}

// block is a test block: its key, its meta and its bytes, a pure function
// of (i, payload length).
type block struct {
	key  index.Key
	meta disk.Meta
}

func newBlock(i int, payload uint64, hashLen int) block {
	var h [32]byte
	binary.LittleEndian.PutUint64(h[:], uint64(i)*0x9E3779B97F4A7C15+1)
	binary.LittleEndian.PutUint64(h[8:], uint64(i))
	h[31] = 0x5A
	hash := append([]byte(nil), h[:hashLen]...)
	var kh [32]byte
	copy(kh[:], hash)
	return block{
		key:  index.Key{NS: nsID, Group: uint32(i % 3), Hash: kh},
		meta: disk.Meta{NS: testNS, Group: uint32(i % 3), Hash: hash, PayloadLen: payload},
	}
}

// fill writes the block's bytes into buf[:PayloadLen] and junk after it
// (the padding is not the block's).
func (b block) fill(buf []byte) {
	seed := binary.LittleEndian.Uint64(b.meta.Hash[:8])
	for i := range buf {
		if uint64(i) < b.meta.PayloadLen {
			buf[i] = byte(seed>>(8*(i%8))) ^ byte(i*131+i>>9)
		} else {
			buf[i] = 0xEE
		}
	}
}

func (b block) want() []byte {
	buf := make([]byte, b.meta.PayloadLen)
	b.fill(buf)
	return buf
}

// alloc takes n slots of the class for payload bytes; they come pinned.
func alloc(t testing.TB, tier *disk.Tier, payload uint64, blocks []block) []slots.SlotID {
	t.Helper()
	c, err := tier.Class(disk.SlotBytes(payload))
	if err != nil {
		t.Fatal(err)
	}
	keys := make([]index.Key, len(blocks))
	for i := range blocks {
		keys[i] = blocks[i].key
	}
	c.Admit(keys)
	out := make([]slots.SlotID, len(blocks))
	for i := range blocks {
		s, ok := c.Alloc()
		if !ok {
			t.Fatalf("Alloc of %d-byte slot %d failed", disk.SlotBytes(payload), i)
		}
		out[i] = s
	}
	return out
}

func writeSync(tier *disk.Tier, s slots.SlotID, m disk.Meta, payload []byte) error {
	ch := make(chan error, 1)
	tier.Write(s, m, payload, func(err error) { ch <- err })
	return <-ch
}

func readSync(tier *disk.Tier, s slots.SlotID, m disk.Meta, dst []byte) error {
	ch := make(chan error, 1)
	tier.Read(s, m, dst, func(err error) { ch <- err })
	return <-ch
}

// writeBlock writes b into slot s from arena memory.
func writeBlock(t testing.TB, tier *disk.Tier, s slots.SlotID, b block) error {
	t.Helper()
	buf := arena(t, layout.AlignUp(b.meta.PayloadLen))
	b.fill(buf)
	return writeSync(tier, s, b.meta, buf)
}

// readBlock reads b from slot s and, when the read succeeds, insists the
// bytes are b's: a success with other bytes fails the test whatever the
// caller expected.
func readBlock(t testing.TB, tier *disk.Tier, s slots.SlotID, b block) error {
	t.Helper()
	dst := arena(t, layout.AlignUp(b.meta.PayloadLen))
	for i := range dst {
		dst[i] = 0x11
	}
	err := readSync(tier, s, b.meta, dst)
	if err == nil && !bytes.Equal(dst[:b.meta.PayloadLen], b.want()) {
		t.Errorf("slot %d: read succeeded with wrong bytes", s)
	}
	if err != nil && !errors.Is(err, disk.ErrIO) && !errors.Is(err, disk.ErrCorrupt) {
		t.Errorf("slot %d: read error %v is neither ErrIO nor ErrCorrupt", s, err)
	}
	return err
}

// recoverSync runs Recover to its end as the offload service would, with
// key naming blocks: the first verified copy of a key is kept, later ones
// are declined. It returns the blocks kept, by slot.
func recoverSync(t testing.TB, tier *disk.Tier, key func(disk.Recovered) (index.Key, bool)) (map[slots.SlotID]disk.Recovered, error) {
	t.Helper()
	var mu sync.Mutex
	got := map[slots.SlotID]disk.Recovered{}
	byKey := map[index.Key]slots.SlotID{}
	err := tier.Recover(disk.Recoverer{
		Key: key,
		File: func(rs []disk.Recovered, keys []index.Key) []disk.Verdict {
			mu.Lock()
			defer mu.Unlock()
			v := make([]disk.Verdict, len(rs))
			for i, r := range rs {
				if _, dup := got[r.Slot]; dup {
					t.Errorf("slot %d recovered twice", r.Slot)
				}
				if _, dup := byKey[keys[i]]; dup {
					v[i] = disk.Decline
					continue
				}
				got[r.Slot], byKey[keys[i]] = r, r.Slot
				v[i] = disk.Keep
			}
			return v
		},
	})
	if err != nil {
		return nil, err
	}
	<-tier.RecoveryDone()
	mu.Lock()
	defer mu.Unlock()
	return got, nil
}

// recovered runs Recover, accepting every block, and returns them by slot.
func recovered(t testing.TB, tier *disk.Tier) map[slots.SlotID]disk.Recovered {
	t.Helper()
	got, err := recoverSync(t, tier, func(r disk.Recovered) (index.Key, bool) { return keyOf(r), true })
	if err != nil {
		t.Fatalf("Recover: %v", err)
	}
	return got
}

func keyOf(r disk.Recovered) index.Key {
	return index.Key{NS: nsID, Group: r.Group, Hash: r.Hash}
}

// metaOf is the Meta a recovered block is read with.
func metaOf(r disk.Recovered) disk.Meta {
	return disk.Meta{NS: r.NS, Group: r.Group, Hash: r.Hash[:r.HashLen], PayloadLen: r.PayloadLen}
}

// slotFile locates slot s: its file and the offset of its header there.
func slotFile(tier *disk.Tier, dirs []string, s slots.SlotID) (string, int64) {
	off := slots.Offset(s)
	i := off / tier.FileBytes()
	return filepath.Join(dirs[i], fmt.Sprintf("kvoffload-%d.slots", i)), int64(off % tier.FileBytes())
}

// patch reads n bytes at off of path, lets fn change them and writes them
// back, as something outside the daemon would.
func patch(t testing.TB, fsys vfs.FS, path string, off int64, n int, fn func([]byte)) {
	t.Helper()
	f, err := fsys.OpenFile(path, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	fn(b)
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func peek(t testing.TB, fsys vfs.FS, path string, off int64, n int) []byte {
	t.Helper()
	var out []byte
	patch(t, fsys, path, off, n, func(b []byte) { out = append(out, b...) })
	return out
}
