package disk

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// Meta names the block a request writes or expects.
type Meta struct {
	// NS is the namespace digest (the catalog's key).
	NS    [32]byte
	Group uint32
	// Hash is the block hash, 1 to 32 bytes.
	Hash       []byte
	PayloadLen uint64
	// PayloadSum is slot.Checksum of the payload when the caller already
	// has it (the CPU tier records it when a block becomes ready), so a
	// Write does not hash the block again; 0 makes Write compute it. Read
	// ignores it.
	PayloadSum uint64
}

type opKind uint8

const (
	opWrite opKind = iota
	opRead
	opDiscard
)

// request is one queued Write, Read or Discard.
type request struct {
	op      opKind
	s       slots.SlotID
	ns      [32]byte
	group   uint32
	hashLen uint8
	hash    [slot.MaxHashLen]byte
	payLen  uint64
	paySum  uint64
	epoch   uint32 // a write's name, given by Write
	seq     uint64
	buf     []byte
	done    func(error)
	err     error // refused before it was queued
}

// Write writes payload (layout.AlignUp(m.PayloadLen) bytes, 4096-aligned
// arena memory when the tier is direct) into slot s, a slot of a chunk of
// SlotBytes(m.PayloadLen), then calls done from an I/O worker. The payload
// goes first and the header after it, so a crash between the two leaves a
// slot that fails verification. The caller keeps payload unchanged and s
// pinned until done.
//
// The write is named (its epoch and sequence number, WriteClock) when it is
// submitted, not when a worker runs it: a write submitted after the owner
// read WriteClock has a larger name than every write submitted before.
func (t *Tier) Write(s slots.SlotID, m Meta, payload []byte, done func(error)) {
	r := t.newRequest(opWrite, s, m, payload, done)
	if r.err == nil {
		r.epoch, r.seq = t.nextWrite()
	}
	t.submit(r)
}

// WriteClock names the last write submitted, as epoch<<32 | seq: every
// write submitted later has a larger name, so a header written before a
// call has a smaller one (Recovered.Write) than the value it returns.
func (t *Tier) WriteClock() uint64 {
	t.writes.Lock()
	defer t.writes.Unlock()
	return uint64(t.writes.epoch)<<32 | t.writes.seq
}

// Read reads slot s into dst (layout.AlignUp(m.PayloadLen) bytes) and
// verifies it: the header's magic, version, checksum, key (= m), slot,
// payload length, and write (the one this tier last completed in s), then
// the payload's checksum. done gets nil, or an error wrapping ErrIO (the
// device failed: quarantine s) or ErrCorrupt (s does not hold the block:
// free s); after an error dst holds unspecified bytes.
func (t *Tier) Read(s slots.SlotID, m Meta, dst []byte, done func(error)) {
	t.submit(t.newRequest(opRead, s, m, dst, done))
}

// Discard overwrites the header of slot s with zeros, so the block it
// held never comes back at a restart, and forgets the slot's write so a
// Read of it fails. It is asynchronous and best effort: a failure is
// logged and counted, never reported. done (if not nil) runs once the
// header is written or the attempt failed: the owner holds a pin on s until
// then, so the zeros never land on a slot reused for another block.
func (t *Tier) Discard(s slots.SlotID, done func()) {
	t.submit(&request{op: opDiscard, s: s, done: func(error) {
		if done != nil {
			done()
		}
	}})
}

func (t *Tier) newRequest(op opKind, s slots.SlotID, m Meta, buf []byte, done func(error)) *request {
	r := &request{op: op, s: s, ns: m.NS, group: m.Group, payLen: m.PayloadLen, paySum: m.PayloadSum, buf: buf, done: done}
	switch {
	case len(m.Hash) == 0 || len(m.Hash) > slot.MaxHashLen:
		r.err = fmt.Errorf("%w: key hash of %d bytes, want 1 to %d", ErrInvalid, len(m.Hash), slot.MaxHashLen)
	case m.PayloadLen > slot.MaxPayloadLen:
		r.err = fmt.Errorf("%w: payload of %d bytes", ErrInvalid, m.PayloadLen)
	case uint64(len(buf)) != layout.AlignUp(m.PayloadLen):
		r.err = fmt.Errorf("%w: buffer of %d bytes for a %d-byte payload, want %d", ErrInvalid, len(buf), m.PayloadLen, layout.AlignUp(m.PayloadLen))
	}
	r.hashLen = uint8(copy(r.hash[:], m.Hash))
	return r
}

