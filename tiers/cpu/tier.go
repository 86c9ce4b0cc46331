package cpu

import (
	"fmt"

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
}

// New maps the arena and returns the tier.
func New(cfg Config) (*Tier, error) {
	cfg.Name = "cpu"
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
	return &Tier{Space: sp, mem: mem, locked: locked}, nil
}

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
	t.Space.Close()
	err := unix.Munmap(t.mem)
	t.mem = nil
	if err != nil {
		return fmt.Errorf("unmap arena: %w", err)
	}
	return nil
}
