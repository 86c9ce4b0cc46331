package cpu

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// recCfg is an arena of two chunks of 64 testSlot slots each.
var recCfg = Config{Bytes: 8 << 20, ChunkBytes: 4 << 20}

// stored is a block a test wrote into the arena.
type stored struct {
	key  index.Key
	slot SlotID
	fill byte
}

// storeBlock takes a slot, fills it and writes its record naming
// namespace digest ns (its first byte) and hash.
func storeBlock(t *testing.T, tr *Tier, ns byte, hash string, fill byte) stored {
	t.Helper()
	c, err := tr.Class(testSlot)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Drop()
	k := index.Key{NS: uint32(ns), Group: 1}
	copy(k.Hash[:], hash)
	c.Admit([]index.Key{k})
	s, ok := c.Alloc()
	if !ok {
		t.Fatal("no slot")
	}
	p := tr.Slot(s, testSlot)
	for i := range p {
		p[i] = fill + byte(i)
	}
	b := Block{Group: 1, Hash: []byte(hash), PayloadLen: testSlot, PayloadSum: Checksum(p)}
	b.Namespace[0] = ns
	if err := tr.WriteRecord(s, b); err != nil {
		t.Fatal(err)
	}
	tr.Unpin(s)
	return stored{key: k, slot: s, fill: fill}
}

// recoverArena opens the arena file in dir and starts its recovery for a
// recOwner, hook called before each chunk (nil: none).
func recoverArena(t *testing.T, dir string, hook func()) (*Tier, *recOwner) {
	t.Helper()
	tr, err := NewPersistent(recCfg, dir)
	if err != nil {
		t.Fatal(err)
	}
	o := newRecOwner(tr)
	if err := tr.Recover(o.recoverer(hook)); err != nil {
		t.Fatal(err)
	}
	return tr, o
}

// recOwner plays the offload service's part: it names a record's
// namespace by its digest's first byte (0: unknown), files every block
// Settle lets through and releases the others.
type recOwner struct {
	t       *Tier
	mu      sync.Mutex
	filed   map[index.Key]SlotID
	refused map[index.Key]bool
	stats   RecoveryStats
}

func newRecOwner(tr *Tier) *recOwner {
	return &recOwner{t: tr, filed: map[index.Key]SlotID{}, refused: map[index.Key]bool{}}
}

func (o *recOwner) recoverer(hook func()) Recoverer {
	return Recoverer{
		Key: func(f Found) (index.Key, bool) {
			if f.Namespace[0] == 0 {
				return index.Key{}, false
			}
			k := index.Key{NS: uint32(f.Namespace[0]), Group: f.Group}
			copy(k.Hash[:], f.Key())
			return k, true
		},
		File: func(bs []Recovered) int {
			o.mu.Lock() // stands for the keys' index locks
			defer o.mu.Unlock()
			n := 0
			for _, b := range bs {
				if o.t.Settle(&b.Key) {
					o.t.Release(b.Slot)
					o.refused[b.Key] = true
					continue
				}
				o.filed[b.Key] = b.Slot
				n++
			}
			return n
		},
		Done: func(st RecoveryStats) { o.stats = st },
		Hook: hook,
	}
}

// fileRecord reads slot s's record from the arena file through its own
// descriptor: what the next start finds, whatever becomes of the process
// (the file is in tmpfs: its pages are the file).
func fileRecord(t *testing.T, dir string, s SlotID) []byte {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, ArenaFileName))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sb := make([]byte, superBytes)
	if _, err := f.ReadAt(sb, 0); err != nil {
		t.Fatal(err)
	}
	r := make([]byte, RecordBytes)
	if _, err := f.ReadAt(r, int64(binary.LittleEndian.Uint64(sb[sbRecordsOff:])+uint64(s)*RecordBytes)); err != nil {
		t.Fatal(err)
	}
	return r
}

func hasRecord(t *testing.T, dir string, s SlotID) bool {
	return !bytes.Equal(fileRecord(t, dir, s), zeroRecord[:])
}

