package disk

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// Recovery rebuilds the tier's contents from its files in the background
// while the tier serves. Open holds every chunk its chunk maps name
// (slots.Space.Hold), so no Alloc hands out a slot recovery has not looked
// at; Recover starts recoveryReaders readers per file, each taking the
// file's next unscanned chunk, reading it in windows of recoveryWindow
// bytes (large sequential O_DIRECT reads, several in flight per file, the
// hashing of one window overlapping the reads of the others), verifying
// every slot as a Read would (header, then payload checksum) and handing
// the chunk's intact blocks to the owner. A block comes online (its slot
// is in use, Read serves it) only once it is verified, and the chunk's
// other slots become free space only once all of it has been looked at.

const (
	// recoveryWindow is what recovery reads in one call, rounded up to
	// whole slots (and at most a chunk): large enough that a device
	// streams at its sequential rate, small enough that recoveryReaders
	// of them per file cost little memory.
	recoveryWindow = 4 << 20
	// recoveryReaders is how many windows each file has in flight.
	recoveryReaders = 4
)

// Recovered is a block recovery found intact.
type Recovered struct {
	NS      [32]byte // namespace digest
	Group   uint32
	Hash    [32]byte // the key hash, zero past HashLen
	HashLen int
	// Slot holds the block; PayloadLen is its length, and the slot's
	// class is SlotBytes(PayloadLen).
	Slot       slots.SlotID
	PayloadLen uint64
	// Write names the write that put the block there (epoch<<32 | seq,
	// as WriteClock): a write submitted later has a larger one.
	Write uint64
}

// Verdict is what the owner did with a recovered block.
type Verdict uint8

const (
	// Decline: the owner does not want the block (it has the key
	// already, say); its slot becomes free space. Its bytes stay, so an
	// intact copy may come back at a later start: it is the same key's
	// bytes. The zero value: a verdict the owner did not set frees the
	// slot instead of keeping it in use unnamed (a leak).
	Decline Verdict = iota
	// Keep: the owner filed the block in its index and told the class's
	// policy (slots.Class.Learn); the slot stays in use, Read serves it.
	Keep
	// Erase: the block must never come back (the owner invalidated its
	// key while recovery ran): its header is zeroed (Discard) before the
	// slot becomes free space.
	Erase
)

// Recoverer is the owner's side of recovery. Its functions run on
// recovery goroutines, concurrently, with no lock of the tier held.
type Recoverer struct {
	// Key names a block found intact: the owner's index key, or false
	// to leave its slot free (a namespace the owner does not know). It
	// runs before the slot is taken, so it must not index the block.
	Key func(Recovered) (index.Key, bool)
	// File gets the blocks of one chunk that Key named, with their keys.
	// Their slots are taken (in use, no pins) and Read serves them. File
	// files each block in the index or not, and returns a Verdict per
	// block. blocks and keys are reused for the next chunk once File
	// returns: File must not keep them.
	File func(blocks []Recovered, keys []index.Key) []Verdict
	// Done, if set, runs once when recovery ends, finished or stopped,
	// with the final progress.
	Done func(RecoveryStats)
}

// RecoveryState is where recovery is.
type RecoveryState uint8

const (
	// RecoveryNone: Recover has not been called.
	RecoveryNone RecoveryState = iota
	// RecoveryRunning: chunks are being scanned; Lookup offers what has
	// been recovered so far.
	RecoveryRunning
	// RecoveryDone: every chunk was scanned (or there was nothing to
	// scan: a new tier, --disk-reset).
	RecoveryDone
	// RecoveryStopped: Close (or StopRecovery) came first. Chunks not
	// scanned stay held: nothing is written there, so a later start
	// recovers them.
	RecoveryStopped
)

var stateNames = [...]string{"none", "running", "done", "stopped"}

func (s RecoveryState) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return "unknown"
}

// RecoveryStats is recovery's progress.
type RecoveryStats struct {
	State RecoveryState
	// Slots and bytes of the chunks the chunk maps name: what recovery
	// reads. Scanned counts those looked at so far.
	SlotsTotal, SlotsScanned uint64
	BytesTotal, BytesScanned uint64
	// Blocks are the blocks the owner kept: online. Bad slots failed
	// verification (torn, stale, corrupt, unreadable: free space; an
	// empty slot is not bad). Declined and Erased are the owner's other
	// verdicts, Dropped the blocks Key did not name.
	Blocks, Bad, Declined, Erased, Dropped uint64
	// Missed counts the slots recovery could not read (an I/O error:
	// what they hold is not known, and may be intact) and the intact
	// blocks it could not hand to the owner; EraseFailed the erasures
	// (Erase verdicts) that did not reach the file. Either means a copy
	// the owner wanted gone may still be on disk: its invalidation marks
	// must stay for the next recovery.
	Missed, EraseFailed uint64
	// Elapsed is the time since Recover, or the whole recovery once it
	// ended.
	Elapsed time.Duration
}

