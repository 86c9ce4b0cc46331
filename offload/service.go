// Package offload owns the daemon's state and its rules: namespaces and the
// registrations that map engine memory, the index of what is cached, the
// store and load jobs that move blocks through the copy engine, and the
// completions and leases that tie them to clients. It knows nothing of gRPC;
// rpc/server turns its calls and errors into the wire API.
package offload

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/events"
	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// Limits bound everything a request may ask for before anything is
// allocated, and everything a client can make the daemon hold. A zero field
// takes its DefaultLimits value. docs/operations.md lists each with the
// status a request past it gets.
type Limits struct {
	MaxJobsPerRequest   int           // jobs in one Store or Load
	MaxBlocksPerRequest int           // blocks over all jobs of one request
	MaxKeysPerLookup    int           // keys in one Lookup or Invalidate
	MaxNamespaces       int           // namespace ids in one Lookup or Resolve
	MaxPending          int           // unfinished plus unread jobs per registration
	MaxLease            time.Duration // longest Lookup lease
	MaxFingerprint      int           // bytes
	MaxRequestID        int           // bytes of a job's request_id
	MaxClientName       int           // bytes of Register's client_name
	MaxReadyEvent       int           // bytes of a Store's ready_event
	MaxRegionName       int           // bytes of a region's shm_path or CUDA handle
	// MaxUnreadBytes bounds, per registration, the wire bytes of results
	// not yet read plus the most the results of its unfinished jobs can
	// take.
	MaxUnreadBytes       int
	MaxLeasesPerOwner    int // leases one connection holds
	MaxLeasePinsPerOwner int // blocks its leases pin
	MaxLeases            int // leases of all connections
	MaxLeasePins         int // blocks all leases pin
	// MaxNamespacesTotal bounds the namespaces the daemon keeps (those
	// with a registration or a cached block).
	MaxNamespacesTotal int

	// Registrations and the regions they map, in total and per peer uid.
	// Each mapped region costs the daemon at least one entry of its
	// memory map (vm.max_map_count, 65530 by default, shared with the Go
	// runtime and the arena): MaxRegions keeps the regions well under it.
	MaxRegistrations       int
	MaxRegistrationsPerUID int
	MaxRegions             int
	MaxRegionsPerUID       int
}

// DefaultLimits are generous for an engine and small enough to refuse abuse.
var DefaultLimits = Limits{
	MaxJobsPerRequest:    4096,
	MaxBlocksPerRequest:  1 << 16,
	MaxKeysPerLookup:     1 << 16,
	MaxNamespaces:        64,
	MaxPending:           8192,
	MaxLease:             30 * time.Second,
	MaxFingerprint:       256,
	MaxRequestID:         512,
	MaxClientName:        256,
	MaxReadyEvent:        256,
	MaxRegionName:        512,
	MaxUnreadBytes:       64 << 20,
	MaxLeasesPerOwner:    8192,
	MaxLeasePinsPerOwner: 1 << 20,
	MaxLeases:            1 << 16,
	MaxLeasePins:         1 << 21,
	MaxNamespacesTotal:   1024,

	// An engine registers once per worker (one per GPU rank), a region
	// per layer or per layer and K/V: 8 ranks of a 96-layer model map
	// 1536 regions.
	MaxRegistrations:       1024,
	MaxRegistrationsPerUID: 256,
	MaxRegions:             16384,
	MaxRegionsPerUID:       8192,
}

// withDefaults fills the zero fields of l from DefaultLimits.
func (l Limits) withDefaults() Limits {
	fill := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	d := DefaultLimits
	fill(&l.MaxJobsPerRequest, d.MaxJobsPerRequest)
	fill(&l.MaxBlocksPerRequest, d.MaxBlocksPerRequest)
	fill(&l.MaxKeysPerLookup, d.MaxKeysPerLookup)
	fill(&l.MaxNamespaces, d.MaxNamespaces)
	fill(&l.MaxPending, d.MaxPending)
	if l.MaxLease == 0 {
		l.MaxLease = d.MaxLease
	}
	fill(&l.MaxFingerprint, d.MaxFingerprint)
	fill(&l.MaxRequestID, d.MaxRequestID)
	fill(&l.MaxClientName, d.MaxClientName)
	fill(&l.MaxReadyEvent, d.MaxReadyEvent)
	fill(&l.MaxRegionName, d.MaxRegionName)
	fill(&l.MaxUnreadBytes, d.MaxUnreadBytes)
	fill(&l.MaxLeasesPerOwner, d.MaxLeasesPerOwner)
	fill(&l.MaxLeasePinsPerOwner, d.MaxLeasePinsPerOwner)
	fill(&l.MaxLeases, d.MaxLeases)
	fill(&l.MaxLeasePins, d.MaxLeasePins)
	fill(&l.MaxNamespacesTotal, d.MaxNamespacesTotal)
	fill(&l.MaxRegistrations, d.MaxRegistrations)
	fill(&l.MaxRegistrationsPerUID, d.MaxRegistrationsPerUID)
	fill(&l.MaxRegions, d.MaxRegions)
	fill(&l.MaxRegionsPerUID, d.MaxRegionsPerUID)
	return l
}

// Config wires the service to its parts.
type Config struct {
	CPU cpu.Config // the service sets the callbacks
	// CPUArenaDir, when set, keeps the CPU arena in a file of this tmpfs
	// or hugetlbfs directory, so its blocks survive a restart of the
	// daemon (cpu_recover.go). Empty: a private arena.
	CPUArenaDir string
	// CPURecoveryHook, when set (tests), runs on the CPU tier's recovery
	// before it files each chunk's blocks: a test holds recovery there.
	CPURecoveryHook func()
	// Disk, when set, adds the disk tier behind the CPU tier (the service
	// sets its callbacks, logger and registerer).
	Disk *disk.Config
	// WriteThrough writes every stored block to disk at once instead of
	// when the CPU tier evicts it.
	WriteThrough bool
	DMA          dma.Engine
	Limits       Limits
	// NamespaceLinger is how long a namespace with no registration and no
	// cached block is kept before it goes (its id with it); 0 means
	// DefaultNamespaceLinger, negative means at the next sweep.
	NamespaceLinger time.Duration
	// Events sizes the stream of what the tiers hold (events.Hub).
	Events     events.Config
	Logger     *slog.Logger
	Registerer prometheus.Registerer

	// Remote, when set, adds the shared remote tier behind the local ones.
	Remote *RemoteConfig
}

