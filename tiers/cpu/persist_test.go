package cpu

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
)

// arenaDir is a fresh 0700 directory on tmpfs.
func arenaDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "kvo-cpu-arena-")
	if err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func logTo(b *bytes.Buffer) *slog.Logger { return slog.New(slog.NewTextHandler(b, nil)) }

const testSlot = 64 << 10

// storeOne takes a slot, fills it with fill and writes its record
// (namespace digest 7: storeBlock).
func storeOne(t *testing.T, tr *Tier, fill byte, hash string) SlotID {
	t.Helper()
	return storeBlock(t, tr, 7, hash, fill).slot
}

func scanAll(tr *Tier) (found []Found, bad int) {
	for ch := uint32(0); uint64(ch) < tr.Capacity()/tr.ChunkBytes(); ch++ {
		f, b := tr.scanRecords(ch)
		found, bad = append(found, f...), bad+b
	}
	return found, bad
}

// TestPersistentArenaReattaches: the records and payloads of one run are
// there, verified, for the next; a released slot's record is gone; a
// payload byte changed from outside fails verification.
func TestPersistentArenaReattaches(t *testing.T) {
	dir := arenaDir(t)
	cfg := Config{Bytes: 8 << 20, ChunkBytes: 4 << 20}
	tr, err := NewPersistent(cfg, dir)
	if err != nil {
		t.Fatal(err)
	}
	if tr.Attached() {
		t.Fatal("a new arena file reports blocks to recover")
	}
	a := storeOne(t, tr, 1, "block-a")
	b := storeOne(t, tr, 2, "block-b")
	gone := storeOne(t, tr, 3, "block-gone")
	tr.Release(gone)
	if _, err := tr.RecordOf(gone); err == nil {
		t.Fatal("a released slot keeps its record")
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}

	tr, err = NewPersistent(cfg, dir)
	if err != nil {
		t.Fatal(err)
	}
	if !tr.Attached() {
		t.Fatal("the arena file of the same geometry was not re-attached")
	}
	found, bad := scanAll(tr)
	if bad != 0 || len(found) != 2 {
		t.Fatalf("found %d records (%d bad), want the 2 kept", len(found), bad)
	}
	for _, f := range found {
		if f.Slot != a && f.Slot != b {
			t.Fatalf("record of slot %d, stored %d and %d", f.Slot, a, b)
		}
		if err := tr.verifyRecord(f); err != nil {
			t.Fatalf("slot %d: %v", f.Slot, err)
		}
		if f.Epoch != 1 || f.Group != 1 || f.Namespace[0] != 7 {
			t.Fatalf("record %+v", f.Header)
		}
	}
	tr.Slot(a, 1)[0] ^= 0xff // as a stray write from outside would
	for _, f := range found {
		err := tr.verifyRecord(f)
		if f.Slot == a && err == nil {
			t.Fatal("a changed payload verified")
		}
		if f.Slot == b && err != nil {
			t.Fatal(err)
		}
	}
	tr.Close()
}

// TestPersistentArenaRefusesOtherFiles: an arena file of another size, a
// damaged superblock or another version is discarded with a log line,
// never used; a second daemon on the directory, a directory others can
// read, or one on a disk filesystem is refused.
func TestPersistentArenaRefusesOtherFiles(t *testing.T) {
	dir := arenaDir(t)
	cfg := Config{Bytes: 8 << 20, ChunkBytes: 4 << 20}
	tr, err := NewPersistent(cfg, dir)
	if err != nil {
		t.Fatal(err)
	}
	storeOne(t, tr, 1, "block-a")
	if _, err := NewPersistent(cfg, dir); err == nil || !strings.Contains(err.Error(), "in use by another kvoffloadd") {
		t.Fatalf("a second arena on a locked directory: %v", err)
	}
	tr.Close()

	reopen := func(cfg Config) (*Tier, string) {
		t.Helper()
		var logs bytes.Buffer
		cfg.Logger = logTo(&logs)
		tr, err := NewPersistent(cfg, dir)
		if err != nil {
			t.Fatal(err)
		}
		found, _ := scanAll(tr)
		attached := tr.Attached()
		tr.Close() // its populate logs too
		if attached || len(found) != 0 {
			t.Fatalf("attached %v with %d records, want the file discarded", attached, len(found))
		}
		return tr, logs.String()
	}
	_, logs := reopen(Config{Bytes: 12 << 20, ChunkBytes: 4 << 20})
	if !strings.Contains(logs, "discarded") || !strings.Contains(logs, "this daemon is configured for 12582912 bytes") {
		t.Fatalf("another size: log %q", logs)
	}

	// Back at 8 MiB (a new file), one block, then damage the superblock.
	tr, _ = NewPersistent(cfg, dir)
	storeOne(t, tr, 1, "block-a")
	tr.Close()
	path := filepath.Join(dir, ArenaFileName)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte{0x5a}, sbArenaBytes+1)
	f.Close()
	if _, logs = reopen(cfg); !strings.Contains(logs, "superblock checksum mismatch") {
		t.Fatalf("damaged superblock: log %q", logs)
	}

	// Another version, checksum right.
	tr, _ = NewPersistent(cfg, dir)
	storeOne(t, tr, 1, "block-a")
	tr.Close()
	f, _ = os.OpenFile(path, os.O_RDWR, 0)
	buf := make([]byte, superBytes)
	f.ReadAt(buf, 0)
	sb, err := decodeSuper(buf)
	if err != nil {
		t.Fatal(err)
	}
	sb.version = 2
	encodeSuper(sb, buf)
	f.WriteAt(buf, 0)
	f.Close()
	if _, logs = reopen(cfg); !strings.Contains(logs, "format version 2, this build reads 1") {
		t.Fatalf("another version: log %q", logs)
	}

	os.Chmod(dir, 0o755)
	if _, err := NewPersistent(cfg, dir); err == nil || !strings.Contains(err.Error(), "want 0700") {
		t.Fatalf("a directory others can read: %v", err)
	}
	os.Chmod(dir, 0o700)
	disk := t.TempDir()
	if err := os.Chmod(disk, 0o700); err != nil {
		t.Fatal(err)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(disk, &fs); err != nil {
		t.Fatal(err)
	}
	if fs.Type == tmpfsMagic || fs.Type == hugetlbfsMagic {
		t.Logf("%s is on tmpfs here: the refusal of a disk filesystem is not checked", disk)
	} else if _, err := NewPersistent(cfg, disk); err == nil || !strings.Contains(err.Error(), "not on tmpfs") {
		t.Fatalf("an arena directory on a disk filesystem: %v", err)
	}
}

// TestRecordTornNeverDecodes: a record cut short at any byte (a kill -9
// while it was written over zeros) is not a record.
func TestRecordTornNeverDecodes(t *testing.T) {
	dir := arenaDir(t)
	tr, err := NewPersistent(Config{Bytes: 4 << 20, ChunkBytes: 4 << 20}, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	s := storeOne(t, tr, 1, "block-a")
	full := bytes.Clone(tr.persist.record(s))
	for n := 1; n < RecordBytes; n++ {
		if bytes.Equal(full[n:], zeroRecord[n:]) {
			continue // the rest is zeros anyway: the record is whole
		}
		var buf [slot.HeaderSize]byte
		copy(buf[:n], full[:n])
		if _, err := slot.Decode(buf[:]); err == nil {
			t.Fatalf("a record torn after %d bytes decodes", n)
		}
	}
}