// TestRecoverFilesVerifiedBlocks: a re-attached arena's blocks come back
// to the owner verified; a record of a namespace the owner does not know,
// one whose payload changed, and the older of two records of one key are
// dropped, their records cleared.
func TestRecoverFilesVerifiedBlocks(t *testing.T) {
	dir := arenaDir(t)
	tr, err := NewPersistent(recCfg, dir)
	if err != nil {
		t.Fatal(err)
	}
	var want []stored
	for i := range 100 { // 64 in chunk 0, 36 in chunk 1
		want = append(want, storeBlock(t, tr, 7, fmt.Sprintf("block-%d", i), byte(i)))
	}
	unknown := storeBlock(t, tr, 0, "unknown-ns", 1)
	changed := storeBlock(t, tr, 7, "changed", 2)
	old := storeBlock(t, tr, 7, "twice", 3)
	newer := storeBlock(t, tr, 7, "twice", 4)
	want = append(want, newer)
	tr.Slot(changed.slot, 1)[0] ^= 0xff
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}

	tr, o := recoverArena(t, dir, nil)
	defer tr.Close()
	<-tr.RecoveryDone()
	if st := tr.Recovery(); st.State != RecoveryDone || st.Blocks != uint64(len(want)) || st.Dropped != 2 || o.stats != st {
		t.Fatalf("recovery %+v (Done told %+v), want done with %d blocks, 2 dropped", st, o.stats, len(want))
	}
	if len(o.filed) != len(want) {
		t.Fatalf("%d blocks filed, want %d", len(o.filed), len(want))
	}
	for _, b := range want {
		if s, ok := o.filed[b.key]; !ok || s != b.slot {
			t.Fatalf("block %q filed in slot %d (%v), stored in %d", b.key.Hash[:8], s, ok, b.slot)
		}
		if got := tr.Slot(b.slot, 1)[0]; got != b.fill {
			t.Fatalf("slot %d holds %d, want %d", b.slot, got, b.fill)
		}
	}
	for _, s := range []SlotID{unknown.slot, changed.slot, old.slot} {
		if hasRecord(t, dir, s) {
			t.Fatalf("the record of dropped slot %d is still in the file", s)
		}
	}
	if err := tr.Recover(o.recoverer(nil)); err == nil {
		t.Fatal("a second Recover was accepted")
	}
}

// TestInvalidatingDuringRecoveryIsDurable: an Invalidate while recovery
// has not filed the blocks it names (keys, and a whole namespace) clears
// their records in the arena file before Invalidating returns; recovery
// does not file them; and a start after a stop mid-recovery does not
// bring them back, while every other block comes back.
func TestInvalidatingDuringRecoveryIsDurable(t *testing.T) {
	dir := arenaDir(t)
	tr, err := NewPersistent(recCfg, dir)
	if err != nil {
		t.Fatal(err)
	}
	// Chunk 0: namespace 7's first 64 blocks; chunk 1: its last 20 and
	// namespace 8's 20.
	var a, b []stored
	for i := range 84 {
		a = append(a, storeBlock(t, tr, 7, fmt.Sprintf("a-%d", i), byte(i)))
	}
	for i := range 20 {
		b = append(b, storeBlock(t, tr, 8, fmt.Sprintf("b-%d", i), byte(i)))
	}
	if ch, _ := tr.ChunkOf(a[0].slot); ch != 0 {
		t.Fatalf("the first block is in chunk %d", ch)
	}
	for _, s := range b {
		if ch, _ := tr.ChunkOf(s.slot); ch != 1 {
			t.Fatalf("a block of namespace 8 is in chunk %d, want 1", ch)
		}
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}

	// Run 2: recovery held before its first chunk.
	entered, gate := make(chan struct{}, 2), make(chan struct{})
	tr, o := recoverArena(t, dir, func() { entered <- struct{}{}; <-gate })
	<-entered // the scan is done, chunk 0 waits
	// Keys in both chunks: 3 of chunk 0, 3 of chunk 1.
	gone := map[index.Key]bool{}
	var keys []index.Key
	for _, i := range []int{1, 30, 63, 64, 70, 83} {
		keys = append(keys, a[i].key)
		gone[a[i].key] = true
	}
	tr.Invalidating([]uint32{7}, keys)
	tr.Invalidating([]uint32{8}, nil)
	for _, s := range append(a, b...) {
		switch has := hasRecord(t, dir, s.slot); {
		case (gone[s.key] || s.key.NS == 8) && has:
			t.Fatalf("block %q of namespace %d, invalidated, still has its record in the file after Invalidating returned", s.key.Hash[:8], s.key.NS)
		case !gone[s.key] && s.key.NS == 7 && !has:
			t.Fatalf("block %q lost its record", s.key.Hash[:8])
		}
	}
	// A stop while chunk 0 is being verified: chunk 1 is never reached.
	tr.StopRecovery()
	close(gate)
	<-tr.RecoveryDone()
	if st := tr.Recovery(); st.State != RecoveryStopped || st.Blocks != 61 {
		t.Fatalf("recovery %+v, want stopped with chunk 0's 61 blocks filed", st)
	}
	for _, i := range []int{1, 30, 63} {
		if _, ok := o.filed[a[i].key]; ok || !o.refused[a[i].key] {
			t.Fatalf("block %d, invalidated, was filed", i)
		}
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}

	// Run 3: the rest comes back, nothing invalidated does.
	tr, o = recoverArena(t, dir, nil)
	defer tr.Close()
	<-tr.RecoveryDone()
	want := map[index.Key]SlotID{}
	for _, s := range a {
		if !gone[s.key] {
			want[s.key] = s.slot
		}
	}
	if !maps.Equal(o.filed, want) {
		t.Fatalf("run 3 filed %d blocks, want namespace 7's %d not invalidated", len(o.filed), len(want))
	}
	if st := tr.Recovery(); st.State != RecoveryDone || st.Dropped != 0 {
		t.Fatalf("run 3: recovery %+v", st)
	}
}

