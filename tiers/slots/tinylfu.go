package slots

import (
	"math"
	"math/bits"
	"math/rand/v2"

	"github.com/dgraph-io/ristretto/v2/z"
	"github.com/kvoffloadd/kvoffloadd/index"
)

// tinyLFU is ristretto's policy (v2's defaultPolicy: a TinyLFU admission
// of a doorkeeper and a count-min sketch of 4-bit counters, and sampled-LFU
// eviction) with the same parameters, keeping the blocks it holds in
// records instead of ristretto's maps: ristretto's store and policy maps
// took 218 bytes a block even with 4-byte values, this 8 and the table.
// Its doorkeeper is ristretto's Bloom filter (z.Bloom). Unlike ristretto's
// cache, it records every access it is given (ristretto dropped a buffer of
// them when its goroutine lagged) and calls Evict and Reject on the
// admitting goroutine.
type tinyLFU struct {
	held
	freq    cmSketch
	door    *z.Bloom
	incrs   int64
	resetAt int64
	rng     *rand.Rand
}

// lfuSample is how many held blocks an eviction compares (ristretto's).
const lfuSample = 5

// The sizes of the frequency sketch and the doorkeeper, against ristretto's
// (a sketch as wide as its counters, a doorkeeper for as many keys at 1%
// false positives: 37 B per slot of the tier, a quarter of the whole daemon's
// memory per block over a disk tier). What sets the hit rate is the reset
// period (counters accesses, ten per slot), not those sizes: over four Zipf
// traces with one-off keys (10^3 to 2*10^4 slots), a sketch two fifths or a
// fifth as wide and a doorkeeper at 5% or 10% gave the same hit rates to
// within 0.03 points, where a reset period of 4 accesses per slot lost 1.1 to
// 3.3 points (TestTinyLFUSmallSketch keeps two of those traces). Now 4 B per
// slot of sketch and 6 to 12 B of doorkeeper.
const (
	sketchShare        = 5   // the sketch has counters/sketchShare counters a row
	doorFalsePositives = 0.1 // the doorkeeper's rate when counters keys are in it
)

func newTinyLFU(counters int64, cb callbacks) *tinyLFU {
	return newTinyLFUSized(counters, counters/sketchShare, doorFalsePositives, cb)
}

// newTinyLFUSized is a tinyLFU that resets every counters accesses, with a
// sketch of width counters in each row and a doorkeeper sized for
// falsePositives.
func newTinyLFUSized(counters, width int64, falsePositives float64, cb callbacks) *tinyLFU {
	p := &tinyLFU{
		held:    held{cb: cb},
		freq:    newCmSketch(width),
		door:    z.NewBloomFilter(float64(counters), falsePositives),
		resetAt: counters,
		rng:     rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())),
	}
	p.capacity.Store(1)
	return p
}

func (p *tinyLFU) admit(keys []index.Key, hs []uint64) { p.add(keys, hs) }
func (p *tinyLFU) learn(keys []index.Key, hs []uint64) { p.add(keys, hs) }

// add is ristretto's Add for each key: a key held already stays as it is;
// a new key goes in while there is room, and otherwise only if the
// frequency estimate says it is wanted at least as much as the least
// wanted of a sample of the blocks held, each such block evicted until
// there is room.
func (p *tinyLFU) add(keys []index.Key, hs []uint64) {
	var evicted []uint64
	var rejected []index.Key
	p.mu.Lock()
	sample := make([]uint64, 0, lfuSample)
	for i, h := range hs {
		if _, ok := p.recs.lookup(h); ok {
			continue
		}
		capacity := p.capacity.Load()
		if capacity < 1 {
			rejected = append(rejected, keys[i])
			continue
		}
		in := p.estimate(h)
		sample = sample[:0]
		admitted := true
		for int64(p.recs.len())+1 > capacity {
			sample = p.fillSample(sample)
			least, leastHits := -1, int64(math.MaxInt64)
			for i, s := range sample {
				if hits := p.estimate(s); hits < leastHits {
					least, leastHits = i, hits
				}
			}
			if in < leastHits {
				admitted = false
				break
			}
			v := sample[least]
			r, _ := p.recs.lookup(v)
			p.recs.remove(r)
			evicted = append(evicted, v)
			sample[least] = sample[len(sample)-1]
			sample = sample[:len(sample)-1]
		}
		if !admitted {
			rejected = append(rejected, keys[i])
			continue
		}
		p.recs.add(h)
	}
	p.mu.Unlock()
	if len(evicted) > 0 {
		p.cb.evict(evicted)
	}
	if len(rejected) > 0 {
		p.cb.reject(rejected)
	}
}

