package model

import (
	"fmt"
	"math/rand/v2"
	"strings"
)

// weights of each kind, out of their sum. Rare kinds are the expensive
// ones (a restart costs a daemon start) or the ones whose effect lasts.
var weights = [numKinds]int{
	Register:       40,
	Unregister:     6,
	Resolve:        8,
	Lookup:         180,
	Store:          200,
	Load:           170,
	Completions:    150,
	InvalidateKeys: 25,
	InvalidateNS:   4,
	Disconnect:     8,
	Restart:        6,
	Kill:           4,
	Corrupt:        8,
	RegionFault:    6,
	BadRequest:     14,
	Stats:          8,
	Burst:          60,
	RegisterRace:   4,
	Check:          8,
}

// Generate returns steps operations drawn from seed for shape sh, without
// the kinds in off. The same arguments always give the same operations.
func Generate(seed uint64, sh Shape, steps int, off map[Kind]bool) []Op {
	g := NewGenerator(seed, sh, off)
	ops := make([]Op, steps)
	for i := range ops {
		ops[i] = g.Next()
	}
	return ops
}

// Generator is an endless stream of operations.
//
// It keeps a rough picture of the run (which slots hold a registration,
// which chains were stored) only to make most operations apply; the runner
// decides at run time, so dropping any operation leaves a valid run.
type Generator struct{ gen }

// NewGenerator starts the stream of seed.
func NewGenerator(seed uint64, sh Shape, off map[Kind]bool) *Generator {
	g := &Generator{gen{sh: sh, rng: rand.New(rand.NewPCG(seed, 0x6d6f64656c)), off: off, regs: make([][]int, sh.Clients)}}
	for c := range g.regs {
		g.regs[c] = make([]int, sh.Slots)
		for s := range g.regs[c] {
			g.regs[c][s] = -1
		}
	}
	g.stored = map[[2]int][]int{}
	for k, w := range weights {
		if g.allowed(Kind(k)) {
			g.total += w
		}
	}
	return g
}

// Next returns the next operation. The stream opens with a registration
// per client, and a client that lost its registrations (a disconnect, a
// restart) registers again soon, so most steps do work.
func (g *Generator) Next() Op {
	if g.n < g.sh.Clients && g.allowed(Register) {
		g.n++
		return g.register(g.n-1, 0)
	}
	g.n = g.sh.Clients
	if len(g.again) > 0 && g.rng.IntN(3) == 0 && g.allowed(Register) {
		c := g.again[0]
		g.again = g.again[1:]
		return g.register(c, 0)
	}
	x := g.rng.IntN(g.total)
	k := Kind(0)
	for ; k < numKinds-1; k++ {
		if !g.allowed(k) {
			continue
		}
		if x < weights[k] {
			break
		}
		x -= weights[k]
	}
	return g.op(k)
}

type gen struct {
	n      int   // registrations opened so far
	again  []int // clients to register again
	total  int   // sum of the allowed kinds' weights
	sh     Shape
	rng    *rand.Rand
	off    map[Kind]bool
	regs   [][]int          // client, slot -> namespace spec or -1
	stored map[[2]int][]int // (ns, group) -> chains stored, most recent last
}

func (g *gen) allowed(k Kind) bool {
	if g.off[k] {
		return false
	}
	switch k {
	case Corrupt:
		return g.sh.Disk()
	}
	return true
}

// pickSlot prefers a slot holding a registration.
func (g *gen) pickSlot() (c, s int) {
	for try := 0; try < 8; try++ {
		c, s = g.rng.IntN(g.sh.Clients), g.rng.IntN(g.sh.Slots)
		if g.regs[c][s] >= 0 {
			return c, s
		}
	}
	return c, s
}

// pickChain prefers chains stored before (for loads and lookups) and a few
// hot chains (for stores), as a prefix cache sees shared system prompts.
func (g *gen) pickChain(ns, group int, reuse bool) int {
	if reuse {
		if st := g.stored[[2]int{ns, group}]; len(st) > 0 && g.rng.IntN(4) > 0 {
			return st[len(st)-1-min(len(st)-1, int(g.rng.ExpFloat64()*3))]
		}
	}
	if g.rng.IntN(3) == 0 {
		return g.rng.IntN(min(3, g.sh.Chains))
	}
	return g.rng.IntN(g.sh.Chains)
}

func (g *gen) register(c, s int) Op {
	ns := g.rng.IntN(len(g.sh.NS))
	g.regs[c][s] = ns
	return Op{Kind: Register, Client: c, Slot: s, NS: ns, Seed: g.rng.Uint64()}
}

// setOf returns a namespace set containing ns.
func (g *gen) setOf(ns int) int {
	var sets []int
	for i, set := range g.sh.Sets {
		for _, n := range set {
			if n == ns {
				sets = append(sets, i)
			}
		}
	}
	return sets[g.rng.IntN(len(sets))]
}