// submit queues r on its slot's file; a request that names no file goes
// to the first, whose worker reports its error.
func (t *Tier) submit(r *request) {
	fi := slots.Offset(r.s) / t.fileBytes
	if fi >= uint64(len(t.files)) {
		if r.err == nil {
			r.err = fmt.Errorf("%w: slot %d is beyond the tier", ErrInvalid, r.s)
		}
		fi = 0
	}
	if !t.files[fi].q.push(r) {
		r.done(fmt.Errorf("%w: slot %d", ErrClosed, r.s))
	}
}

// worker serves f's queue with its own header block buffer until the
// queue is closed and drained.
func (t *Tier) worker(f *file, hdr []byte) {
	defer t.workers.Done()
	for {
		r, ok := f.q.pop()
		if !ok {
			return
		}
		var err error
		switch {
		case r.err != nil:
			err = r.err
		case r.op == opWrite:
			err = t.write(f, hdr, r)
		case r.op == opRead:
			err = t.read(f, hdr, r)
		case r.op == opDiscard:
			err = t.discard(f, hdr, r.s)
		}
		r.done(err)
	}
}

// where locates slot s for a request of payload payLen: the slot size of
// its chunk, the chunk's index in f and the file offset of the slot.
func (t *Tier) where(f *file, s slots.SlotID, payLen uint64) (slotBytes uint64, chunk int, off int64, err error) {
	_, sb := t.ChunkOf(s)
	if want := SlotBytes(payLen); sb != want {
		return 0, 0, 0, fmt.Errorf("%w: slot %d lies in a chunk of %d-byte slots, a %d-byte payload needs %d", ErrInvalid, s, sb, payLen, want)
	}
	if _, _, ok := t.seqs.ordinal(s, sb); !ok {
		return 0, 0, 0, fmt.Errorf("%w: slot %d is not the start of a %d-byte slot", ErrInvalid, s, sb)
	}
	local := slots.Offset(s) - f.base
	return sb, int(local / t.chunkBytes), int64(local), nil
}

func (t *Tier) write(f *file, hdr []byte, r *request) error {
	sb, chunk, off, err := t.where(f, r.s, r.payLen)
	if err != nil {
		return err
	}
	if err := t.ensureMapped(f, chunk, sb); err != nil {
		t.m.errIO.Inc()
		return fmt.Errorf("%w: slot %d: chunk map of %s: %w", ErrIO, r.s, f.dir, err)
	}
	// From here until the header is down, the slot holds no good block.
	t.seqs.set(r.s, sb, 0)
	sum := r.paySum
	if sum == 0 {
		sum = slot.Checksum(r.buf[:r.payLen])
	}
	epoch, seq := r.epoch, r.seq
	h := slot.Header{Namespace: r.ns, Group: r.group, HashLen: r.hashLen, Hash: r.hash,
		PayloadLen: r.payLen, PayloadSum: sum, Epoch: epoch, Seq: seq, Slot: uint64(r.s)}
	if err := slot.Encode(h, hdr); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}

	start := time.Now()
	t.m.writeBlocks.Inc()
	n, err := f.f.WriteAt(r.buf, off+slot.HeaderSize)
	if err == nil && n == len(r.buf) {
		t.m.writeBytes.Add(float64(n))
		n, err = f.f.WriteAt(hdr, off)
		if err == nil && n == len(hdr) {
			t.m.writeBytes.Add(float64(n))
			t.m.writeSeconds.Observe(time.Since(start).Seconds())
			t.seqs.set(r.s, sb, uint64(epoch)<<32|seq)
			return nil
		}
	}
	t.m.errIO.Inc()
	if err == nil {
		err = io.ErrShortWrite
	}
	return fmt.Errorf("%w: %w: write slot %d of %s at %d: %w", ErrIO, errSlotDevice, r.s, f.f.Name(), off, err)
}

// nextWrite names a new write.
func (t *Tier) nextWrite() (epoch uint32, seq uint64) {
	t.writes.Lock()
	defer t.writes.Unlock()
	if t.writes.seq == maxSeq {
		// The epoch's sequence numbers are spent (after 2^32 writes):
		// moving on keeps (epoch, seq) increasing. Epochs start from the
		// clock, so this one stays below the next start's.
		t.writes.epoch++
		t.writes.seq = 0
	}
	t.writes.seq++
	return t.writes.epoch, t.writes.seq
}