// recovery is the tier's recovery state.
type recovery struct {
	// Fixed at Open.
	slotsTotal, bytesTotal uint64

	stop     chan struct{}
	stopOnce sync.Once
	done     chan struct{} // closed when recovery ends, or at Close if never started
	doneOnce sync.Once
	wg       sync.WaitGroup
	active   atomic.Int32 // readers still running

	mu struct {
		sync.Mutex
		state RecoveryState
		start time.Time
		took  time.Duration
	}
	slots, bytes, blocks, bad, declined, erased, dropped atomic.Uint64
	missed, eraseFailed                                  atomic.Uint64
}

// fileScan is one file's part of recovery.
type fileScan struct {
	chunks                    []int        // chunk indexes in the file with a map entry
	entries                   []chunkEntry // the map's entry of each, as loaded at Open
	next                      atomic.Int64 // index in chunks of the next chunk to scan
	active                    atomic.Int32 // its readers still running
	start                     time.Time
	slots, bytes, blocks, bad atomic.Uint64
}

// holdMapped takes every chunk a chunk map names out of use until
// recovery has scanned it, and sizes the recovery. Open calls it.
func (t *Tier) holdMapped() error {
	t.rec.stop = make(chan struct{})
	t.rec.done = make(chan struct{})
	var held []uint32
	for _, f := range t.files {
		f.scan = &fileScan{}
		for ci, e := range f.chunks {
			if e.slotBytes == 0 {
				continue
			}
			f.scan.chunks = append(f.scan.chunks, ci)
			f.scan.entries = append(f.scan.entries, e)
			held = append(held, uint32(f.idx*t.fileChunks+ci))
			per := t.chunkBytes / e.slotBytes
			t.rec.slotsTotal += per
			t.rec.bytesTotal += per * e.slotBytes
		}
	}
	return t.Space.Hold(held)
}

// Recover starts rebuilding the tier's contents from its files and
// returns at once; RecoveryDone is closed when it ends. Call it once,
// right after Open (Allocs may come at once: they never get a slot that
// recovery has not looked at). Blocks come online chunk by chunk through
// r.File. Slots that fail verification are free space, counted in the
// progress (Recovery) and in the per-file log line at the end.
func (t *Tier) Recover(r Recoverer) error {
	if r.Key == nil || r.File == nil {
		return errors.New("disk tier: Recover needs Key and File")
	}
	t.rec.mu.Lock()
	if t.rec.mu.state != RecoveryNone {
		t.rec.mu.Unlock()
		return errors.New("disk tier: Recover called twice")
	}
	t.rec.mu.state = RecoveryRunning
	t.rec.mu.start = time.Now()
	t.rec.mu.Unlock()

	// One buffer per reader, outside the Go heap, aligned for O_DIRECT,
	// that holds the largest window of the file.
	type reader struct {
		f        *file
		buf, mem []byte
	}
	var readers []reader
	for _, f := range t.files {
		if len(f.scan.chunks) == 0 {
			continue
		}
		size := uint64(0)
		for _, e := range f.scan.entries {
			size = max(size, t.windowSlots(e)*e.slotBytes)
		}
		f.scan.start = time.Now()
		for range min(recoveryReaders, len(f.scan.chunks)) {
			buf, mem, err := recoveryBuffer(int(size))
			if err != nil {
				for _, rd := range readers {
					vfs.FreeBuffer(rd.mem)
				}
				t.finishRecovery(r, RecoveryStopped)
				return fmt.Errorf("disk tier: recovery buffer: %w", err)
			}
			readers = append(readers, reader{f, buf, mem})
			f.scan.active.Add(1)
		}
	}
	if len(readers) == 0 {
		t.finishRecovery(r, RecoveryDone)
		return nil
	}
	t.log.Info("disk tier recovering in the background; blocks come online as their chunks are verified",
		"chunks", t.Held(), "slots", t.rec.slotsTotal, "bytes", t.rec.bytesTotal, "files", len(t.files),
		"readers_per_file", recoveryReaders, "window_bytes", recoveryWindow)
	t.rec.active.Store(int32(len(readers)))
	for _, rd := range readers {
		t.rec.wg.Add(1)
		go t.recoverFile(rd.f, rd.buf, rd.mem, r)
	}
	return nil
}

