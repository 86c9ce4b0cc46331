package disk_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

func TestOpenRefuses(t *testing.T) {
	ok := disk.Config{Dirs: []string{"/d"}, BytesPerDir: 4 * chunk, ChunkBytes: chunk, FS: vfs.NewMem(), Logger: quiet()}
	cases := []struct {
		name string
		edit func(*disk.Config)
		want string
	}{
		{"no dirs", func(c *disk.Config) { c.Dirs = nil }, "no directory"},
		{"dir twice", func(c *disk.Config) { c.Dirs = []string{"/d", "/d/"} }, "twice"},
		{"chunk misaligned", func(c *disk.Config) { c.ChunkBytes = chunk + 512 }, "multiple of 4096"},
		{"chunk below one slot", func(c *disk.Config) { c.ChunkBytes = 4096 }, "at least 8192"},
		{"file below one chunk", func(c *disk.Config) { c.BytesPerDir = chunk - 1 }, "holds no"},
		{"queue depth", func(c *disk.Config) { c.QueueDepth = -1 }, "queue depth"},
		{"reserve", func(c *disk.Config) { c.Reserve = 1 }, "reserve"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := ok
			c.edit(&cfg)
			tier, err := disk.Open(cfg)
			if err == nil {
				tier.Close()
				t.Fatal("Open succeeded")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("Open: %v; want it to say %q", err, c.want)
			}
		})
	}
}

func TestRoundTrip(t *testing.T) {
	sizes := []uint64{1, 4096, 5000, 300 << 10, chunk - slot.HeaderSize}
	for _, be := range backends(t) {
		for _, hashLen := range []int{16, 32} {
			t.Run(fmt.Sprintf("fs=%s/hash=%d", be.name, hashLen), func(t *testing.T) {
				tier := open(t, be.config(1, 8*chunk))
				for i, size := range sizes {
					b := newBlock(i, size, hashLen)
					s := alloc(t, tier, size, []block{b})[0]
					if err := writeBlock(t, tier, s, b); err != nil {
						t.Fatalf("write %d bytes: %v", size, err)
					}
					tier.Unpin(s)
					for range 2 {
						if err := readBlock(t, tier, s, b); err != nil {
							t.Fatalf("read %d bytes: %v", size, err)
						}
					}
				}
			})
		}
	}
}

// Reads that name anything but what the slot holds fail, with the reason.
func TestReadRejects(t *testing.T) {
	be := backends(t)[1]
	tier := open(t, be.config(1, 4*chunk))
	const size = 5000 // AlignUp: 8192, so 6000 shares the slot size
	b := newBlock(1, size, 32)
	ss := alloc(t, tier, size, []block{b, newBlock(2, size, 32)})
	if err := writeBlock(t, tier, ss[0], b); err != nil {
		t.Fatal(err)
	}
	other := alloc(t, tier, 20000, []block{newBlock(3, 20000, 32)})[0]
	mod := func(f func(*disk.Meta)) disk.Meta {
		m := b.meta
		m.Hash = slices.Clone(m.Hash)
		f(&m)
		return m
	}
	cases := []struct {
		name string
		s    slots.SlotID
		m    disk.Meta
		dst  uint64
		want []error
	}{
		{"namespace", ss[0], mod(func(m *disk.Meta) { m.NS[0]++ }), size, []error{disk.ErrCorrupt, slot.ErrKeyMismatch}},
		{"group", ss[0], mod(func(m *disk.Meta) { m.Group++ }), size, []error{disk.ErrCorrupt, slot.ErrKeyMismatch}},
		{"hash", ss[0], mod(func(m *disk.Meta) { m.Hash[3]++ }), size, []error{disk.ErrCorrupt, slot.ErrKeyMismatch}},
		{"hash length", ss[0], mod(func(m *disk.Meta) { m.Hash = m.Hash[:16] }), size, []error{disk.ErrCorrupt, slot.ErrKeyMismatch}},
		{"payload length", ss[0], mod(func(m *disk.Meta) { m.PayloadLen = 6000 }), 6000, []error{disk.ErrCorrupt, slot.ErrLength}},
		{"never written", ss[1], b.meta, size, []error{disk.ErrCorrupt}},
		{"buffer length", ss[0], b.meta, 4096, []error{disk.ErrInvalid}},
		{"slot of another size", other, b.meta, size, []error{disk.ErrInvalid}},
		{"slot beyond the tier", slots.SlotID(tier.Capacity() / 4096), b.meta, size, []error{disk.ErrInvalid}},
		{"not a slot start", ss[0] + 1, b.meta, size, []error{disk.ErrInvalid}},
		{"empty hash", ss[0], mod(func(m *disk.Meta) { m.Hash = nil }), size, []error{disk.ErrInvalid}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dst := arena(t, layout.AlignUp(c.dst))
			err := readSync(tier, c.s, c.m, dst)
			for _, w := range c.want {
				if !errors.Is(err, w) {
					t.Errorf("Read = %v; want %v", err, w)
				}
			}
		})
	}
	// None of that disturbed the block.
	if err := readBlock(t, tier, ss[0], b); err != nil {
		t.Fatal(err)
	}
}

