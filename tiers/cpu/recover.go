package cpu

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// Recovery of a persistent arena (persist.go). After a restart on the
// same arena file the daemon serves at once, every chunk held, and
// Recover brings the blocks back in the background, like the disk tier's
// recovery (tiers/disk/recover.go):
//
//  1. It reads every record (not the payloads): chunks with none go back
//     to the free chunks at once, so stores find room; for a key named by
//     more than one record the newest wins.
//  2. Chunk by chunk it verifies each block's payload against its
//     record's xxh3, gives the chunk to the class of its slot size
//     (Adopt) and hands the verified blocks to the owner (Recoverer.File),
//     who files them in its index. Nothing reaches the index, and so no
//     Lookup offers it, before its payload has verified.
//
// A block stored again before recovery reaches its old copy keeps the new
// copy (the owner declines the old one, whose slot is released); one
// invalidated since the start has its record cleared before the
// Invalidate answers and is released instead of filed (the ledger,
// ledger.go); one invalidated before the restart has no record (its slot
// was released, which cleared it), so it cannot come back.

// RecoveryState is where the arena's recovery is; the values are those
// kvoffload_cpu_recovery_state reports.
type RecoveryState int32

const (
	// RecoveryNone: no persistent arena, or nothing to recover.
	RecoveryNone RecoveryState = iota
	RecoveryRunning
	RecoveryDone
	// RecoveryStopped: the daemon stopped (StopRecovery) before it was
	// done. What was not filed keeps its records, for the next start.
	RecoveryStopped
)

// RecoveryStats is the arena's recovery's progress.
type RecoveryStats struct {
	State RecoveryState
	// Blocks the owner filed; Dropped the records recovery dropped:
	// damaged or torn, stale, of an unknown namespace (Recoverer.Key),
	// misplaced, or whose payload failed its checksum.
	Blocks, Dropped uint64
	// Took is the whole recovery, once it ended.
	Took time.Duration
}

// Recovered is a block whose record recovery found.
type Recovered struct {
	Found
	// Key is the owner's index key for the block (Recoverer.Key).
	Key index.Key
}

// Recoverer is the owner's side of the arena's recovery. Its functions run
// on recovery goroutines, concurrently, with no lock of the tier held.
type Recoverer struct {
	// Key names the block of a record that decoded: the owner's index
	// key, or false (a namespace the owner does not know, a shape that
	// does not fit it): the record is cleared. It runs during the scan,
	// before anything is filed.
	Key func(Found) (index.Key, bool)
	// File gets the verified blocks of one chunk, their payloads
	// checked; their slots are in use (adopted, no pins). For each
	// block, under its key's index lock, File calls Tier.Settle and
	// files the block unless Settle reports it invalidated or the owner
	// has the key already; the slot of a block it does not file it
	// Releases, still under the key's lock (so its record is gone before
	// any later Invalidate of the key answers). It returns how many it
	// filed.
	File func(blocks []Recovered) int
	// Done, if set, runs once when recovery ends, done or stopped, with
	// the final stats.
	Done func(RecoveryStats)
	// Hook, if set (tests), runs before each chunk is verified.
	Hook func()
}

// recovery is the state of the arena's recovery.
type recovery struct {
	done     chan struct{} // closed when recovery ends (at once with nothing to recover)
	stop     chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup
	state    atomic.Int32
	blocks   atomic.Uint64
	bad      atomic.Uint64
	took     atomic.Int64 // nanoseconds, once ended

	ledger // the records not filed yet (ledger.go)
}

func (r *recovery) init(recover bool) {
	r.done, r.stop = make(chan struct{}), make(chan struct{})
	if !recover {
		close(r.done)
	}
}