// DefaultNamespaceLinger keeps an empty namespace through an engine
// restart, so a scheduler's namespace ids stay good.
const DefaultNamespaceLinger = time.Minute

// namespaceSweep is how often the reaper looks for empty namespaces.
const namespaceSweep = time.Second

// Service is the daemon's core. Its methods are safe for concurrent use.
type Service struct {
	log *slog.Logger
	lim Limits
	ix  *index.Index
	ev  *events.Hub // every change of a block's tiers, for subscribers
	cpu *cpu.Tier
	dma dma.Engine
	m   *metrics
	c   counters

	disk         *disk.Tier // nil without a disk tier
	writeThrough bool
	dm           *diskMetrics
	demotions    *demoQueue
	staging      chan stageReq // disk reads of loads waiting for a CPU slot
	diskWrites   atomic.Int64  // demotions and discards queued or in flight
	// cl is the clean CPU copies and the cleaner (clean.go); nil without
	// a disk tier. The cleaner keeps at most cleanBacklog disk writes
	// queued.
	cl           *cleaning
	cleanBacklog int
	// writeRoom is the most disk writes the demoter leaves waiting for an
	// I/O worker per file: the rest wait in the demotion queue, fed to
	// the file as its workers take them.
	writeRoom int
	// writing is the demotion in flight for each key: a demotion that
	// finds another in its place belongs to an entry since removed.
	writing struct {
		sync.Mutex
		byKey map[index.Key]*demotion
		peak  int // the most demotions byKey held since it was made
	}
	rec    recovery    // the disk tier's recovery (recover.go)
	crec   cpuRecovery // the CPU tier's, from a persistent arena (cpu_recover.go)
	linger time.Duration
	// inval orders Invalidate (writer) with the Lookups that take leases
	// (readers): a lease is filed either before an Invalidate looks at the
	// leases, or after the index has lost the keys, so no lease keeps an
	// invalidated block.
	inval sync.RWMutex
	// marksMu guards the namespaces' invalidation marks and orders their
	// saves to the catalog (marks.go).
	marksMu sync.Mutex

	rem *remoteTier // nil without a remote tier

	jobs     sync.WaitGroup // accepted jobs not yet finished
	inflight atomic.Int64   // the same, as a count
	stop     chan struct{}  // closed by Close: background goroutines exit
	// closing is closed by BeginShutdown: long polls wait only for the
	// jobs pending.
	closing     chan struct{}
	closingOnce sync.Once
	reaper      sync.WaitGroup
	// read gets a token when a reply carries results or a registration
	// closes: WaitDelivered looks again.
	read chan struct{}

	mu struct {
		sync.Mutex
		byPrint   map[string]*Namespace
		byID      map[uint32]*Namespace
		nextNS    uint32 // the last namespace id given; ids are never reused
		regs      map[uint64]*Registration
		nextReg   uint64
		leases    map[uint64]*lease
		nextLs    uint64
		owners    map[Owner]*ownerUse
		leasePins int
		started   bool // New has returned: the namespace bound applies
		closing   bool
		closed    bool

		// Booked by Register before it maps anything, returned when the
		// registration is gone (Limits.MaxRegistrations...).
		regCount, regionCount int
		byUID                 map[uint32]*use
		lastRefusalLog        time.Time
	}
}

// Namespace is a set of blocks that share identity and layout. It lives
// while it has a registration or a cached block, and a while after
// (Config.NamespaceLinger).
type Namespace struct {
	ID          uint32
	Fingerprint []byte
	Layout      layout.Layout
	classes     []*slots.Class // CPU tier, per group
	diskClasses []*slots.Class // disk tier, per group; nil without one
	regs        int            // guarded by Service.mu
	idleSince   time.Time      // guarded by Service.mu: when regs last reached 0
	// recovering: brought back from the disk tier's catalog, whose
	// recovery may still file blocks of it (guarded by Service.mu).
	recovering bool
	// cpuRecovering: the same for the CPU tier's recovery from a
	// persistent arena (cpu_recover.go).
	cpuRecovering bool
	marks         marks // invalidations recovery honours (marks.go); guarded by Service.marksMu

	remote remoteNS // the remote tier's name for it
}