// What was written and not discarded is what comes back, in the slots it
// was written to, byte for byte; an older copy of a key does not.
func TestRecoverAfterReopen(t *testing.T) {
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			cfg := be.config(2, 6*chunk)
			tier := open(t, cfg)
			want := map[slots.SlotID]block{}
			either := map[slots.SlotID]slots.SlotID{} // a slot in want, and the other copy of its key
			var blocks []block
			for i := range 24 {
				size := []uint64{3000, 100 << 10}[i%2]
				blocks = append(blocks, newBlock(i, size, 16+16*(i%2)))
			}
			for _, size := range []uint64{3000, 100 << 10} {
				var bs []block
				for _, b := range blocks {
					if b.meta.PayloadLen == size {
						bs = append(bs, b)
					}
				}
				ss := alloc(t, tier, size, bs)
				for i, s := range ss {
					if err := writeBlock(t, tier, s, bs[i]); err != nil {
						t.Fatal(err)
					}
					tier.Unpin(s)
					want[s] = bs[i]
				}
				// Discarded blocks never come back.
				for _, s := range ss[:2] {
					tier.Discard(s, nil)
					tier.Release(s)
					delete(want, s)
				}
				// A key written again elsewhere comes back from one
				// copy only, though the other is intact: the first one
				// recovery files. Its readers run in parallel, so that
				// may be either (both hold the key's bytes; a copy an
				// Invalidate covers is erased by the owner's marks).
				moved := alloc(t, tier, size, bs[2:3])[0]
				if err := writeBlock(t, tier, moved, bs[2]); err != nil {
					t.Fatal(err)
				}
				tier.Unpin(moved)
				delete(want, ss[2])
				tier.Release(ss[2])
				want[moved] = bs[2]
				either[moved] = ss[2]
			}
			if err := tier.Close(); err != nil {
				t.Fatal(err)
			}

			tier = open(t, cfg)
			got := recovered(t, tier)
			for s, other := range either {
				if _, ok := got[s]; !ok {
					if _, ok := got[other]; ok {
						want[other] = want[s]
						delete(want, s)
					}
				}
			}
			if len(got) != len(want) {
				t.Errorf("recovered %d blocks, want %d", len(got), len(want))
			}
			for s, b := range want {
				r, ok := got[s]
				if !ok {
					t.Errorf("slot %d not recovered", s)
					continue
				}
				if keyOf(r) != b.key || r.PayloadLen != b.meta.PayloadLen || r.NS != testNS {
					t.Errorf("slot %d recovered as %+v, want %+v", s, r, b.meta)
				}
				if err := readBlock(t, tier, s, b); err != nil {
					t.Errorf("slot %d: %v", s, err)
				}
			}
			var usedWant uint64
			for _, b := range want {
				usedWant += disk.SlotBytes(b.meta.PayloadLen)
			}
			if used, n := tier.Usage(); n != uint64(len(want)) || used != usedWant || tier.Pinned() != 0 {
				t.Errorf("Usage = %d bytes, %d blocks, %d pinned; want %d, %d, 0", used, n, tier.Pinned(), usedWant, len(want))
			}
			// New slots never land on recovered ones.
			fresh := alloc(t, tier, 3000, []block{newBlock(100, 3000, 32), newBlock(101, 3000, 32)})
			for _, s := range fresh {
				if _, ok := want[s]; ok {
					t.Errorf("Alloc returned slot %d, which holds a recovered block", s)
				}
				tier.Release(s)
				tier.Unpin(s)
			}
			again := disk.Recoverer{Key: func(disk.Recovered) (index.Key, bool) { return index.Key{}, true },
				File: func(rs []disk.Recovered, _ []index.Key) []disk.Verdict { return make([]disk.Verdict, len(rs)) }}
			if err := tier.Recover(again); err == nil {
				t.Error("a second Recover succeeded")
			}
		})
	}
}