// Recover starts bringing back the blocks of a re-attached arena
// (Attached) and returns at once; RecoveryDone is closed when it ends.
// Call it once, before anything can take a slot. Without blocks to
// recover it does nothing.
func (t *Tier) Recover(r Recoverer) error {
	if !t.Attached() {
		return nil
	}
	if r.Key == nil || r.File == nil {
		return errors.New("cpu tier: Recover needs Key and File")
	}
	if !t.rec.state.CompareAndSwap(int32(RecoveryNone), int32(RecoveryRunning)) {
		return errors.New("cpu tier: Recover called twice")
	}
	start := time.Now()
	chunks := make([]uint32, t.Capacity()/t.ChunkBytes())
	for i := range chunks {
		chunks[i] = uint32(i)
	}
	if err := t.Hold(chunks); err != nil { // cannot happen: nothing is allocated yet
		t.finishRecovery(r, RecoveryStopped, start)
		return err
	}
	t.rec.ledger.begin(t.clearRecord)
	t.log.Info("cpu tier: recovering the arena's blocks in the background", "dir", t.ArenaDir())
	t.rec.wg.Add(1)
	go t.recoverArena(r, start)
	return nil
}

// RecoveryDone is closed once recovery has ended (at once without a
// persistent arena, or with one that held nothing).
func (t *Tier) RecoveryDone() <-chan struct{} { return t.rec.done }

// StopRecovery asks recovery to stop after the chunks it is verifying,
// and returns at once (RecoveryDone tells when it has). Chunks not
// verified keep their records: the next start recovers them.
func (t *Tier) StopRecovery() {
	t.rec.stopOnce.Do(func() {
		close(t.rec.stop)
		// Never started on an arena that has blocks: nothing else
		// closes done.
		if t.Attached() && t.rec.state.CompareAndSwap(int32(RecoveryNone), int32(RecoveryStopped)) {
			close(t.rec.done)
		}
	})
}

// Recovery reports the arena's recovery.
func (t *Tier) Recovery() RecoveryStats {
	// The state first: the counts are final before it says done.
	st := RecoveryState(t.rec.state.Load())
	return RecoveryStats{State: st, Blocks: t.rec.blocks.Load(), Dropped: t.rec.bad.Load(), Took: time.Duration(t.rec.took.Load())}
}

// recoverArena brings the arena's blocks back (see above) until done or
// StopRecovery.
func (t *Tier) recoverArena(r Recoverer, start time.Time) {
	defer t.rec.wg.Done()
	rec := &t.rec
	chunks := uint32(t.Capacity() / t.ChunkBytes())
	newest := map[index.Key]Recovered{}
	for ch := range chunks {
		found, bad := t.scanRecords(ch)
		rec.bad.Add(uint64(bad))
		for _, f := range found {
			k, ok := r.Key(f)
			if !ok {
				t.clearRecord(f.Slot)
				rec.bad.Add(1)
				continue
			}
			b := Recovered{Found: f, Key: k}
			if o, dup := newest[k]; dup {
				loser := b
				if b.Newer(o.Header) {
					loser = o
					newest[k] = b
				}
				t.clearRecord(loser.Slot)
				continue
			}
			newest[k] = b
		}
	}
	byChunk := make([][]Recovered, chunks)
	for _, b := range newest {
		ch, _ := t.ChunkOf(b.Slot)
		byChunk[ch] = append(byChunk[ch], b)
	}
	// From here an Invalidate clears the records it names itself.
	rec.scanDone(newest)
	newest = nil
	// Empty chunks first: stores get room at once.
	for ch := range chunks {
		if len(byChunk[ch]) == 0 {
			t.unhold(ch)
		}
	}
	// Chunks are independent (each its own slots, records and keys: a
	// key is in one chunk after the newest-wins pass): verifiers take
	// them in order, so hashing runs on several cores where the daemon
	// has them and leaves the rest to serving.
	next := make(chan uint32)
	var stopped atomic.Bool
	var wg sync.WaitGroup
	for range verifiers() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ch := range next {
				if r.Hook != nil {
					r.Hook()
				}
				t.recoverChunk(ch, byChunk[ch], r)
				byChunk[ch] = nil
			}
		}()
	}
feed:
	for ch := range chunks {
		if len(byChunk[ch]) == 0 {
			continue
		}
		select {
		case next <- ch:
		case <-rec.stop:
			stopped.Store(true)
			break feed
		}
	}
	close(next)
	wg.Wait()
	if stopped.Load() {
		t.finishRecovery(r, RecoveryStopped, start)
		return
	}
	t.finishRecovery(r, RecoveryDone, start)
}