// New builds the service: it maps the CPU arena and hands it to the copy engine.
func New(cfg Config) (*Service, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Limits = cfg.Limits.withDefaults()
	if cfg.Remote != nil {
		if err := cfg.Remote.validate(); err != nil {
			return nil, err
		}
	}
	if cfg.NamespaceLinger == 0 {
		cfg.NamespaceLinger = DefaultNamespaceLinger
	}
	s := &Service{log: cfg.Logger, lim: cfg.Limits, ix: index.New(), dma: cfg.DMA, stop: make(chan struct{}), closing: make(chan struct{}), read: make(chan struct{}, 1), linger: cfg.NamespaceLinger}
	// Before anything can change the index (the disk tier's recovery
	// files blocks from openDisk on).
	s.ev = events.New(s.ix, cfg.Events)
	s.m = newMetrics(cfg.Registerer)
	s.mu.byPrint = map[string]*Namespace{}
	s.mu.byID = map[uint32]*Namespace{}
	s.mu.regs = map[uint64]*Registration{}
	s.mu.byUID = map[uint32]*use{}
	s.mu.leases = map[uint64]*lease{}
	s.mu.owners = map[Owner]*ownerUse{}
	s.writing.byKey = map[index.Key]*demotion{}
	cc := cfg.CPU
	cc.Logger = cfg.Logger
	if (cfg.Disk != nil || cfg.Remote != nil) && cc.Reserve == 0 {
		// Keep slots the policy never fills: stores land there while
		// evicted blocks are still on their way to disk (write-back),
		// and loads stage blocks read from disk or fetched from the
		// remote tier there.
		cc.Reserve = 1.0 / 8
	}
	if (cfg.Disk != nil || cfg.Remote != nil) && cc.Staging == 0 {
		// A quarter of the reserve is for blocks read from disk or
		// fetched from the remote tier only: a burst of stores cannot
		// take the slots a load needs to stage its reads.
		cc.Staging = 1.0 / 32
	}
	cc.Evict = s.onPolicyEvict
	cc.Keys = s.ix.KeysOf
	cc.Reject = s.onPolicyReject
	cc.EvictRange = s.onEvictRange
	t, err := newCPUTier(cc, cfg.CPUArenaDir)
	if err != nil {
		return nil, fmt.Errorf("cpu tier: %w", err)
	}
	s.cpu = t
	if err := s.dma.SetArena(t.Mem()); err != nil {
		t.Close()
		return nil, fmt.Errorf("copy engine %s: %w", s.dma.Name(), err)
	}
	s.registerGauges(cfg.Registerer)
	if cfg.Disk != nil {
		// Twice the I/Os a file keeps in flight: enough to keep its
		// workers busy, and all a demotion burst puts in its queue.
		depth := cfg.Disk.QueueDepth
		if depth == 0 {
			depth = disk.DefaultQueueDepth
		}
		s.writeRoom = 2 * depth
		s.cl = newCleaning(s, cfg.Registerer)
		if err := s.openDisk(*cfg.Disk, cfg.WriteThrough, cfg.Registerer); err != nil {
			s.dma.SetArena(nil)
			t.Close()
			return nil, err // it names the disk tier already
		}
		if !cfg.WriteThrough {
			s.cleanBacklog = s.writeRoom * len(cfg.Disk.Dirs)
			s.reaper.Add(1)
			go s.cleaner()
		}
	} else {
		s.rec.done = make(chan struct{})
		close(s.rec.done)
	}
	// After the disk tier's namespaces are back, before any CPU slot is
	// taken.
	s.startCPURecovery(cfg.Registerer, cfg.CPURecoveryHook)
	if cfg.Remote != nil {
		if err := s.openRemote(*cfg.Remote, cfg.Registerer); err != nil {
			s.Close()
			return nil, err
		}
	}
	s.mu.Lock()
	s.mu.started = true
	s.mu.Unlock()
	s.reaper.Add(1)
	go s.reapLeases()
	return s, nil
}