// The owner may decline a recovered block; its slot stays free.
func TestRecoverDeclined(t *testing.T) {
	be := backends(t)[1]
	cfg := be.config(1, 4*chunk)
	tier := open(t, cfg)
	bs := []block{newBlock(1, 9000, 32), newBlock(2, 9000, 32)}
	for i, s := range alloc(t, tier, 9000, bs) {
		if err := writeBlock(t, tier, s, bs[i]); err != nil {
			t.Fatal(err)
		}
	}
	tier.Close()
	tier = open(t, cfg)
	var kept slots.SlotID
	_, err := recoverSync(t, tier, func(r disk.Recovered) (index.Key, bool) {
		if keyOf(r) == bs[0].key {
			kept = r.Slot
			return keyOf(r), true
		}
		return index.Key{}, false
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, n := tier.Usage(); n != 1 {
		t.Errorf("%d blocks in use after declining one of two", n)
	}
	if err := readBlock(t, tier, kept, bs[0]); err != nil {
		t.Error(err)
	}
}

// A write that did not complete (payload without header, header without
// payload) and an older write of the same slot are never served, and a
// slot holding a mix never comes back after a restart.
func TestTornAndStale(t *testing.T) {
	const size = 40000
	cases := []struct {
		name string
		// mutate gets the slot's image before (old) and after (new) the
		// second write and returns what to put on disk.
		mutate func(old, cur []byte) []byte
		// sameKey writes the same key twice: the image left is then a
		// complete older write of it, which may come back, as itself.
		sameKey  bool
		wantRead error
	}{
		{"payload new, header not written", func(old, cur []byte) []byte {
			return append(slices.Clone(old[:slot.HeaderSize]), cur[slot.HeaderSize:]...)
		}, false, slot.ErrKeyMismatch},
		{"header new, payload old", func(old, cur []byte) []byte {
			return append(slices.Clone(cur[:slot.HeaderSize]), old[slot.HeaderSize:]...)
		}, false, slot.ErrPayloadChecksum},
		{"header new, payload half written", func(old, cur []byte) []byte {
			half := slot.HeaderSize + 5*4096
			return append(slices.Clone(cur[:half]), old[half:]...)
		}, false, slot.ErrPayloadChecksum},
		{"stale: older write of the same key", func(old, cur []byte) []byte { return old }, true, slot.ErrStale},
	}
	for _, be := range backends(t) {
		for _, c := range cases {
			t.Run("fs="+be.name+"/"+c.name, func(t *testing.T) {
				cfg := be.config(1, 4*chunk)
				tier := open(t, cfg)
				first, second := newBlock(1, size, 32), newBlock(2, size, 32)
				if c.sameKey {
					second = first
				}
				s := alloc(t, tier, size, []block{first})[0]
				if err := writeBlock(t, tier, s, first); err != nil {
					t.Fatal(err)
				}
				path, off := slotFile(tier, cfg.Dirs, s)
				n := int(disk.SlotBytes(size))
				old := peek(t, be.fs, path, off, n)
				if err := writeBlock(t, tier, s, second); err != nil {
					t.Fatal(err)
				}
				cur := peek(t, be.fs, path, off, n)
				patch(t, be.fs, path, off, n, func(b []byte) { copy(b, c.mutate(old, cur)) })

				err := readBlock(t, tier, s, second)
				if !errors.Is(err, disk.ErrCorrupt) || !errors.Is(err, c.wantRead) {
					t.Errorf("Read = %v; want ErrCorrupt and %v", err, c.wantRead)
				}
				tier.Close()

				tier = open(t, cfg)
				got := recovered(t, tier)
				r, ok := got[s]
				switch {
				case ok && !c.sameKey:
					t.Errorf("slot %d came back as group %d key %x", s, r.Group, r.Hash[:r.HashLen])
				case ok:
					// A complete older write is that key's bytes; it may
					// come back, and must read as exactly them.
					if err := readBlock(t, tier, s, first); err != nil {
						t.Error(err)
					}
				}
				if len(got) > 1 {
					t.Errorf("recovered %d blocks from one slot", len(got))
				}
			})
		}
	}
}

// A write that landed in another slot than the one it was meant for is
// refused there, and never comes back as that slot's block.
func TestMisdirectedWrite(t *testing.T) {
	const size = 12000
	be := backends(t)[1]
	cfg := be.config(1, 4*chunk)
	tier := open(t, cfg)
	bs := []block{newBlock(1, size, 32), newBlock(2, size, 32)}
	ss := alloc(t, tier, size, bs)
	for i, s := range ss {
		if err := writeBlock(t, tier, s, bs[i]); err != nil {
			t.Fatal(err)
		}
	}
	n := int(disk.SlotBytes(size))
	pathA, offA := slotFile(tier, cfg.Dirs, ss[0])
	pathB, offB := slotFile(tier, cfg.Dirs, ss[1])
	imageA := peek(t, be.fs, pathA, offA, n)
	patch(t, be.fs, pathB, offB, n, func(b []byte) { copy(b, imageA) })
	patch(t, be.fs, pathA, offA, slot.HeaderSize, func(b []byte) { clear(b) })

	if err := readBlock(t, tier, ss[1], bs[1]); !errors.Is(err, disk.ErrCorrupt) {
		t.Errorf("Read of the slot written over: %v; want ErrCorrupt", err)
	}
	if err := readBlock(t, tier, ss[0], bs[0]); !errors.Is(err, disk.ErrCorrupt) || !errors.Is(err, slot.ErrEmpty) {
		t.Errorf("Read of the slot missed: %v; want ErrCorrupt, ErrEmpty", err)
	}
	tier.Close()
	tier = open(t, cfg)
	if got := recovered(t, tier); len(got) != 0 {
		t.Errorf("recovered %v; want nothing", got)
	}
}

// Bytes changed in the file behind the tier's back make the read fail as
// corrupt, and the block does not come back; the slot padding after the
// payload is not the block's.
func TestExternalCorruption(t *testing.T) {
	const size = 50000 // 13 pages, the last one partly padding
	cases := []struct {
		name string
		at   int64 // offset in the slot
		want error // nil: the read still succeeds
	}{
		{"magic", 0, slot.ErrBadMagic},
		{"header checksum field", 12, slot.ErrHeaderChecksum},
		{"sequence number", 16, slot.ErrHeaderChecksum},
		{"namespace", 64, slot.ErrHeaderChecksum},
		{"key hash", 100, slot.ErrHeaderChecksum},
		{"header padding", 4000, slot.ErrHeaderChecksum},
		{"first payload byte", slot.HeaderSize, slot.ErrPayloadChecksum},
		{"middle payload byte", slot.HeaderSize + size/2, slot.ErrPayloadChecksum},
		{"last payload byte", slot.HeaderSize + size - 1, slot.ErrPayloadChecksum},
		{"slot padding", slot.HeaderSize + size, nil},
	}
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			cfg := be.config(1, 4*chunk)
			tier := open(t, cfg)
			bs := make([]block, len(cases))
			for i := range bs {
				bs[i] = newBlock(i, size, 32)
			}
			ss := alloc(t, tier, size, bs)
			for i, s := range ss {
				if err := writeBlock(t, tier, s, bs[i]); err != nil {
					t.Fatal(err)
				}
				tier.Unpin(s)
				path, off := slotFile(tier, cfg.Dirs, s)
				patch(t, be.fs, path, off+cases[i].at, 1, func(b []byte) { b[0] ^= 0x40 })
			}
			for i, c := range cases {
				err := readBlock(t, tier, ss[i], bs[i])
				if c.want == nil {
					if err != nil {
						t.Errorf("%s: Read = %v; want success", c.name, err)
					}
					continue
				}
				if !errors.Is(err, disk.ErrCorrupt) || !errors.Is(err, c.want) {
					t.Errorf("%s: Read = %v; want ErrCorrupt and %v", c.name, err, c.want)
				}
			}
			tier.Close()
			tier = open(t, cfg)
			got := recovered(t, tier)
			for i, c := range cases {
				if _, ok := got[ss[i]]; ok != (c.want == nil) {
					t.Errorf("%s: recovered = %v, want %v", c.name, ok, c.want == nil)
				}
			}
		})
	}
}

