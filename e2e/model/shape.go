package model

import (
	"fmt"
	"strings"
	"time"

	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// Segment is one region of a namespace's layout.
type Segment struct {
	Group int
	Bytes int
}

// NSSpec is a namespace the run's clients register: a fingerprint and a
// layout. Specs of one TP group have the same layout and hashes and differ
// in the rank their fingerprint names.
type NSSpec struct {
	Fingerprint string
	HashBytes   int
	Segments    []Segment
}

// Groups is the number of KV cache groups.
func (n NSSpec) Groups() int {
	g := 0
	for _, s := range n.Segments {
		g = max(g, s.Group+1)
	}
	return g
}

// Payload is the bytes of one stored block of group g.
func (n NSSpec) Payload(g int) int {
	p := 0
	for _, s := range n.Segments {
		if s.Group == g {
			p += s.Bytes
		}
	}
	return p
}

// Layout is the spec on the wire.
func (n NSSpec) Layout() *pb.Layout {
	l := &pb.Layout{HashBytes: uint32(n.HashBytes)}
	for _, s := range n.Segments {
		l.Segments = append(l.Segments, &pb.Segment{Group: uint32(s.Group), Bytes: uint64(s.Bytes)})
	}
	return l
}

// Shape is the daemon's configuration and the universe of a run: tiers
// small enough that eviction, spill and chunk moves never stop.
type Shape struct {
	Name         string
	CPUBytes     uint64
	CPUChunk     uint64
	DiskBytes    uint64 // per directory; 0: no disk tier
	Stripe       int    // disk directories (0: one)
	DiskChunk    uint64
	WriteThrough bool
	// CPUArena: the CPU tier's arena is a file that outlives the daemon
	// (--cpu-arena-dir, on tmpfs): a restart or a kill keeps its blocks.
	CPUArena bool
	// Faults: restarts may turn on a --fault-spec plan.
	Faults    bool
	IOWorkers int
	// Linger: --namespace-linger. Short, so namespaces with nothing left
	// go (with their ids and block-size classes) while the run goes on.
	Linger time.Duration

	NS []NSSpec
	// Sets are the namespace sets a Lookup or Invalidate names: one
	// namespace, or every rank of a TP group.
	Sets [][]int

	// Remote, when set, is the seed nodes of a Redis Cluster the daemon
	// uses as its remote tier (--remote-redis): blocks outlive restarts
	// there, and a block invalidated must never come back from it.
	Remote []string

	Clients      int // connections
	Slots        int // registrations per connection
	EngineBlocks int // engine blocks per registration
	Chains       int
	ChainLen     int
}

// Disk reports whether the shape has a disk tier.
func (s Shape) Disk() bool { return s.DiskBytes > 0 }

// Durable reports whether a restart keeps blocks: a disk tier or a
// persistent arena.
func (s Shape) Durable() bool { return s.Disk() || s.CPUArena }

// HasRemote reports whether the shape has a remote tier.
func (s Shape) HasRemote() bool { return len(s.Remote) > 0 }

// DiskDirs is the number of --disk-dir.
func (s Shape) DiskDirs() int {
	if !s.Disk() {
		return 0
	}
	return max(1, s.Stripe)
}

// The namespaces every shape uses: block sizes of 4 KiB to 32 KiB so the
// tiers hold a few hundred blocks and several slot sizes compete for
// chunks; 16- and 32-byte hashes; a two-group (hybrid) layout; a TP pair.
var namespaces = []NSSpec{
	{Fingerprint: "model=a;tp=0/1", HashBytes: 32, Segments: []Segment{{0, 4096}, {0, 4096}}},
	{Fingerprint: "model=b;tp=0/2", HashBytes: 32, Segments: []Segment{{0, 4096}, {0, 4096}, {0, 4096}, {0, 4096}}},
	{Fingerprint: "model=b;tp=1/2", HashBytes: 32, Segments: []Segment{{0, 4096}, {0, 4096}, {0, 4096}, {0, 4096}}},
	{Fingerprint: "model=c;hybrid", HashBytes: 16, Segments: []Segment{{0, 8192}, {0, 4096}, {1, 2048}, {1, 2048}}},
	{Fingerprint: "model=d;big", HashBytes: 32, Segments: []Segment{{0, 16384}, {0, 16384}}},
}

var namespaceSets = [][]int{{0}, {1}, {2}, {1, 2}, {3}, {4}}

// Shapes by name. Every run uses one, picked from the seed unless named.
var Shapes = map[string]Shape{
	// CPU tier only: a restart loses everything.
	"cpu": {CPUBytes: 4 << 20, CPUChunk: 128 << 10},
	// Write-back disk tier behind a tiny arena.
	"disk": {CPUBytes: 4 << 20, CPUChunk: 128 << 10, DiskBytes: 16 << 20, DiskChunk: 256 << 10},
	// Write-through.
	"wt": {CPUBytes: 4 << 20, CPUChunk: 128 << 10, DiskBytes: 16 << 20, DiskChunk: 256 << 10, WriteThrough: true},
	// Write-back with fault plans at restarts.
	"faults": {CPUBytes: 4 << 20, CPUChunk: 128 << 10, DiskBytes: 16 << 20, DiskChunk: 256 << 10, Faults: true},
	// Room for everything: nothing is evicted, so every stored block must
	// be offered until it is invalidated.
	"roomy": {CPUBytes: 64 << 20, CPUChunk: 1 << 20, DiskBytes: 64 << 20, DiskChunk: 1 << 20},
	// Two slot files, faults at restarts.
	"stripe": {CPUBytes: 4 << 20, CPUChunk: 128 << 10, DiskBytes: 16 << 20, DiskChunk: 256 << 10, Stripe: 2, Faults: true},
	// Chunks of one or two slots: every block size change moves chunks.
	"tight": {CPUBytes: 4 << 20, CPUChunk: 64 << 10, DiskBytes: 16 << 20, DiskChunk: 80 << 10},
	// The CPU tier alone, its arena kept across restarts and kills: what
	// it held comes back, verified, and nothing invalidated does.
	"warm": {CPUBytes: 4 << 20, CPUChunk: 128 << 10, CPUArena: true},
	// Both kept: write-back disk tier and persistent arena, recovered
	// side by side at each start.
	"warmdisk": {CPUBytes: 4 << 20, CPUChunk: 128 << 10, DiskBytes: 16 << 20, DiskChunk: 256 << 10, CPUArena: true},
	// A tiny CPU tier and the remote tier (a Redis Cluster the test
	// starts, Shape.Remote): invalidations race stores and publishes, and
	// restarts bring blocks back from the cluster, never invalidated ones.
	"remote": {CPUBytes: 4 << 20, CPUChunk: 128 << 10},
}

// ShapeNames in the order seeds pick them.
var ShapeNames = []string{"cpu", "disk", "wt", "faults", "roomy", "stripe", "tight", "warm", "warmdisk"}

// ShapeFor is the shape a seed runs with when none is named.
func ShapeFor(seed uint64) Shape {
	return NamedShape(ShapeNames[seed%uint64(len(ShapeNames))])
}

// NamedShape fills in a shape's universe.
func NamedShape(name string) Shape {
	s, ok := Shapes[name]
	if !ok {
		panic(fmt.Sprintf("no shape %q (have %s)", name, strings.Join(ShapeNames, ", ")))
	}
	s.Name = name
	s.IOWorkers = 2
	if s.Linger == 0 {
		s.Linger = 2 * time.Second
	}
	s.NS = namespaces
	s.Sets = namespaceSets
	s.Clients = 4
	s.Slots = 2
	s.EngineBlocks = 48
	s.Chains = 16
	s.ChainLen = 12
	return s
}