// hugePage is the size of a transparent huge page on amd64 and arm64 (4
// KiB base pages).
const hugePage = 2 << 20

// recoveryBuffer maps n bytes for a reader's windows on a huge page
// boundary and asks for transparent huge pages: each O_DIRECT read then
// pins two pages instead of 1,024 per 4 MiB window, and the verification's
// first touch of each slot's header does not miss the TLB (issue 34, item
// 6: with small blocks both showed in recovery's CPU profile). Where the
// kernel gives none (THP off) it works the same, on base pages. mem is
// the mapping, for vfs.FreeBuffer.
func recoveryBuffer(n int) (buf, mem []byte, err error) {
	mem, err = vfs.AlignedBuffer(n + hugePage)
	if err != nil {
		return nil, nil, err
	}
	off := (hugePage - int(uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%hugePage)) % hugePage
	buf = mem[off : off+n : off+n]
	// Advice only: the kernel may decline it.
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE)
	return buf, mem, nil
}

// recoverFile is one reader of f: it scans f's next chunk until none is
// left or recovery stops. The last reader to finish ends the file's part,
// and the last of all ends recovery.
func (t *Tier) recoverFile(f *file, buf, mem []byte, r Recoverer) {
	defer t.rec.wg.Done()
	defer vfs.FreeBuffer(mem)
	stopped := false
	// The blocks a chunk's scan found, reused chunk after chunk: with small
	// blocks (thousands a chunk) growing it anew was a fifth of recovery's
	// CPU (issue 34, item 6).
	var got []Recovered
	var sc adoptScratch
	for !stopped {
		i := int(f.scan.next.Add(1) - 1)
		if i >= len(f.scan.chunks) {
			break
		}
		var ok bool
		got, ok = t.scanChunk(f, f.scan.chunks[i], f.scan.entries[i], buf, got[:0])
		if !ok {
			stopped = true
			break
		}
		t.adoptChunk(f, f.scan.chunks[i], f.scan.entries[i], got, r, &sc)
	}
	if f.scan.active.Add(-1) == 0 && !t.stopping() {
		took := time.Since(f.scan.start)
		t.log.Info("disk tier: file recovered", "file", f.f.Name(), "slots", f.scan.slots.Load(),
			"blocks", f.scan.blocks.Load(), "bad_slots", f.scan.bad.Load(), "bytes", f.scan.bytes.Load(),
			"took", took.Round(time.Millisecond), "MBps", mbps(f.scan.bytes.Load(), took))
	}
	if t.rec.active.Add(-1) == 0 {
		state := RecoveryDone
		if t.stopping() {
			state = RecoveryStopped
		}
		t.finishRecovery(r, state)
	}
}

func mbps(bytes uint64, d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64(float64(bytes) / d.Seconds() / 1e6)
}

func (t *Tier) stopping() bool {
	select {
	case <-t.rec.stop:
		return true
	default:
		return false
	}
}

// finishRecovery records the end of recovery, logs it and tells the owner.
func (t *Tier) finishRecovery(r Recoverer, state RecoveryState) {
	t.rec.mu.Lock()
	t.rec.mu.state = state
	t.rec.mu.took = time.Since(t.rec.mu.start)
	t.rec.mu.Unlock()
	st := t.Recovery()
	msg := "disk tier recovered"
	if state == RecoveryStopped {
		msg = "disk tier recovery stopped; what it had not scanned stays on disk for the next start"
	}
	t.log.Info(msg, "blocks", st.Blocks, "bad_slots", st.Bad, "declined", st.Declined, "erased", st.Erased,
		"dropped_unknown", st.Dropped, "slots_scanned", st.SlotsScanned, "slots", st.SlotsTotal,
		"bytes", st.BytesScanned, "took", st.Elapsed.Round(time.Millisecond), "MBps", mbps(st.BytesScanned, st.Elapsed))
	if r.Done != nil {
		r.Done(st)
	}
	t.rec.doneOnce.Do(func() { close(t.rec.done) })
}

// RecoveryDone is closed when recovery has ended: finished, stopped, or
// (after Close) never started.
func (t *Tier) RecoveryDone() <-chan struct{} { return t.rec.done }

// StopRecovery asks recovery to stop after the reads in flight, and
// returns at once; Close waits for it. Chunks it did not finish stay held
// (nothing is written there: the next start recovers them).
func (t *Tier) StopRecovery() {
	t.rec.stopOnce.Do(func() { close(t.rec.stop) })
}