func TestReset(t *testing.T) {
	for _, be := range backends(t) {
		t.Run("fs="+be.name, func(t *testing.T) {
			cfg := be.config(2, 4*chunk)
			tier := open(t, cfg)
			if err := tier.SaveNamespace(testNS, []byte("fingerprint+layout")); err != nil {
				t.Fatal(err)
			}
			bs := []block{newBlock(1, 7000, 32), newBlock(2, 7000, 32), newBlock(3, 7000, 32)}
			for i, s := range alloc(t, tier, 7000, bs) {
				if err := writeBlock(t, tier, s, bs[i]); err != nil {
					t.Fatal(err)
				}
			}
			tier.Close()

			reset := cfg
			reset.Reset = true
			tier = open(t, reset)
			if ns := tier.Namespaces(); len(ns) != 0 {
				t.Errorf("after Reset: %d namespaces", len(ns))
			}
			if got := recovered(t, tier); len(got) != 0 {
				t.Errorf("after Reset: recovered %d blocks", len(got))
			}
			if used, n := tier.Usage(); used != 0 || n != 0 {
				t.Errorf("after Reset: usage %d bytes, %d blocks", used, n)
			}
			// The same slots, at the same size, are written again: only
			// what this incarnation wrote may come back.
			fresh := newBlock(9, 7000, 32)
			s := alloc(t, tier, 7000, []block{fresh})[0]
			if err := writeBlock(t, tier, s, fresh); err != nil {
				t.Fatal(err)
			}
			tier.Close()

			tier = open(t, cfg)
			got := recovered(t, tier)
			if len(got) != 1 || keyOf(got[s]) != fresh.key {
				t.Errorf("after Reset and a restart: recovered %v; want only slot %d", got, s)
			}
			if ns := tier.Namespaces(); len(ns) != 0 {
				t.Errorf("after Reset and a restart: %d namespaces", len(ns))
			}
		})
	}
}