func (g *gen) op(k Kind) Op {
	rng := g.rng
	o := Op{Kind: k, Seed: rng.Uint64()}
	switch k {
	case Register:
		c, s := rng.IntN(g.sh.Clients), rng.IntN(g.sh.Slots)
		return g.register(c, s)
	case Unregister:
		o.Client, o.Slot = g.pickSlot()
		g.regs[o.Client][o.Slot] = -1
	case Resolve, Stats:
		o.Client = rng.IntN(g.sh.Clients)
	case Lookup:
		o.Client = rng.IntN(g.sh.Clients)
		c, s := g.pickSlot()
		ns := g.regs[c][s]
		if ns < 0 {
			ns = rng.IntN(len(g.sh.NS))
		}
		o.NS = g.setOf(ns)
		o.Group = rng.IntN(g.sh.NS[ns].Groups())
		o.Chain = g.pickChain(ns, o.Group, true)
		o.N = 1 + rng.IntN(g.sh.ChainLen)
		if rng.IntN(5) < 2 {
			o.LeaseMs = uint32(100 + rng.IntN(1900))
			if rng.IntN(4) > 0 {
				// A lease serves the Loads of its own connection: most
				// are taken where a registration of the namespace is.
				o.Client = c
			}
		}
		o.Peek = rng.IntN(3) == 0
	case Store, Load:
		o.Client, o.Slot = g.pickSlot()
		ns := g.regs[o.Client][o.Slot]
		if ns < 0 {
			ns = 0
		}
		o.Group = rng.IntN(g.sh.NS[ns].Groups())
		o.Chain = g.pickChain(ns, o.Group, k == Load)
		if rng.IntN(3) > 0 {
			o.From = 0 // a prefix, as an engine stores and loads them
		} else {
			o.From = rng.IntN(g.sh.ChainLen)
		}
		o.N = 1 + rng.IntN(min(8, g.sh.ChainLen-o.From))
		o.Jobs = 1 + rng.IntN(3)
		o.Wait = rng.IntN(4) == 0
		o.Abandon = o.Wait && rng.IntN(5) == 0
		// From the op's seed, so the stream of earlier seeds is kept.
		// Without wait, ack_seq asks for the finished results on the
		// reply (issue 11 item 4); another bit of the seed, so half the
		// transfers without wait stay as before.
		o.Ack = (o.Wait && (o.Seed>>3)%3 != 0) || (!o.Wait && (o.Seed>>5)%2 == 0)
		o.UseLease = k == Load && rng.IntN(2) == 0
		if k == Store {
			key := [2]int{ns, o.Group}
			g.stored[key] = append(g.stored[key], o.Chain)
			if len(g.stored[key]) > 32 {
				g.stored[key] = g.stored[key][1:]
			}
		}
	case Completions:
		o.Client, o.Slot = g.pickSlot()
		if rng.IntN(3) == 0 {
			o.WaitMs = uint32(rng.IntN(50))
		}
		if rng.IntN(4) == 0 {
			o.MaxJobs = uint32(1 + rng.IntN(4))
		}
	case InvalidateKeys, InvalidateNS:
		o.Client = rng.IntN(g.sh.Clients)
		c, s := g.pickSlot()
		ns := g.regs[c][s]
		if ns < 0 {
			ns = rng.IntN(len(g.sh.NS))
		}
		o.NS = g.setOf(ns)
		o.Group = rng.IntN(g.sh.NS[ns].Groups())
		o.Chain = g.pickChain(ns, o.Group, true)
		o.From = rng.IntN(g.sh.ChainLen)
		o.N = 1 + rng.IntN(g.sh.ChainLen-o.From)
	case Disconnect:
		o.Client = rng.IntN(g.sh.Clients)
		for s := range g.regs[o.Client] {
			g.regs[o.Client][s] = -1
		}
		g.again = append(g.again, o.Client)
	case Restart, Kill:
		for c := range g.regs {
			for s := range g.regs[c] {
				g.regs[c][s] = -1
			}
		}
		g.again = g.again[:0]
		for c := range g.regs {
			g.again = append(g.again, c)
		}
		if k == Restart && g.sh.Faults && rng.IntN(2) == 0 {
			o.Faults = g.faultPlan()
		}
		o.Reset = k == Restart && g.sh.Disk() && rng.IntN(8) == 0
	case Corrupt:
		o.NS = rng.IntN(len(g.sh.NS))
		o.Group = rng.IntN(g.sh.NS[o.NS].Groups())
		o.Count = 1 + rng.IntN(4)
	case RegionFault:
		o.Client, o.Slot = g.pickSlot()
		ns := max(0, g.regs[o.Client][o.Slot])
		o.Group = rng.IntN(g.sh.NS[ns].Groups())
		o.Chain = g.pickChain(ns, o.Group, true)
	case BadRequest:
		o.Client, o.Slot = g.pickSlot()
		o.Count = rng.IntN(numBad)
	case RegisterRace:
		o.Client = rng.IntN(g.sh.Clients)
		o.NS = rng.IntN(len(g.sh.NS))
	case Burst:
		kinds := []Kind{Store, Store, Store, Load, Load, Load, Lookup, Lookup, Completions, Completions}
		for n := 2 + rng.IntN(3); len(o.Sub) < n; {
			if k := kinds[rng.IntN(len(kinds))]; g.allowed(k) {
				o.Sub = append(o.Sub, g.op(k))
			} else if len(o.Sub) == 0 && !g.allowed(Store) && !g.allowed(Load) && !g.allowed(Lookup) && !g.allowed(Completions) {
				break
			}
		}
	}
	return o
}

// faultPlan draws a --fault-spec: a few kinds at rates high enough to fire
// within a short run.
func (g *gen) faultPlan() string {
	kinds := []string{"read-eio", "write-eio", "short-read", "torn-write", "bitflip", "enospc"}
	var parts []string
	for _, k := range kinds {
		if g.rng.IntN(3) == 0 {
			parts = append(parts, fmt.Sprintf("%s=%.2f", k, 0.02+0.18*g.rng.Float64()))
		}
	}
	if len(parts) == 0 {
		parts = append(parts, "bitflip=0.1")
	}
	if g.rng.IntN(3) == 0 {
		parts = append(parts, "latency=1ms@0.2")
	}
	parts = append(parts, fmt.Sprintf("seed=%d", g.rng.IntN(1000)))
	return strings.Join(parts, ",")
}