// Recovery reports recovery's progress.
func (t *Tier) Recovery() RecoveryStats {
	t.rec.mu.Lock()
	st := RecoveryStats{State: t.rec.mu.state, Elapsed: t.rec.mu.took}
	if st.State == RecoveryRunning {
		st.Elapsed = time.Since(t.rec.mu.start)
	}
	t.rec.mu.Unlock()
	st.SlotsTotal, st.BytesTotal = t.rec.slotsTotal, t.rec.bytesTotal
	st.SlotsScanned, st.BytesScanned = t.rec.slots.Load(), t.rec.bytes.Load()
	st.Blocks, st.Bad = t.rec.blocks.Load(), t.rec.bad.Load()
	st.Declined, st.Erased, st.Dropped = t.rec.declined.Load(), t.rec.erased.Load(), t.rec.dropped.Load()
	st.Missed, st.EraseFailed = t.rec.missed.Load(), t.rec.eraseFailed.Load()
	return st
}

// windowSlots is how many slots of a chunk like e one recovery read
// takes: whole slots, at least recoveryWindow bytes, at most the chunk.
func (t *Tier) windowSlots(e chunkEntry) uint64 {
	return min((recoveryWindow+e.slotBytes-1)/e.slotBytes, t.chunkBytes/e.slotBytes)
}

// scanChunk reads chunk ci of f (slots of e.slotBytes) window by window
// into buf, verifies every slot and appends the blocks found to out.
// false: recovery stopped first.
func (t *Tier) scanChunk(f *file, ci int, e chunkEntry, buf []byte, out []Recovered) ([]Recovered, bool) {
	sb := e.slotBytes
	per := t.chunkBytes / sb
	win := t.windowSlots(e)
	for k0 := uint64(0); k0 < per; k0 += win {
		if t.stopping() {
			return nil, false
		}
		n := min(win, per-k0)
		off := uint64(ci)*t.chunkBytes + k0*sb
		data := buf[:n*sb]
		got, err := f.f.ReadAt(data, int64(off))
		for j := uint64(0); j < n; j++ {
			s := slots.SlotID((f.base + off + j*sb) / layout.SlotAlign)
			img := data[j*sb : (j+1)*sb]
			if got != len(data) {
				// The window failed: read its slots one by one, so a
				// bad spot costs its own slot only.
				if m, err := f.f.ReadAt(img, int64(off+j*sb)); m != len(img) {
					t.rec.missed.Add(1)
					t.slotBad(f, s, fmt.Errorf("%w: slot read: %d of %d bytes: %w", ErrIO, m, len(img), err))
					continue
				}
			}
			c, why := t.verifySlot(img, s, e)
			switch {
			case why == nil:
				out = append(out, c)
			case errors.Is(why, slot.ErrEmpty):
			default:
				if errors.Is(why, slot.ErrHeaderChecksum) || errors.Is(why, slot.ErrPayloadChecksum) {
					t.m.checksum.Inc()
				}
				t.slotBad(f, s, why)
			}
		}
		if got != len(data) {
			t.log.Debug("disk tier: recovery window unreadable; its slots were read one by one", "file", f.f.Name(), "offset", off, "err", err)
		}
		t.rec.slots.Add(n)
		t.rec.bytes.Add(n * sb)
		f.scan.slots.Add(n)
		f.scan.bytes.Add(n * sb)
		t.m.recoveryBytes.Add(float64(n * sb))
	}
	return out, true
}

func (t *Tier) slotBad(f *file, s slots.SlotID, why error) {
	t.rec.bad.Add(1)
	f.scan.bad.Add(1)
	t.log.Debug("disk tier: slot not recovered", "file", f.f.Name(), "slot", s, "why", why)
}