// Chunks spread over the directories; each file holds the slots of its
// part of the space, and all of them come back.
func TestStripe(t *testing.T) {
	be := backends(t)[0]
	cfg := be.config(3, 2*chunk)
	tier := open(t, cfg)
	if tier.Capacity() != 6*chunk || tier.FileBytes() != 2*chunk {
		t.Fatalf("Capacity %d, FileBytes %d", tier.Capacity(), tier.FileBytes())
	}
	const size = 120 << 10
	perChunk := chunk / disk.SlotBytes(size)
	var bs []block
	for i := range 6 * perChunk {
		bs = append(bs, newBlock(int(i), size, 32))
	}
	ss := alloc(t, tier, size, bs)
	files := map[string]int{}
	for i, s := range ss {
		if err := writeBlock(t, tier, s, bs[i]); err != nil {
			t.Fatal(err)
		}
		tier.Unpin(s)
		path, off := slotFile(tier, cfg.Dirs, s)
		h, err := slot.Decode(peek(t, be.fs, path, off, slot.HeaderSize))
		if err != nil || h.Slot != uint64(s) {
			t.Fatalf("slot %d: header in %s at %d: %+v, %v", s, path, off, h, err)
		}
		files[path]++
	}
	for i := range cfg.Dirs {
		path, _ := slotFile(tier, cfg.Dirs, slots.SlotID(uint64(i)*tier.FileBytes()/4096))
		if files[path] != int(2*perChunk) {
			t.Errorf("%s holds %d blocks, want %d", path, files[path], 2*perChunk)
		}
	}
	tier.Close()
	tier = open(t, cfg)
	if got := recovered(t, tier); len(got) != len(ss) {
		t.Errorf("recovered %d of %d blocks", len(got), len(ss))
	}
}