// verifiers is how many chunks recovery verifies at once: half the
// daemon's Go processors, at least one, at most four.
func verifiers() int { return min(4, max(1, runtime.GOMAXPROCS(0)/2)) }

// slotsPerChunk is how many SlotAlign slots (and records) a chunk has.
func (t *Tier) slotsPerChunk() SlotID { return SlotID(t.ChunkBytes() / layout.SlotAlign) }

// unhold gives a held chunk recovery keeps nothing of back to the free
// chunks, its records cleared.
func (t *Tier) unhold(ch uint32) {
	per := t.slotsPerChunk()
	for sl := SlotID(ch) * per; sl < SlotID(ch+1)*per; sl++ {
		t.clearRecord(sl)
	}
	if err := t.Unhold(ch); err != nil {
		t.log.Error("cpu tier: a chunk recovery held stays out of use", "chunk", ch, "err", err)
	}
}

// recoverChunk verifies the blocks found in chunk ch and hands them to
// the owner.
func (t *Tier) recoverChunk(ch uint32, found []Recovered, r Recoverer) {
	rec := &t.rec
	// The chunk's slot size: every record in it names one (a slot's
	// record is cleared before its chunk can change size); should they
	// disagree, the size most of them name.
	bySize := map[uint64]int{}
	slotBytes := uint64(0)
	for _, f := range found {
		sz := layout.AlignUp(f.PayloadLen)
		if bySize[sz]++; bySize[sz] > bySize[slotBytes] {
			slotBytes = sz
		}
	}
	base := SlotID(ch) * t.slotsPerChunk()
	step := SlotID(slotBytes / layout.SlotAlign)
	good := found[:0]
	for _, f := range found {
		// One slot size per chunk, at its stride: a record that does
		// not fit the chunk's slots is not one of them.
		if layout.AlignUp(f.PayloadLen) != slotBytes || (f.Slot-base)%step != 0 {
			rec.settled(&f.Key)
			t.clearRecord(f.Slot)
			rec.bad.Add(1)
			continue
		}
		if err := t.verifyRecord(f.Found); err != nil {
			t.log.Warn("cpu tier: a block in the arena failed verification; it is dropped", "slot", f.Slot, "err", err)
			rec.settled(&f.Key)
			t.clearRecord(f.Slot)
			rec.bad.Add(1)
			continue
		}
		good = append(good, f)
	}
	if len(good) == 0 {
		t.unhold(ch)
		return
	}
	c, err := t.Class(slotBytes)
	if err != nil {
		t.log.Error("cpu tier: the arena's blocks of a chunk will not come back", "chunk", ch, "slot_bytes", slotBytes, "err", err)
		rec.settledAll(good)
		t.unhold(ch)
		return
	}
	defer c.Drop() // the blocks' slots keep the class alive
	used := make([]slots.SlotID, len(good))
	keep := make(map[SlotID]bool, len(good))
	for i, f := range good {
		used[i] = f.Slot
		keep[f.Slot] = true
	}
	// Slots other than these are free from here on: their records go.
	for sl := base; sl < base+t.slotsPerChunk(); sl++ {
		if !keep[sl] {
			t.clearRecord(sl)
		}
	}
	if err := c.Adopt(ch, used); err != nil {
		t.log.Error("cpu tier: the arena's blocks of a chunk will not come back", "chunk", ch, "err", err)
		rec.settledAll(good)
		t.unhold(ch)
		return
	}
	rec.blocks.Add(uint64(r.File(good)))
}

// finishRecovery ends the recovery: the ledger goes (once done), the
// owner is told, then the state changes and RecoveryDone closes.
func (t *Tier) finishRecovery(r Recoverer, state RecoveryState, start time.Time) {
	rec := &t.rec
	if state == RecoveryDone {
		rec.ledger.end()
	}
	took := time.Since(start)
	rec.took.Store(int64(took))
	if r.Done != nil {
		r.Done(RecoveryStats{State: state, Blocks: rec.blocks.Load(), Dropped: rec.bad.Load(), Took: took})
	}
	// After Done: whoever sees the state done sees what Done did.
	rec.state.Store(int32(state))
	close(rec.done)
}