// TestNamespaceCatalog: the catalog holds the owner's namespaces and no
// more: one added after a drop rewrites it without the dropped ones, and
// CompactNamespaces rewrites it only after a drop.
func TestNamespaceCatalog(t *testing.T) {
	dir := arenaDir(t)
	tr, err := NewPersistent(recCfg, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	d := func(b byte) [32]byte { return [32]byte{b} }
	meta := func(b byte) []byte { return []byte{'m', b} }
	set := func(bs ...byte) map[[32]byte][]byte {
		m := map[[32]byte][]byte{}
		for _, b := range bs {
			m[d(b)] = meta(b)
		}
		return m
	}
	owner := set(1, 2)
	all := func() map[[32]byte][]byte { return maps.Clone(owner) }
	onFile := func(want map[[32]byte][]byte) {
		t.Helper()
		got, _, err := tr.persist.loadCatalog()
		if err != nil {
			t.Fatal(err)
		}
		if !maps.EqualFunc(got, want, bytes.Equal) || !maps.EqualFunc(tr.Namespaces(), want, bytes.Equal) {
			t.Fatalf("catalog %v on file, %v in memory, want %v", firsts(got), firsts(tr.Namespaces()), firsts(want))
		}
	}
	if err := tr.SaveNamespaces(all); err != nil {
		t.Fatal(err)
	}
	onFile(set(1, 2))
	owner = set(1, 2, 3)
	if err := tr.AddNamespace(d(3), meta(3), all); err != nil {
		t.Fatal(err)
	}
	onFile(set(1, 2, 3))
	if err := tr.CompactNamespaces(func() map[[32]byte][]byte { panic("compacted with nothing dropped") }); err != nil {
		t.Fatal(err)
	}
	owner = set(1, 3)
	tr.DroppedNamespace()
	owner = set(1, 3, 4)
	if err := tr.AddNamespace(d(4), meta(4), all); err != nil {
		t.Fatal(err)
	}
	onFile(set(1, 3, 4))
	owner = set(4)
	tr.DroppedNamespace()
	if err := tr.CompactNamespaces(all); err != nil {
		t.Fatal(err)
	}
	onFile(set(4))
}

// firsts are the first bytes of a catalog's digests, sorted.
func firsts(m map[[32]byte][]byte) []byte {
	var out []byte
	for d := range m {
		out = append(out, d[0])
	}
	slices.Sort(out)
	return out
}