func TestNamespaces(t *testing.T) {
	be := backends(t)[1]
	cfg := be.config(2, 2*chunk)
	var logs logRecorder
	cfg.Logger = logs.logger(0)
	tier := open(t, cfg)
	a, b := [32]byte{1}, [32]byte{2}
	for _, ns := range []struct {
		d    [32]byte
		meta string
	}{{a, "first"}, {b, "second"}, {a, "replaced"}} {
		if err := tier.SaveNamespace(ns.d, []byte(ns.meta)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tier.SaveNamespace([32]byte{3}, make([]byte, disk.MaxNamespaceMeta+1)); !errors.Is(err, disk.ErrInvalid) {
		t.Errorf("oversized meta: %v", err)
	}
	tier.Close()

	want := map[[32]byte]string{a: "replaced", b: "second"}
	check := func(what string, want map[[32]byte]string) {
		t.Helper()
		tier = open(t, cfg)
		got := tier.Namespaces()
		if len(got) != len(want) {
			t.Errorf("%s: %d namespaces, want %d", what, len(got), len(want))
		}
		for d, m := range want {
			if string(got[d]) != m {
				t.Errorf("%s: namespace %x = %q, want %q", what, d[:1], got[d], m)
			}
		}
		tier.Close()
	}
	check("reopen", want)
	// One damaged catalog: the other directory's copy serves.
	patch(t, be.fs, "/disk/nvme0/kvoffload-0.namespaces", 20, 1, func(b []byte) { b[0]++ })
	check("one catalog damaged", want)
	if !slices.ContainsFunc(logs.lines(), func(l string) bool { return strings.HasPrefix(l, "ERROR") && strings.Contains(l, "catalog") }) {
		t.Error("a damaged catalog was not logged as an error")
	}
	patch(t, be.fs, "/disk/nvme1/kvoffload-1.namespaces", 20, 1, func(b []byte) { b[0]++ })
	check("both damaged", nil)
}

// A damaged chunk map, or one for another configuration, makes its file
// start empty, loudly: recovery must not guess slot boundaries.
func TestChunkMapUnreadable(t *testing.T) {
	cases := []struct {
		name string
		edit func(t *testing.T, fsys vfs.FS, cfg *disk.Config)
	}{
		{"damaged", func(t *testing.T, fsys vfs.FS, cfg *disk.Config) {
			patch(t, fsys, "/disk/nvme0/kvoffload-0.chunks", 45, 1, func(b []byte) { b[0] ^= 1 })
		}},
		{"cut short", func(t *testing.T, fsys vfs.FS, cfg *disk.Config) {
			f, _ := fsys.OpenFile("/disk/nvme0/kvoffload-0.chunks.new", 0, false)
			f.WriteAt([]byte("KVOFCMAP"), 0)
			f.Close()
			if err := fsys.Rename("/disk/nvme0/kvoffload-0.chunks.new", "/disk/nvme0/kvoffload-0.chunks"); err != nil {
				t.Fatal(err)
			}
		}},
		{"other chunk size", func(t *testing.T, fsys vfs.FS, cfg *disk.Config) {
			cfg.ChunkBytes = chunk / 2
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			be := backends(t)[1]
			cfg := be.config(1, 4*chunk)
			tier := open(t, cfg)
			b := newBlock(1, 10000, 32)
			if err := writeBlock(t, tier, alloc(t, tier, 10000, []block{b})[0], b); err != nil {
				t.Fatal(err)
			}
			tier.Close()
			c.edit(t, be.fs, &cfg)
			var logs logRecorder
			cfg.Logger = logs.logger(0)
			tier = open(t, cfg)
			if got := recovered(t, tier); len(got) != 0 {
				t.Errorf("recovered %d blocks from a file whose chunk map is unreadable", len(got))
			}
			if !slices.ContainsFunc(logs.lines(), func(l string) bool { return strings.HasPrefix(l, "ERROR") && strings.Contains(l, "chunk map") }) {
				t.Errorf("not logged as an error: %q", logs.lines())
			}
		})
	}
}

// Close finishes what was queued; later requests fail at once.
func TestClose(t *testing.T) {
	be := backends(t)[1]
	cfg := be.config(2, 4*chunk)
	cfg.QueueDepth = 2
	tier, err := disk.Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	const size = 30000
	var bs []block
	for i := range 40 {
		bs = append(bs, newBlock(i, size, 32))
	}
	ss := alloc(t, tier, size, bs)
	done := make([]error, len(ss))
	called := make([]bool, len(ss))
	buf := arena(t, layout.AlignUp(size))
	for i, s := range ss {
		bs[i].fill(buf)
		tier.Write(s, bs[i].meta, buf, func(err error) { done[i], called[i] = err, true })
	}
	if err := tier.Close(); err != nil {
		t.Fatal(err)
	}
	for i := range ss {
		if !called[i] {
			t.Errorf("write %d: done not called before Close returned", i)
		}
	}
	if err := tier.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	var syncErr error
	tier.Read(ss[0], bs[0].meta, buf, func(err error) { syncErr = err })
	if !errors.Is(syncErr, disk.ErrClosed) {
		t.Errorf("Read after Close: %v", syncErr)
	}
	syncErr = nil
	tier.Write(ss[0], bs[0].meta, buf, func(err error) { syncErr = err })
	if !errors.Is(syncErr, disk.ErrClosed) {
		t.Errorf("Write after Close: %v", syncErr)
	}
	tier.Discard(ss[0], nil)
}

func TestMetrics(t *testing.T) {
	be := backends(t)[1]
	reg := prometheus.NewPedanticRegistry()
	// The CPU tier's gauges share names with the disk tier's.
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_tier_capacity_bytes", Help: "Bytes a tier can hold.",
		ConstLabels: prometheus.Labels{"tier": "cpu"}}, func() float64 { return 1 }))
	cfg := be.config(1, 4*chunk)
	cfg.Registerer = reg
	tier := open(t, cfg)
	const size = 10000
	bs := []block{newBlock(1, size, 32), newBlock(2, size, 32)}
	ss := alloc(t, tier, size, bs)
	for i, s := range ss {
		if err := writeBlock(t, tier, s, bs[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := readBlock(t, tier, ss[0], bs[0]); err != nil {
		t.Fatal(err)
	}
	path, off := slotFile(tier, cfg.Dirs, ss[1])
	patch(t, be.fs, path, off+slot.HeaderSize, 1, func(b []byte) { b[0]++ })
	if err := readBlock(t, tier, ss[1], bs[1]); !errors.Is(err, disk.ErrCorrupt) {
		t.Fatalf("Read of a damaged slot: %v", err)
	}
	tier.Quarantine(ss[1])

	slotBytes := float64(disk.SlotBytes(size))
	want := map[string]float64{
		`kvoffload_disk_blocks_total{op="write"}`:     2,
		`kvoffload_disk_blocks_total{op="read"}`:      2,
		`kvoffload_disk_bytes_total{op="write"}`:      2 * slotBytes,
		`kvoffload_disk_bytes_total{op="read"}`:       2 * slotBytes,
		`kvoffload_disk_errors_total{kind="corrupt"}`: 1,
		`kvoffload_disk_errors_total{kind="io"}`:      0,
		`kvoffload_disk_errors_total{kind="short"}`:   0,
		`kvoffload_disk_checksum_failures_total{}`:    1,
		`kvoffload_disk_quarantined_slots{}`:          1,
		`kvoffload_disk_recovered_blocks_total{}`:     0,
		`kvoffload_disk_io_seconds{op="write"}`:       2, // sample count
		`kvoffload_disk_io_seconds{op="read"}`:        1,
		`kvoffload_tier_capacity_bytes{tier="disk"}`:  4 * chunk,
		`kvoffload_tier_capacity_bytes{tier="cpu"}`:   1,
		`kvoffload_tier_used_bytes{tier="disk"}`:      2 * slotBytes,
		`kvoffload_tier_blocks{tier="disk"}`:          2,
	}
	got := gather(t, reg)
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", k, g, ok, v)
		}
	}
	// Close unregisters, so the tier can be opened again on the registry.
	tier.Close()
	tier = open(t, cfg)
	tier.Close()
}

func gather(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			name := mf.GetName() + "{" + strings.Join(labels, ",") + "}"
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				out[name] = m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				out[name] = m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				out[name] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}