// ensureMapped persists, before the first write into chunk of f since
// the chunk took slotBytes slots, that it did, so Recover scans it at the
// right stride.
func (t *Tier) ensureMapped(f *file, chunk int, slotBytes uint64) error {
	f.mapMu.Lock()
	defer f.mapMu.Unlock()
	old := f.chunks[chunk]
	if old.slotBytes == slotBytes {
		return nil
	}
	t.writes.Lock()
	f.chunks[chunk] = chunkEntry{slotBytes: slotBytes, minEpoch: t.writes.epoch}
	t.writes.Unlock()
	if err := t.saveMap(f); err != nil {
		f.chunks[chunk] = old
		return err
	}
	return nil
}

func (t *Tier) read(f *file, hdr []byte, r *request) (err error) {
	sb, _, off, err := t.where(f, r.s, r.payLen)
	if err != nil {
		return err
	}
	start := time.Now()
	t.m.readBlocks.Inc()
	short := false
	defer func() {
		if err != nil {
			t.m.readFailed(err, short)
		} else {
			t.m.readSeconds.Observe(time.Since(start).Seconds())
		}
	}()
	w := t.seqs.get(r.s, sb)
	if w == 0 {
		return fmt.Errorf("%w: slot %d holds no completed write", ErrCorrupt, r.s)
	}
	// Header and payload lie back to back: one I/O reads both where the
	// file can (a preadv; about a tenth faster than two reads on the
	// machine issue 11 measured on). Elsewhere (the in-memory FS, a fault
	// injector) the header is read and checked before the payload.
	vec, oneIO := f.f.(vfs.ReaderVAt)
	var n int
	if oneIO {
		n, err = vec.ReadvAt([][]byte{hdr, r.buf}, off)
	} else {
		n, err = f.f.ReadAt(hdr, off)
	}
	t.m.readBytes.Add(float64(n))
	if n < len(hdr) {
		short = err == nil || errors.Is(err, io.EOF)
		return readError(f, r.s, off, n, len(hdr), err)
	}
	h, err := slot.Decode(hdr)
	if err != nil {
		if errors.Is(err, slot.ErrHeaderChecksum) {
			t.m.checksum.Inc()
		}
		return fmt.Errorf("%w: slot %d: %w", ErrCorrupt, r.s, err)
	}
	switch {
	case !h.Matches(r.ns, r.group, r.hash[:r.hashLen]):
		return fmt.Errorf("%w: %w: slot %d holds group %d key %x", ErrCorrupt, slot.ErrKeyMismatch, r.s, h.Group, h.Key())
	case h.Slot != uint64(r.s):
		return fmt.Errorf("%w: %w: read from slot %d, written for slot %d", ErrCorrupt, slot.ErrMisplaced, r.s, h.Slot)
	case uint64(h.Epoch)<<32|h.Seq != w || h.Seq > maxSeq:
		return fmt.Errorf("%w: %w: slot %d holds write %d.%d, want %d.%d", ErrCorrupt, slot.ErrStale, r.s, h.Epoch, h.Seq, w>>32, w&maxSeq)
	case h.PayloadLen != r.payLen:
		return fmt.Errorf("%w: %w: slot %d holds %d payload bytes, want %d", ErrCorrupt, slot.ErrLength, r.s, h.PayloadLen, r.payLen)
	}
	n -= len(hdr)
	if !oneIO {
		n, err = f.f.ReadAt(r.buf, off+slot.HeaderSize)
		t.m.readBytes.Add(float64(n))
	}
	if n != len(r.buf) {
		short = err == nil || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
		return readError(f, r.s, off+slot.HeaderSize, n, len(r.buf), err)
	}
	if err := slot.VerifyPayload(h, r.buf[:r.payLen]); err != nil {
		t.m.checksum.Inc()
		return fmt.Errorf("%w: slot %d: %w", ErrCorrupt, r.s, err)
	}
	return nil
}

func readError(f *file, s slots.SlotID, off int64, n, want int, err error) error {
	if err == nil {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("%w: %w: read slot %d of %s at %d: %d of %d bytes: %w", ErrIO, errSlotDevice, s, f.f.Name(), off, n, want, err)
}

func (t *Tier) discard(f *file, hdr []byte, s slots.SlotID) error {
	t.seqs.clearAny(s)
	local := slots.Offset(s) - f.base
	clear(hdr)
	if n, err := f.f.WriteAt(hdr, int64(local)); err != nil || n != len(hdr) {
		t.m.errIO.Inc()
		t.log.Warn("disk tier: discarding a slot failed; its block may come back at the next start",
			"slot", s, "file", f.f.Name(), "err", err)
		return fmt.Errorf("%w: discard of slot %d: %d of %d bytes: %w", ErrIO, s, n, len(hdr), err)
	}
	return nil
}
