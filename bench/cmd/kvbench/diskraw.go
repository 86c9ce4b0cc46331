package main

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
	"github.com/kvoffloadd/kvoffloadd/bench/engine"
	"github.com/kvoffloadd/kvoffloadd/bench/interference"
	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/bench/slotfile"
)

// diskRaw is a disk scenario's raw O_DIRECT reads of the daemon's own slot
// file with the tier's pattern (baseline.TierReader): after each step as
// many slots as the step read from disk, and right before and right after
// the disk-only loads the very slots they load.
type diskRaw struct {
	dir        string
	chunkBytes int64
	payload    int
	queueDepth int
	rng        *rand.Rand
	meter      *interference.Meter
	scenario   string

	known  []slotfile.Slot // written slots found by the last scan
	reader *baseline.TierReader
	chosen []slotfile.Slot // the disk-only loads' slots

	// Tier is the before-and-after measurement, nil until taken.
	Tier   *report.TierRead
	bursts []time.Duration
}

func newDiskRaw(dir string, chunkBytes int64, payload, queueDepth int, seed uint64, meter *interference.Meter, scenario string) *diskRaw {
	return &diskRaw{dir: dir, chunkBytes: chunkBytes, payload: payload, queueDepth: queueDepth,
		rng: rand.New(rand.NewPCG(seed, 0x0d12ec7)), meter: meter, scenario: scenario}
}

func (r *diskRaw) Close() error {
	if r.reader == nil {
		return nil
	}
	return r.reader.Close()
}

// scan finds the written slots of the run's block size.
func (r *diskRaw) scan() error {
	files, err := slotfile.Files(r.dir, r.chunkBytes)
	if err != nil {
		return err
	}
	if r.known, err = slotfile.Scan(files, r.chunkBytes, int64(r.payload), r.queueDepth); err != nil {
		return err
	}
	if r.reader == nil && len(r.known) > 0 {
		r.reader, err = baseline.NewTierReader(r.known, r.payload, r.queueDepth)
	}
	return err
}

// step reads n written slots, chosen at random, as one burst: what raw
// O_DIRECT takes for a step's n disk reads at the daemon's queue depth. A
// slot once written stays a written extent of the file whatever the
// daemon did with it since, so the reads cost what the daemon's did.
func (r *diskRaw) step(n int) (time.Duration, error) {
	if len(r.known) < n {
		if err := r.scan(); err != nil {
			return 0, err
		}
	}
	if len(r.known) < n {
		return 0, fmt.Errorf("the slot file has %d written slots, the step read %d from disk", len(r.known), n)
	}
	pick := make([]slotfile.Slot, n)
	for i, j := range r.rng.Perm(len(r.known))[:n] {
		pick[i] = r.known[j]
	}
	return r.reader.Read(pick)
}

// around is engine.Config.DiskBaseline: before the disk-only loads it
// finds their slots and reads them in the loads' bursts; after, it reads
// the same slots again.
func (r *diskRaw) around(when string, keys [][]byte) error {
	if when == "before" {
		if err := r.scan(); err != nil {
			return err
		}
		at := map[string]slotfile.Slot{}
		for _, s := range r.known {
			at[string(s.Hash)] = s
		}
		r.chosen = r.chosen[:0]
		for _, k := range keys {
			if s, ok := at[string(k)]; ok {
				r.chosen = append(r.chosen, s)
			}
		}
		if len(r.chosen) == 0 {
			return nil
		}
		r.Tier = &report.TierRead{Blocks: len(r.chosen), Burst: engine.DiskLoadBlocks, QueueDepth: r.queueDepth, IOBytes: r.reader.IOBytes()}
		if st, err := os.Stat(r.chosen[0].Path); err == nil {
			r.Tier.FileBytes = uint64(st.Size())
		}
	}
	if r.Tier == nil {
		return nil
	}
	mk := r.meter.Start(fmt.Sprintf("%s: tier-pattern reads %s its disk loads", r.scenario, when))
	bursts, err := r.reader.Bursts(r.chosen, engine.DiskLoadBlocks)
	_, merr := r.meter.End(mk)
	if err != nil {
		return errors.Join(err, merr)
	}
	var sum time.Duration
	for _, d := range bursts {
		sum += d
	}
	gbps := 0.0
	if sum > 0 {
		// Payload bytes, as the daemon counts a load's bytes: the header
		// read is overhead on both sides.
		gbps = float64(len(r.chosen)) * float64(r.payload) / sum.Seconds() / 1e9
	}
	if when == "before" {
		r.Tier.BeforeGBps = gbps
	} else {
		r.Tier.AfterGBps = gbps
	}
	r.bursts = append(r.bursts, bursts...)
	r.Tier.BurstP50us = us(engine.Percentile(r.bursts, 50))
	r.Tier.BurstP99us = us(engine.Percentile(r.bursts, 99))
	return merr
}