// fillSample tops sample up to lfuSample distinct held blocks, chosen at
// random (ristretto takes the first of its map's randomised iteration),
// or to every block held when there are fewer.
func (p *tinyLFU) fillSample(sample []uint64) []uint64 {
	n := p.recs.len()
	want := min(lfuSample, n)
	for tries := 0; len(sample) < want && tries < 4*lfuSample; tries++ {
		h := p.recs.key(uint32(p.rng.IntN(n)))
		dup := false
		for _, s := range sample {
			dup = dup || s == h
		}
		if !dup {
			sample = append(sample, h)
		}
	}
	for r := 0; len(sample) < want && r < n; r++ {
		// Unlucky draws: take the first blocks not yet in the sample.
		h, dup := p.recs.key(uint32(r)), false
		for _, s := range sample {
			dup = dup || s == h
		}
		if !dup {
			sample = append(sample, h)
		}
	}
	return sample
}

// estimate is ristretto's: the sketch's count, plus one when the
// doorkeeper has seen the key.
func (p *tinyLFU) estimate(h uint64) int64 {
	hits := p.freq.estimate(h)
	if p.door.Has(h) {
		hits++
	}
	return hits
}

// access counts lookups (hit or miss) as ristretto's Get does: a key's
// first access since the last reset only sets the doorkeeper, later ones
// count in the sketch, and every resetAt accesses the counts halve and the
// doorkeeper clears.
func (p *tinyLFU) access(hs []uint64, _ uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, h := range hs {
		if !p.door.AddIfNotHas(h) {
			p.freq.increment(h)
		}
		if p.incrs++; p.incrs >= p.resetAt {
			p.incrs = 0
			p.door.Clear()
			p.freq.halve()
		}
	}
}

func (p *tinyLFU) forget(h uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r, ok := p.recs.lookup(h); ok {
		p.recs.remove(r)
	}
}

func (p *tinyLFU) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.recs.reset()
}

// cmSketch is ristretto's count-min sketch: cmDepth rows of 4-bit
// counters, each row indexed by the key xor a seed of its own. Unlike
// ristretto's, a row has as many counters as asked for, not the next power
// of two (which took up to twice the memory): the key is mapped onto the
// row by a multiply-shift, not a mask.
type cmSketch struct {
	rows  [cmDepth][]byte // two counters a byte
	seed  [cmDepth]uint64
	width uint64
}

const cmDepth = 4

func newCmSketch(counters int64) cmSketch {
	s := cmSketch{width: uint64(max(counters, 2))}
	for i := range s.rows {
		s.seed[i] = rand.Uint64()
		s.rows[i] = make([]byte, (s.width+1)/2)
	}
	return s
}

// at is the counter of h in row i.
func (s *cmSketch) at(i int, h uint64) uint64 {
	// h is a hash already; the multiplication mixes in the seed's bits
	// before the high word picks the counter.
	n, _ := bits.Mul64((h^s.seed[i])*0x9e3779b97f4a7c15, s.width)
	return n
}

func (s *cmSketch) increment(h uint64) {
	for i, row := range s.rows {
		n := s.at(i, h)
		shift := (n & 1) * 4
		if (row[n/2]>>shift)&0x0f < 15 {
			row[n/2] += 1 << shift
		}
	}
}

func (s *cmSketch) estimate(h uint64) int64 {
	least := byte(255)
	for i, row := range s.rows {
		n := s.at(i, h)
		least = min(least, (row[n/2]>>((n&1)*4))&0x0f)
	}
	return int64(least)
}

// halve ages every count (ristretto's Reset).
func (s *cmSketch) halve() {
	for _, row := range s.rows {
		for i := range row {
			row[i] = (row[i] >> 1) & 0x77
		}
	}
}