// verifySlot checks the image of slot s (header block and payload), in a
// chunk of e.slotBytes slots, and says why it is not a recoverable block
// (slot.ErrEmpty: never written). It checks what a Read checks, except
// that the write recorded for the slot is the header's own.
func (t *Tier) verifySlot(img []byte, s slots.SlotID, e chunkEntry) (Recovered, error) {
	h, err := slot.Decode(img[:slot.HeaderSize])
	if err != nil {
		return Recovered{}, err
	}
	switch {
	case h.Slot != uint64(s):
		return Recovered{}, fmt.Errorf("%w: written for slot %d", slot.ErrMisplaced, h.Slot)
	case SlotBytes(h.PayloadLen) != e.slotBytes:
		return Recovered{}, fmt.Errorf("%w: a %d-byte payload in a chunk of %d-byte slots", slot.ErrLength, h.PayloadLen, e.slotBytes)
	case h.Epoch < e.minEpoch:
		return Recovered{}, fmt.Errorf("%w: written in epoch %d, before the chunk took this slot size in epoch %d", slot.ErrStale, h.Epoch, e.minEpoch)
	case h.Seq == 0 || h.Seq > maxSeq:
		return Recovered{}, fmt.Errorf("%w: sequence number %d out of range", slot.ErrMalformed, h.Seq)
	}
	if err := slot.VerifyPayload(h, img[slot.HeaderSize:slot.HeaderSize+h.PayloadLen]); err != nil {
		return Recovered{}, err
	}
	return Recovered{NS: h.Namespace, Group: h.Group, Hash: h.Hash, HashLen: int(h.HashLen), Slot: s, PayloadLen: h.PayloadLen, Write: uint64(h.Epoch)<<32 | h.Seq}, nil
}

// adoptScratch is adoptChunk's per-chunk slices, kept by a reader from one
// chunk to the next.
type adoptScratch struct {
	keys   []index.Key
	writes []uint64
	used   []slots.SlotID
}

// adoptChunk gives chunk ci of f back to service: to the class of its
// intact blocks, which come online through r.File, or to the free chunks
// when nothing there is kept. found is the scan's, and adoptChunk keeps in
// place the blocks r.Key names.
func (t *Tier) adoptChunk(f *file, ci int, e chunkEntry, found []Recovered, r Recoverer, sc *adoptScratch) {
	ch := uint32(f.idx*t.fileChunks + ci)
	// Reused from chunk to chunk (r.File does not keep them): with
	// thousands of small blocks a chunk, growing them anew costs.
	keys, writes, used := sc.keys[:0], sc.writes[:0], sc.used[:0]
	defer func() { sc.keys, sc.writes, sc.used = keys, writes, used }()
	recs := found[:0]
	for i := range found {
		k, ok := r.Key(found[i])
		if !ok {
			t.rec.dropped.Add(1)
			continue
		}
		if len(recs) < i {
			found[len(recs)] = found[i]
		}
		recs = recs[:len(recs)+1]
		keys, writes, used = append(keys, k), append(writes, found[i].Write), append(used, found[i].Slot)
	}
	unhold := func(why error) {
		if why != nil {
			t.rec.missed.Add(uint64(len(recs)))
			t.log.Error("disk tier: recovery could not take back a chunk's blocks; they are free space", "file", f.f.Name(), "chunk", ci, "err", why)
		}
		if err := t.Space.Unhold(ch); err != nil {
			t.log.Error("disk tier: recovery could not free a chunk", "file", f.f.Name(), "chunk", ci, "err", err)
		}
	}
	if len(recs) == 0 {
		unhold(nil)
		return
	}
	cls, err := t.Class(e.slotBytes)
	if err != nil {
		unhold(err)
		return
	}
	// The adopted slots keep the class alive; the owner's namespaces hold
	// their own references.
	defer cls.Drop()
	if err := cls.Adopt(ch, used); err != nil {
		unhold(err)
		return
	}
	// Readable from here: the owner may index them as soon as File runs.
	t.seqs.setMany(used, e.slotBytes, writes)
	verdicts := r.File(recs, keys)
	kept := 0
	var erasing sync.WaitGroup
	for i, s := range used {
		v := Decline
		if i < len(verdicts) {
			v = verdicts[i]
		}
		switch v {
		case Keep:
			kept++
		case Decline:
			t.seqs.clearAny(s)
			t.Release(s)
			t.rec.declined.Add(1)
		case Erase:
			// Held by a pin until its header is zeros, so no write of
			// another block lands there first.
			t.seqs.clearAny(s)
			t.Pin(s)
			t.Release(s)
			erasing.Add(1)
			t.submit(&request{op: opDiscard, s: s, done: func(err error) {
				if err != nil {
					t.rec.eraseFailed.Add(1)
				}
				t.Unpin(s)
				erasing.Done()
			}})
			t.rec.erased.Add(1)
		}
	}
	// The chunk is done once its erasures are on disk (they are rare:
	// keys invalidated while recovery ran).
	erasing.Wait()
	t.rec.blocks.Add(uint64(kept))
	f.scan.blocks.Add(uint64(kept))
	t.m.recovered.Add(float64(kept))
}