func (s *Service) registerGauges(reg prometheus.Registerer) {
	if reg == nil {
		return
	}
	tier := prometheus.Labels{"tier": "cpu"}
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_tier_capacity_bytes", Help: "Bytes a tier can hold.", ConstLabels: tier},
			func() float64 { return float64(s.cpu.Capacity()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_tier_used_bytes", Help: "Bytes of a tier's slots in use.", ConstLabels: tier},
			func() float64 { u, _ := s.cpu.Usage(); return float64(u) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_cpu_arena_backed_bytes",
			Help: "Bytes of the CPU arena backed by memory so far (populated in the background after start); equal to the tier's capacity once done. Until then a store into the rest faults its pages in itself."},
			func() float64 { return float64(s.cpu.BackedBytes()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_tier_blocks", Help: "Blocks held in a tier's slots.", ConstLabels: tier},
			func() float64 { _, b := s.cpu.Usage(); return float64(b) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_pinned_slots", Help: "Slots pinned by loads, stores in flight and leases.", ConstLabels: tier},
			func() float64 { return float64(s.cpu.Pinned()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_copy_queue_depth", Help: "Copy batches submitted to the copy engine and not yet drained."},
			func() float64 { return float64(s.dma.QueueDepth()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_index_entries", Help: "Entries in the block index."},
			func() float64 { return float64(s.ix.Len()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_event_subscribers", Help: "Event streams open (WatchEvents and the --events-zmq publisher)."},
			func() float64 { return float64(s.ev.Subscribers()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvoffload_events_lost_total", Help: "Times an event subscriber fell behind the buffer and started over from a snapshot."},
			func() float64 { return float64(s.ev.Lost()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvoffload_event_snapshot_paused_seconds_total", Help: "Time event snapshots paused to leave the CPU to Lookups (docs/events.md)."},
			func() float64 { return s.ev.Paused().Seconds() }),
	)
}

// Events is the stream of what the tiers hold (docs/events.md).
func (s *Service) Events() *events.Hub { return s.ev }

// CPU exposes the CPU tier (for stats and tests).
func (s *Service) CPU() *cpu.Tier { return s.cpu }

// Disk exposes the disk tier, nil without one (for stats and tests).
func (s *Service) Disk() *disk.Tier { return s.disk }

// Register maps a client's regions and joins or creates its namespace.
func (s *Service) Register(fingerprint []byte, l layout.Layout, specs []dma.RegionSpec, peer dma.Peer, name string) (*Registration, bool, error) {
	if len(fingerprint) == 0 || len(fingerprint) > s.lim.MaxFingerprint {
		return nil, false, fmt.Errorf("%w: fingerprint is %d bytes, want 1..%d", ErrInvalid, len(fingerprint), s.lim.MaxFingerprint)
	}
	if err := l.Validate(); err != nil {
		return nil, false, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if len(specs) != len(l.Segments) {
		return nil, false, fmt.Errorf("%w: regions has %d entries, layout.segments has %d", ErrInvalid, len(specs), len(l.Segments))
	}
	if len(name) > s.lim.MaxClientName {
		return nil, false, fmt.Errorf("%w: client_name is %d bytes, at most %d", ErrInvalid, len(name), s.lim.MaxClientName)
	}
	for i, sp := range specs {
		if len(sp.ShmPath) > s.lim.MaxRegionName || (sp.CUDA != nil && len(sp.CUDA.Handle) > s.lim.MaxRegionName) {
			return nil, false, fmt.Errorf("%w: regions[%d] names its memory in more than %d bytes", ErrInvalid, i, s.lim.MaxRegionName)
		}
	}
	if err := s.reserve(peer, len(specs)); err != nil {
		return nil, false, err
	}
	registered := false
	defer func() {
		if !registered {
			s.mu.Lock()
			s.unreserveLocked(peer.UID, len(specs))
			s.mu.Unlock()
		}
	}()
	opened := make([]dma.Region, 0, len(specs))
	closeAll := func() {
		for _, r := range opened {
			r.Close()
		}
	}
	for i, sp := range specs {
		sp.SegmentBytes = l.Segments[i].Bytes
		specs[i] = sp
		if _, err := sp.Span(); err != nil {
			closeAll()
			return nil, false, fmt.Errorf("%w: regions[%d]: %v", ErrInvalid, i, err)
		}
		r, err := s.dma.Open(sp, peer)
		if err != nil {
			closeAll()
			return nil, false, fmt.Errorf("regions[%d]: %w", i, err)
		}
		opened = append(opened, r)
	}
	regions, err := layout.NewRegions(l, specs, opened)
	if err != nil {
		closeAll()
		return nil, false, fmt.Errorf("%w: %v", ErrInvalid, err)
	}

	// A new namespace goes into the arena's catalog once s.mu is let go
	// (the file is not written under the lock every Lookup takes), before
	// this Register returns, so before any store of it.
	var saveCPU *Namespace
	defer func() {
		if saveCPU != nil {
			s.saveCPUNamespace(saveCPU)
		}
	}()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.closing {
		closeAll()
		return nil, false, ErrShuttingDown
	}
	ns, joined := s.mu.byPrint[string(fingerprint)]
	if joined && !ns.Layout.Equal(l) {
		closeAll()
		return nil, false, fmt.Errorf("%w: namespace %d", ErrLayoutMismatch, ns.ID)
	}
	if !joined {
		var err error
		ns, err = s.newNamespaceLocked(fingerprint, l)
		if errors.Is(err, ErrLimit) {
			// Empty namespaces may be holding the room (or the block
			// sizes): drop them now rather than refuse.
			s.sweepNamespacesLocked(true)
			ns, err = s.newNamespaceLocked(fingerprint, l)
		}
		if err != nil {
			closeAll()
			if errors.Is(err, ErrLimit) {
				return nil, false, err
			}
			return nil, false, fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		if err := s.saveNamespace(ns); err != nil {
			// Blocks of it could not come back after a restart; refuse
			// rather than cache what the disk cannot name.
			s.dropNamespaceLocked(ns)
			closeAll()
			return nil, false, fmt.Errorf("recording the namespace in the disk tier's catalog: %w", storageError(err))
		}
		saveCPU = ns
	}
	ns.regs++
	s.mu.nextReg++
	r := newRegistration(s, s.mu.nextReg, ns, regions, peer, name)
	s.mu.regs[r.ID] = r
	s.m.regs.Inc()
	s.log.Info("registered", "registration", r.ID, "namespace", ns.ID, "joined", joined, "client", name,
		"peer_pid", peer.PID, "peer_uid", peer.UID, "regions", len(specs), "groups", l.NumGroups())
	registered = true
	return r, joined, nil
}

// Resolve returns the namespace id of each fingerprint, 0 where none.
func (s *Service) Resolve(fingerprints [][]byte) ([]uint32, error) {
	if len(fingerprints) > s.lim.MaxNamespaces {
		return nil, fmt.Errorf("%w: fingerprints has %d entries, at most %d", ErrInvalid, len(fingerprints), s.lim.MaxNamespaces)
	}
	out := make([]uint32, len(fingerprints))
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	for i, f := range fingerprints {
		if len(f) > s.lim.MaxFingerprint {
			return nil, fmt.Errorf("%w: fingerprints[%d] is %d bytes, at most %d", ErrInvalid, i, len(f), s.lim.MaxFingerprint)
		}
		if ns, ok := s.mu.byPrint[string(f)]; ok {
			out[i] = ns.ID
			if ns.regs == 0 {
				ns.idleSince = now // a scheduler still uses it
			}
		}
	}
	return out, nil
}

// newNamespaceLocked creates a namespace with its tiers' classes. Past
// Limits.MaxNamespacesTotal or the tiers' block sizes the error wraps
// ErrLimit. (Namespaces brought back from the disk at start are not
// counted against the total: their blocks are there already.)
func (s *Service) newNamespaceLocked(fingerprint []byte, l layout.Layout) (*Namespace, error) {
	if s.mu.nextNS == math.MaxUint32 {
		return nil, fmt.Errorf("%w: every namespace id has been given out; restart the daemon", ErrLimit)
	}
	if s.mu.started && len(s.mu.byID) >= s.lim.MaxNamespacesTotal {
		return nil, fmt.Errorf("%w: the daemon keeps %d namespaces, at most %d (a namespace goes when it has no registration and no cached block)", ErrLimit, len(s.mu.byID), s.lim.MaxNamespacesTotal)
	}
	ns := &Namespace{Fingerprint: bytes.Clone(fingerprint), Layout: l}
	for g := uint32(0); g < l.NumGroups(); g++ {
		c, err := s.cpu.Class(l.SlotBytes(g))
		if err != nil {
			ns.dropClasses()
			return nil, classErr(fmt.Errorf("group %d: %w", g, err))
		}
		ns.classes = append(ns.classes, c)
		if s.disk != nil {
			c, err := s.disk.Class(disk.SlotBytes(l.PayloadBytes(g)))
			if err != nil {
				ns.dropClasses()
				return nil, classErr(fmt.Errorf("group %d: disk tier: %w", g, err))
			}
			ns.diskClasses = append(ns.diskClasses, c)
		}
	}
	s.mu.nextNS++
	ns.ID = s.mu.nextNS
	ns.idleSince = time.Now()
	s.mu.byID[ns.ID] = ns
	s.mu.byPrint[string(fingerprint)] = ns
	s.ev.SetHashLen(ns.ID, l.HashBytes)
	s.m.namespaces.Inc()
	return ns, nil
}

// classErr marks running out of block sizes as a limit.
func classErr(err error) error {
	if errors.Is(err, slots.ErrTooManyClasses) {
		return fmt.Errorf("%w: %v", ErrLimit, err)
	}
	return err
}

// dropClasses gives back the namespace's references to its classes.
func (ns *Namespace) dropClasses() {
	for _, c := range ns.classes {
		c.Drop()
	}
	for _, c := range ns.diskClasses {
		c.Drop()
	}
	ns.classes, ns.diskClasses = nil, nil
}

// dropNamespaceLocked forgets a namespace: no registration names it and
// the index holds none of its blocks. Its id is not given out again.
func (s *Service) dropNamespaceLocked(ns *Namespace) {
	delete(s.mu.byID, ns.ID)
	delete(s.mu.byPrint, string(ns.Fingerprint))
	s.ev.SetHashLen(ns.ID, 0)
	ns.dropClasses()
	s.m.namespaces.Dec()
	s.cpu.DroppedNamespace() // the arena's catalog drops it at its next rewrite
}

// sweepNamespaces drops the namespaces with no registration and no cached
// block that have lingered long enough.
func (s *Service) sweepNamespaces() {
	s.mu.Lock()
	s.sweepNamespacesLocked(false)
	s.mu.Unlock()
	s.compactCPUCatalog()
}

// sweepNamespacesLocked drops empty namespaces; now drops them however
// recently they emptied (the daemon is short of room for a new one).
func (s *Service) sweepNamespacesLocked(now bool) {
	if s.mu.closed {
		return
	}
	t := time.Now()
	for _, ns := range s.mu.byID {
		if ns.regs > 0 || ns.recovering || ns.cpuRecovering || (!now && t.Sub(ns.idleSince) < s.linger) {
			continue
		}
		// New entries of ns need a registration of ns (a store) or the
		// disk tier's recovery, both excluded here: the count stays 0.
		if s.ix.CountNS(ns.ID) == 0 {
			s.log.Info("namespace dropped: no registration and no cached block", "namespace", ns.ID)
			s.dropNamespaceLocked(ns)
		}
	}
}

// Registration looks up a live registration.
func (s *Service) Registration(id uint64) (*Registration, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.mu.regs[id]
	if !ok {
		return nil, fmt.Errorf("%w: registration_id %d", ErrUnknownRegistration, id)
	}
	return r, nil
}

// Unregister refuses the registration's new jobs, waits for its jobs to
// drain, then unmaps its regions and forgets it. Until then Completions
// still answers for it, so a client that reconnects can tell when the old
// registration's copies have all landed. Cached blocks stay.
func (s *Service) Unregister(id uint64) error {
	s.mu.Lock()
	r, ok := s.mu.regs[id]
	s.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: registration_id %d", ErrUnknownRegistration, id)
	}
	if !r.close() {
		return fmt.Errorf("%w: registration_id %d is already being unregistered", ErrUnknownRegistration, id)
	}
	s.mu.Lock()
	delete(s.mu.regs, id)
	r.ns.regs--
	if r.ns.regs == 0 {
		r.ns.idleSince = time.Now()
	}
	s.m.regs.Dec()
	s.unreserveLocked(r.peer.UID, len(r.reg.Opened))
	s.mu.Unlock()
	s.log.Info("unregistered", "registration", id, "namespace", r.ns.ID)
	return nil
}

func (s *Service) namespaces(ids []uint32) ([]*Namespace, error) {
	if len(ids) == 0 {
		return nil, fmt.Errorf("%w: namespace_ids is empty", ErrInvalid)
	}
	if len(ids) > s.lim.MaxNamespaces {
		return nil, fmt.Errorf("%w: namespace_ids has %d entries, at most %d", ErrInvalid, len(ids), s.lim.MaxNamespaces)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Namespace, len(ids))
	now := time.Now()
	for i, id := range ids {
		ns, ok := s.mu.byID[id]
		if !ok {
			return nil, fmt.Errorf("%w: namespace_ids[%d] = %d", ErrUnknownNamespace, i, id)
		}
		if ns.regs == 0 {
			ns.idleSince = now // a scheduler still uses it
		}
		out[i] = ns
		if i > 0 && out[i].Layout.HashBytes != out[0].Layout.HashBytes {
			return nil, fmt.Errorf("%w: namespace_ids[%d] uses %d-byte hashes, namespace_ids[0] %d-byte", ErrInvalid, i, out[i].Layout.HashBytes, out[0].Layout.HashBytes)
		}
	}
	return out, nil
}

// Keys is one group's ordered keys, hashes packed back to back.
type Keys struct {
	Group  uint32
	Hashes []byte
}

// count checks the packing against the namespace's hash length.
func (k Keys) count(hashBytes, maxKeys int, field string) (int, error) {
	if len(k.Hashes)%hashBytes != 0 {
		return 0, fmt.Errorf("%w: %s.hashes is %d bytes, not a multiple of the namespace's %d-byte hash", ErrInvalid, field, len(k.Hashes), hashBytes)
	}
	n := len(k.Hashes) / hashBytes
	if n > maxKeys {
		return 0, fmt.Errorf("%w: %s has %d keys, at most %d per request", ErrInvalid, field, n, maxKeys)
	}
	return n, nil
}

func makeKey(ns uint32, group uint32, hash []byte) index.Key {
	k := index.Key{NS: ns, Group: group}
	copy(k.Hash[:], hash)
	return k
}

// LookupResult is the answer to a Lookup.
type LookupResult struct {
	Ready   int
	Tiers   []Tier
	LeaseID uint64
}

// Tier is where a ready block is.
type Tier uint8

// Tiers, numbered as the wire's.
const (
	TierNone Tier = iota
	TierCPU
	TierDisk
	TierCPUAndDisk
	// TierRemote: no local tier holds the block; the shared remote tier
	// does (it cannot be pinned: gone by load time, it is MISSING).
	TierRemote
)

// Lookup counts the leading keys ready in every namespace. With a lease it
// also pins that prefix until the lease ends; the lease is owner's.
func (s *Service) Lookup(owner Owner, nsIDs []uint32, keys Keys, leaseFor time.Duration, peek bool) (LookupResult, error) {
	s.ev.Demand() // a snapshot streamed meanwhile leaves it the CPU
	nss, err := s.namespaces(nsIDs)
	if err != nil {
		return LookupResult{}, err
	}
	hb := nss[0].Layout.HashBytes
	n, err := keys.count(hb, s.lim.MaxKeysPerLookup, "keys")
	if err != nil {
		return LookupResult{}, err
	}
	for i, ns := range nss {
		if keys.Group >= uint32(len(ns.classes)) {
			return LookupResult{}, fmt.Errorf("%w: keys.group %d, namespace_ids[%d] has %d groups", ErrInvalid, keys.Group, i, len(ns.classes))
		}
	}
	if leaseFor > s.lim.MaxLease {
		return LookupResult{}, fmt.Errorf("%w: lease_ms %d exceeds the longest lease, %d ms", ErrInvalid, leaseFor.Milliseconds(), s.lim.MaxLease.Milliseconds())
	}
	s.m.lookups.Inc()
	s.c.lookups.Add(1)
	res := LookupResult{Tiers: make([]Tier, 0, n)}
	var ls *lease
	if leaseFor > 0 {
		ls = &lease{}
		s.inval.RLock()
	}
	// Every key looked up counts as an access for the admission policy,
	// hit or not: that is how a prefix many requests want earns its place
	// before its first store, and a one-off prompt does not.
	var touched [][]uint64
	if !peek {
		touched = make([][]uint64, len(nss))
		for j := range touched {
			touched[j] = make([]uint64, 0, n)
		}
	}
	ready := true
	// The pins taken for the key being looked at: if one namespace lacks
	// it, those are dropped again, so the lease pins the prefix and
	// nothing past it.
	var took []index.Key
	for i := 0; i < n && (ready || touched != nil); i++ {
		hash := keys.Hashes[i*hb : (i+1)*hb]
		tier := TierNone
		took = took[:0]
		for j, ns := range nss {
			k := makeKey(ns.ID, keys.Group, hash)
			h := index.HashKey(&k)
			if touched != nil {
				touched[j] = append(touched[j], h)
			}
			if !ready {
				continue // past the ready prefix: only counting accesses
			}
			if ls == nil {
				e, found := s.ix.GetHashed(&k, h)
				ready = found && e.Offerable()
				tier = slowest(tier, j, e)
				continue
			}
			s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
				if !found || !e.Offerable() {
					ready = false
					return found
				}
				// A slot at its pin ceiling ends the prefix.
				fresh, ok := ls.pin(s, k, e)
				ready = ok
				if fresh {
					took = append(took, k)
				}
				if ready {
					tier = slowest(tier, j, *e)
				}
				return true
			})
		}
		if ready {
			res.Ready++
			res.Tiers = append(res.Tiers, tier)
		} else {
			for _, k := range took {
				if p, ok := ls.take(k); ok {
					s.unpin(p)
				}
			}
		}
	}
	for j, ns := range nss {
		if touched != nil {
			ns.classes[keys.Group].Touch(touched[j])
		}
	}
	if ls != nil {
		// The lease is filed under s.inval, so no lease keeps a block an
		// Invalidate removed; with no prefix there is no lease (and no
		// pin: the first key's were dropped).
		if res.Ready > 0 {
			res.LeaseID, err = s.addLease(ls, owner, leaseFor)
		}
		s.inval.RUnlock()
		if err != nil {
			return LookupResult{}, err
		}
	}
	// The remote tier's round trip runs outside s.inval: an Invalidate
	// (and the leasing Lookups queued behind it) never waits for the
	// store. The lease pins the local prefix only: remote blocks cannot
	// be pinned.
	if s.rem != nil && res.Ready < n {
		s.rem.extendLookup(nss, keys, n, &res)
	}
	if res.Ready < n {
		s.m.lookupBlocks.WithLabelValues("miss").Inc()
	}
	s.m.lookupBlocks.WithLabelValues("hit").Add(float64(res.Ready))
	s.c.lookupHits.Add(uint64(res.Ready))
	return res, nil
}

// slowest combines where a key is in namespace j with where it is in the
// namespaces before: the slowest tier wins (a copy only on disk must be read
// from disk, whatever the other ranks have).
func slowest(t Tier, j int, e index.Entry) Tier {
	var here Tier
	switch {
	case e.CPU != index.NoSlot && e.Disk != index.NoSlot:
		here = TierCPUAndDisk
	case e.CPU != index.NoSlot:
		here = TierCPU
	case e.Disk != index.NoSlot:
		here = TierDisk
	}
	if j == 0 {
		return here
	}
	rank := func(t Tier) int { return [...]int{TierNone: 0, TierDisk: 1, TierCPU: 2, TierCPUAndDisk: 3}[t] }
	if rank(here) < rank(t) {
		return here
	}
	return t
}

// Invalidate drops every block of the namespaces; with keys, only those.
// Once it returns nothing of them is offered or loaded until stored again:
// the leases' pins on them go too (a lease may pin a block the index has
// already dropped), and their disk copies are erased once no load reads
// them any more.
func (s *Service) Invalidate(nsIDs []uint32, keys *Keys) (int, error) {
	nss, err := s.namespaces(nsIDs)
	if err != nil {
		return 0, err
	}
	n, hb := 0, nss[0].Layout.HashBytes
	if keys != nil {
		if n, err = keys.count(hb, s.lim.MaxKeysPerLookup, "keys"); err != nil {
			return 0, err
		}
		for _, ns := range nss {
			if keys.Group >= uint32(len(ns.classes)) {
				return 0, fmt.Errorf("%w: keys.group %d, namespace %d has %d groups", ErrInvalid, keys.Group, ns.ID, len(ns.classes))
			}
		}
	}
	if keys == nil {
		// Refused before anything goes: the remote tier could not
		// keep the fences this would need.
		if err := s.rem.canFenceWhole(nss); err != nil {
			return 0, err
		}
	}
	ids := make([]uint32, len(nss))
	for i, ns := range nss {
		ids[i] = ns.ID
	}
	var ks []index.Key // nil: the whole namespaces
	if keys != nil {
		ks = make([]index.Key, 0, n*len(nss))
		for _, ns := range nss {
			for i := 0; i < n; i++ {
				ks = append(ks, makeKey(ns.ID, keys.Group, keys.Hashes[i*hb:(i+1)*hb]))
			}
		}
	}
	// Before any entry goes: copies the tiers' recoveries have not
	// reached yet must not come back after this call (recover.go; the
	// arena's clears their records now, tiers/cpu/ledger.go).
	s.rec.tombs.Add(ids, ks)
	s.cpu.Invalidating(ids, ks)
	var dropped []index.Key
	var want map[index.Key]struct{}
	all := map[uint32]bool{}
	if keys == nil {
		for _, ns := range nss {
			all[ns.ID] = true
		}
		// Subscribers learn one reset of each namespace, not a removal
		// per block.
		s.ev.BeginReset(ids)
	} else {
		want = make(map[index.Key]struct{}, len(ks))
		for _, k := range ks {
			want[k] = struct{}{}
		}
	}
	s.inval.Lock()
	if keys == nil {
		s.ix.Range(func(k *index.Key, e *index.Entry) bool {
			if !all[k.NS] {
				return true
			}
			s.dropEntryLocked(e)
			dropped = append(dropped, *k)
			return false
		})
	} else {
		for k := range want {
			s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
				if found {
					s.dropEntryLocked(e)
					dropped = append(dropped, k)
				}
				return false
			})
		}
	}
	s.voidLeases(all, want)
	rinv := s.rem.fenceInvalidated(nss, want) // nil without a remote tier
	if keys == nil {
		// After fenceInvalidated's Cancel of the namespaces' publishes:
		// no acknowledgement of one is reported after the reset.
		s.ev.EndReset(ids)
	}
	// Every disk write submitted so far is named below the clock, and no
	// later one is of these keys' old entries (the demoter submits under
	// inval too): the mark covers every copy they left on disk.
	var clock uint64
	if s.disk != nil {
		clock = s.disk.WriteClock() + 1
	}
	s.inval.Unlock()
	unrecorded, remErr := rinv.Reach()
	s.forget(dropped)
	s.m.evictions.WithLabelValues("cpu", "invalidate").Add(float64(len(dropped)))
	if keys == nil {
		want = nil
	}
	if err := s.markInvalidated(nss, want, clock); err != nil {
		return len(dropped), err
	}
	if remErr != nil {
		s.log.Error("an invalidation's deletes from the remote tier still to go through could not be recorded on disk: after a restart this node may load those blocks from the cluster", "err", remErr)
		return len(dropped), storageError(fmt.Errorf("the blocks are invalidated, but recording their deletes from the remote tier still to go through failed (after a restart this node may load them from the cluster): %w", remErr))
	}
	if unrecorded != nil {
		// Not OK: the other nodes of the fleet may still load the
		// blocks until the records are written (docs/api.md).
		return len(dropped), unrecorded
	}
	return len(dropped), nil
}

// dropEntryLocked lets go of an entry's slots; the caller holds the entry's
// index lock and removes the entry. A disk copy is also erased on disk, so
// an invalidated block does not come back after a restart (discardLocked).
func (s *Service) dropEntryLocked(e *index.Entry) {
	if e.CPU != index.NoSlot {
		s.cpu.Release(e.CPU)
		e.CPU = index.NoSlot
	}
	if e.Disk != index.NoSlot {
		s.discardLocked(e.Disk)
		e.Disk = index.NoSlot
	}
}

// discardLocked releases disk slot d, which the caller just removed from
// the index, and has its header erased so the block does not come back
// after a restart. The erase waits for the slot's pins: a load still
// reading it reads the block whole, and the zeros never fall on a block
// written there later (the slot is freed only once they have landed).
func (s *Service) discardLocked(d slots.SlotID) {
	s.disk.Void(d)
}

// eraseDiskSlot is the disk space's eraser (slots.Space.SetEraser): it
// zeroes the header of a void slot, which it holds pinned, and unpins it
// (freeing it) once the zeros are down. FlushDisk waits for it.
func (s *Service) eraseDiskSlot(d slots.SlotID) {
	s.diskWrites.Add(1)
	s.disk.Discard(d, func() {
		s.disk.Unpin(d)
		s.diskWrites.Add(-1)
	})
}

// dropCopiesLocked lets go of an entry's slots without erasing its disk
// copy (the bytes there are still the block's; only the index forgets
// them). The caller holds the entry's index lock and removes the entry; a
// disk write in flight finds the entry gone and releases its own slot.
func (s *Service) dropCopiesLocked(e *index.Entry) {
	if e.CPU != index.NoSlot {
		s.cpu.Release(e.CPU)
		e.CPU = index.NoSlot
	}
	if e.Disk != index.NoSlot {
		s.disk.Release(e.Disk)
		e.Disk = index.NoSlot
	}
}

// forget tells the policies about keys whose copies the index dropped for
// reasons of our own (forgetCPU, forgetDisk).
func (s *Service) forget(keys []index.Key) {
	for i := range keys {
		if ns := s.nsByID(keys[i].NS); ns != nil {
			s.forgetCPU(ns.classes[keys[i].Group], &keys[i])
			if ns.diskClasses != nil {
				s.forgetDisk(ns.diskClasses[keys[i].Group], &keys[i])
			}
		}
	}
}

// forgetCPU takes k out of CPU class c's policy after the index let go of
// k's CPU copy. The policy and the index change together by construction:
// a copy of k made since (a store that claimed the key again, a load
// promoting it) made its own Admit, perhaps before this Forget, so a key
// the index holds again once the Forget is done is learnt again; one
// claimed after the look admits itself after the Forget. A block left
// untracked would never be evicted (the CPU tier would fill up for good).
// The policy is never called under the index's locks (its callbacks take
// them).
func (s *Service) forgetCPU(c *slots.Class, k *index.Key) {
	c.Forget(k)
	if e, ok := s.ix.Get(k); ok && (e.State == index.Writing || e.CPU != index.NoSlot || e.Flags&index.Promoting != 0) {
		c.Learn([]index.Key{*k})
	}
}

// forgetDisk is forgetCPU for disk class c: a disk copy of k made (or
// being written) since is learnt again.
func (s *Service) forgetDisk(c *slots.Class, k *index.Key) {
	c.Forget(k)
	if e, ok := s.ix.Get(k); ok && (e.Disk != index.NoSlot || e.Flags&index.DiskWriting != 0) {
		c.Learn([]index.Key{*k})
	}
}

// nsByID finds a namespace; nil once it is dropped.
func (s *Service) nsByID(id uint32) *Namespace {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.byID[id]
}

// onPolicyEvict runs on the goroutine of the CPU policy's Admit or Learn for
// each key it evicted.
// Without a disk tier the block goes. With one (write-back) a ready block
// that is not on disk yet is queued for the disk and stays readable from its
// CPU slot until the write lands.
func (s *Service) onPolicyEvict(k index.Key) {
	dropped := false
	s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
		switch {
		case !found:
			return false
		case e.CPU == index.NoSlot:
			// A store claimed but not yet given a slot goes to the disk
			// tier if there is one, else it goes and its store reports
			// it rejected. A disk-only block stays, and a load promoting
			// it no longer keeps it in the CPU tier.
			e.Flags &^= index.Promoting
			if e.State == index.Writing && s.disk != nil {
				e.Flags |= index.Spill
				return true
			}
			return e.State == index.Ready
		case s.disk != nil && !s.writeThrough && e.State == index.Ready && e.Disk == index.NoSlot && e.Flags&index.DiskWriting == 0:
			if s.cpu.Pin(e.CPU) {
				if s.demote(demotion{key: k, cpuSlot: e.CPU}) {
					e.Flags |= index.DiskWriting
					return true
				}
				s.cpu.Unpin(e.CPU)
			}
		}
		// The CPU copy goes (a disk write in flight holds its own pin).
		s.cpu.Release(e.CPU)
		e.CPU = index.NoSlot
		dropped = true
		return e.State == index.Ready && e.Holds()
	})
	if dropped {
		s.m.evictions.WithLabelValues("cpu", "policy").Inc()
		s.c.evictions.Add(1)
	}
}

// onPolicyReject runs for a key the CPU policy declined: a store that has
// not taken a slot yet spills to the disk tier (or, without one, drops its
// claim); a load promoting the block from disk keeps it out of the CPU tier.
func (s *Service) onPolicyReject(k index.Key) {
	s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
		switch {
		case !found:
			return false
		case e.State == index.Writing && e.CPU == index.NoSlot:
			// A store the CPU tier will not keep may still earn a place
			// on disk: it is staged in a CPU slot and written there.
			if s.disk != nil {
				e.Flags |= index.Spill
				return true
			}
			return false
		case e.Flags&index.Promoting != 0:
			e.Flags &^= index.Promoting
		case e.State == index.Ready && e.CPU != index.NoSlot && e.Flags&(index.DiskWriting|index.Spill) == 0:
			// Brought back from a persistent arena (Learn,
			// cpu_recover.go) past the class's share: the policy never
			// evicts what it does not track, so it leaves the CPU tier.
			s.cpu.Release(e.CPU)
			e.CPU = index.NoSlot
			return e.Holds()
		}
		return true
	})
}

// onEvictRange drops the CPU copies in a chunk the CPU tier is moving to
// another slot size.
func (s *Service) onEvictRange(lo, hi cpu.SlotID) {
	s.evictRange("cpu", s.cpu.Space, lo, hi, func(e *index.Entry) *uint32 { return &e.CPU },
		func(ns *Namespace) []*slots.Class { return ns.classes })
}

// evictRange drops the copies one tier holds in slots [lo, hi): the tier
// is giving that chunk to another slot size. An entry left with no copy
// goes.
func (s *Service) evictRange(tier string, sp *slots.Space, lo, hi slots.SlotID, slot func(*index.Entry) *uint32, classes func(*Namespace) []*slots.Class) {
	var dropped []index.Key
	s.ix.Range(func(k *index.Key, e *index.Entry) bool {
		p := slot(e)
		if *p == index.NoSlot || *p < lo || *p >= hi {
			return true
		}
		sp.Release(*p)
		*p = index.NoSlot
		dropped = append(dropped, *k)
		return e.State == index.Ready && e.Holds()
	})
	for i := range dropped {
		if ns := s.nsByID(dropped[i].NS); ns != nil {
			classes(ns)[dropped[i].Group].Forget(&dropped[i])
		}
	}
	s.m.evictions.WithLabelValues(tier, "rebalance").Add(float64(len(dropped)))
	s.c.evictions.Add(uint64(len(dropped)))
}

// BeginShutdown refuses new work from now on, and tells the disk tier's
// recovery to stop after the reads in flight (Close waits for that).
func (s *Service) BeginShutdown() {
	s.mu.Lock()
	s.mu.closing = true
	s.mu.Unlock()
	s.closingOnce.Do(func() { close(s.closing) })
	if s.disk != nil {
		s.disk.StopRecovery()
	}
}

// Drain waits until every accepted job has finished, or ctx ends.
func (s *Service) Drain(ctx context.Context) error {
	done := make(chan struct{})
	go func() { s.jobs.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("jobs still running: %w", ctx.Err())
	}
}

// Undelivered counts the open registrations holding a finished result
// that no reply has carried yet.
func (s *Service) Undelivered() int {
	s.mu.Lock()
	regs := make([]*Registration, 0, len(s.mu.regs))
	for _, r := range s.mu.regs {
		regs = append(regs, r)
	}
	s.mu.Unlock()
	n := 0
	for _, r := range regs {
		if r.undelivered() {
			n++
		}
	}
	return n
}

// WaitDelivered waits, once the jobs have drained, until Undelivered is 0
// or ctx ends, and returns it. A stopping daemon waits for it before it
// closes its connections, so that a client reading Completions learns the
// outcome of every job the drain finished.
func (s *Service) WaitDelivered(ctx context.Context) int {
	for {
		n := s.Undelivered()
		if n == 0 {
			return 0
		}
		select {
		case <-s.read:
		case <-ctx.Done():
			return s.Undelivered()
		}
	}
}

// signalRead wakes WaitDelivered.
func (s *Service) signalRead() {
	select {
	case s.read <- struct{}{}:
	default:
	}
}

// Close refuses new work, waits for every job, unmaps every registration,
// releases leases and unmaps the arena. The copy engine must be closed
// after it. Close may be called more than once.
func (s *Service) Close() error {
	s.BeginShutdown()
	s.jobs.Wait()
	s.mu.Lock()
	if s.mu.closed {
		s.mu.Unlock()
		return nil
	}
	s.mu.closed = true
	regs := s.mu.regs
	s.mu.regs = map[uint64]*Registration{}
	s.mu.Unlock()
	close(s.stop)
	// The CPU tier's recovery files blocks in the index and the
	// policies: it ends with the other background work.
	s.cpu.StopRecovery()
	s.reaper.Wait()
	<-s.cpu.RecoveryDone()
	for _, r := range regs {
		r.close()
	}
	s.m.regs.Set(0)
	s.releaseLeases(func(*lease) bool { return true })
	var remErr, diskErr error
	if s.rem != nil {
		// Publishes still queued hold pins on CPU slots: dropped here.
		remErr = s.rem.close()
	}
	if s.disk != nil {
		s.dropQueuedDemotions()
		// Drains the disk writes in flight (their callbacks touch the
		// arena and the index), syncs and closes the files.
		diskErr = s.disk.Close()
	}
	// The copy engine lets go of the arena (CUDA: unregisters the pinned
	// pages) while it is still mapped.
	arenaErr := s.dma.SetArena(nil)
	return errors.Join(remErr, diskErr, arenaErr, s.cpu.Close())
}
