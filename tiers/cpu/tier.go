package cpu

import (
	"fmt"
	"log/slog"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// Config sizes the CPU tier; see slots.Config.
type Config = slots.Config

// SlotID names a slot of the arena.
type SlotID = slots.SlotID

// Offset is the arena byte offset of slot s.
func Offset(s SlotID) uint64 { return slots.Offset(s) }

// Tier is the CPU tier: the arena and its slots.
type Tier struct {
	*slots.Space
	mem    []byte
	locked bool
	// persist is the arena's file (persist.go), nil for a private arena.
	persist *persist
	rec     recovery // of a re-attached arena (recover.go)
	log     *slog.Logger

	stopPopulate chan struct{}
	populated    chan struct{} // closed when populate has returned
	backed       atomic.Uint64 // bytes of the arena populate has backed
}

// New maps the arena and returns the tier.
func New(cfg Config) (*Tier, error) {
	cfg.Name = "cpu"
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.ChunkBytes == 0 {
		cfg.ChunkBytes = slots.DefaultChunkBytes(cfg.Bytes)
	}
	sp, err := slots.New(cfg)
	if err != nil {
		return nil, err
	}
	mem, locked, err := mapArena(sp.Capacity(), cfg.Logger)
	if err != nil {
		sp.Close()
		return nil, err
	}
	t := &Tier{Space: sp, mem: mem, locked: locked, log: cfg.Logger, stopPopulate: make(chan struct{}), populated: make(chan struct{})}
	t.rec.init(false)
	go func() {
		defer close(t.populated)
		populate(mem, &t.backed, t.stopPopulate, cfg.Logger)
	}()
	return t, nil
}

// Populated is closed once the arena is backed by memory (or populating
// it stopped: Close, or a kernel or host that cannot).
func (t *Tier) Populated() <-chan struct{} { return t.populated }

// BackedBytes reports how much of the arena is backed by memory so far:
// the arena's size once populating is done. Until then a copy into the
// rest faults its pages in itself (and competes with populate for the
// CPUs), so a benchmark that starts before is measuring the start.
func (t *Tier) BackedBytes() uint64 { return t.backed.Load() }

// Mem is the arena. Slot s starts at Mem()[Offset(s)].
func (t *Tier) Mem() []byte { return t.mem }

// Locked reports whether the arena is locked in memory.
func (t *Tier) Locked() bool { return t.locked }

// Slot returns the first n bytes of slot s.
func (t *Tier) Slot(s SlotID, n uint64) []byte {
	off := Offset(s)
	return t.mem[off : off+n : off+n]
}

// Close stops the policy and unmaps the arena. No copy may be in flight.
// It may be called more than once.
func (t *Tier) Close() error {
	if t.mem == nil {
		return nil
	}
	// The owner stopped recovery already (its File touches the owner's
	// index); this only makes sure.
	t.StopRecovery()
	t.rec.wg.Wait()
	close(t.stopPopulate)
	<-t.populated
	t.Space.Close()
	var err error
	if t.persist != nil {
		// The file stays, and with it every block whose record is
		// there: the next start with the same --cpu-arena-dir brings
		// them back.
		err = t.persist.close()
	} else {
		err = unix.Munmap(t.mem)
	}
	t.mem = nil
	if err != nil {
		return fmt.Errorf("unmap arena: %w", err)
	}
	return nil
}
