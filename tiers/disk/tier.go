package disk

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// Config shapes a disk tier.
type Config struct {
	// Dirs are the directories holding one slot file each; a tier
	// stripes its chunks across them (one directory per NVMe device).
	Dirs []string
	// BytesPerDir is the size of each slot file, rounded down to whole
	// chunks.
	BytesPerDir uint64
	// ChunkBytes is the unit of the space that serves one slot size, and
	// so the largest slot; 0 picks slots.DefaultChunkBytes(BytesPerDir).
	ChunkBytes uint64
	// FS is the filesystem seam; nil is vfs.Default. The daemon passes an
	// errorfs wrapper when --fault-spec is set.
	FS vfs.FS
	// Direct opens the slot files with O_DIRECT (the daemon probes each
	// directory with vfs.ProbeDirect first and decides).
	Direct bool
	// Reset starts empty: what the files hold is ignored and will be
	// overwritten, and never comes back at a later start.
	Reset bool
	// QueueDepth is how many I/Os each file has in flight: the number of
	// I/O workers per file. 0 means 8.
	QueueDepth int
	// Reserve is passed to slots.Config.
	Reserve float64
	Logger  *slog.Logger
	// Registerer receives the tier's metrics; nil registers none.
	Registerer prometheus.Registerer
	// Evict, Reject, Keys and EvictRange are the disk tier's policy
	// callbacks; see slots.Config.
	Evict, Reject func(index.Key)
	Keys          func(h uint64, into []index.Key) []index.Key
	EvictRange    func(lo, hi slots.SlotID)
}

// DefaultQueueDepth is the I/Os in flight per file when Config.QueueDepth
// is 0. NVMe devices reach their bandwidth with a few large transfers in
// flight.
const DefaultQueueDepth = 8

// maxQueueDepth bounds the workers per file.
const maxQueueDepth = 256

// maxSeq is the highest sequence number of an epoch: a slot's write is
// remembered as epoch<<32 | seq, in one word.
const maxSeq = 1<<32 - 1

// Tier is the disk tier. Its Space methods (Class, Alloc, Pin, Unpin,
// Release, Quarantine, Usage, Capacity) manage its slots; Write, Read and
// Discard move blocks. It is safe for concurrent use.
type Tier struct {
	*slots.Space

	cfg        Config
	log        *slog.Logger
	fs         vfs.FS
	files      []*file
	fileBytes  uint64
	chunkBytes uint64
	fileChunks int
	hdrMem     []byte      // one HeaderSize block per I/O worker
	locks      []io.Closer // one per directory, held until Close
	m          *metrics
	seqs       seqTable
	workers    sync.WaitGroup

	writes struct {
		sync.Mutex
		epoch uint32
		seq   uint64
	}
	catalog struct {
		sync.Mutex
		ns map[[32]byte][]byte
	}
	rec recovery

	closeMu sync.Mutex
	closed  bool
}

// file is one slot file and its queue.
type file struct {
	idx  int
	dir  string
	f    vfs.File
	base uint64 // offset of the file's first byte in the space
	q    queue

	mapMu  sync.Mutex
	chunks []chunkEntry // as persisted in the chunk map

	scan *fileScan // its part of recovery
}

// SlotBytes is the size of the disk slot of a payload: the header block
// plus the payload rounded up to layout.SlotAlign. Use it with Class.
func SlotBytes(payload uint64) uint64 { return slot.HeaderSize + layout.AlignUp(payload) }

// Open creates or reopens the slot files, preallocating them, and loads
// the chunk maps and the namespace catalog. It refuses an invalid
// configuration. Every chunk a chunk map names is held until recovery has
// scanned it: call Recover next (after cfg.Reset too: it then has nothing
// to scan and ends at once).
func Open(cfg Config) (*Tier, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	t := &Tier{cfg: cfg, log: cfg.Logger, fs: cfg.FS, chunkBytes: cfg.ChunkBytes}
	t.fileChunks = int(cfg.BytesPerDir / cfg.ChunkBytes)
	t.fileBytes = uint64(t.fileChunks) * cfg.ChunkBytes
	t.catalog.ns = map[[32]byte][]byte{}
	ok := false
	defer func() {
		if !ok {
			t.release()
		}
	}()

	for i, dir := range cfg.Dirs {
		if err := t.fs.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("disk tier: %w", err)
		}
		// Before anything in the directory is read or written: a second
		// daemon would overwrite the first one's slots.
		lock, err := t.fs.Lock(filepath.Join(dir, lockFileName))
		if errors.Is(err, vfs.ErrLocked) {
			return nil, fmt.Errorf("disk tier: directory %s is in use by another kvoffloadd (%w); two daemons on one directory would overwrite each other's slots", dir, err)
		}
		if err != nil {
			return nil, fmt.Errorf("disk tier: lock directory %s: %w", dir, err)
		}
		t.locks = append(t.locks, lock)
		if err := checkFiles(t.fs, dir, i); err != nil {
			return nil, err
		}
	}
	// Before anything is allocated: a tier that does not fit is refused
	// with the files as they were.
	if err := t.checkSpace(); err != nil {
		return nil, err
	}
	for i, dir := range cfg.Dirs {
		path := filepath.Join(dir, slotFileName(i))
		vf, err := t.fs.OpenFile(path, int64(t.fileBytes), cfg.Direct)
		if err != nil {
			return nil, fmt.Errorf("disk tier: open slot file: %w", err)
		}
		t.files = append(t.files, &file{idx: i, dir: dir, f: vf, base: uint64(i) * t.fileBytes})
	}

	// Read every chunk map, even under Reset: the new epoch must exceed
	// every epoch written before.
	lastEpoch := uint32(0)
	for _, f := range t.files {
		m, err := t.loadMap(f)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			t.log.Error("disk tier: chunk map unreadable; this file starts empty and what it held is lost",
				"file", f.f.Name(), "err", err)
		default:
			lastEpoch = max(lastEpoch, m.epoch)
			if !cfg.Reset {
				f.chunks = m.chunks
			}
		}
		if f.chunks == nil {
			f.chunks = make([]chunkEntry, t.fileChunks)
		}
	}
	// The clock covers a lost map: epochs then still grow across starts.
	t.writes.epoch = max(lastEpoch+1, uint32(time.Now().Unix()))
	for _, f := range t.files {
		if err := t.saveMap(f); err != nil {
			return nil, fmt.Errorf("disk tier: save chunk map: %w", err)
		}
	}

	if cfg.Reset {
		if err := t.saveCatalog(t.catalog.ns); err != nil {
			return nil, fmt.Errorf("disk tier: reset namespace catalog: %w", err)
		}
	} else {
		t.loadCatalog()
	}

	sp, err := slots.New(slots.Config{
		Name: "disk", Bytes: uint64(len(t.files)) * t.fileBytes, ChunkBytes: cfg.ChunkBytes,
		Reserve: cfg.Reserve, Logger: cfg.Logger,
		// TinyLFU: a demotion the policy declines is a write not made.
		Policy: slots.TinyLFU,
		Evict:  cfg.Evict, Reject: cfg.Reject, Keys: cfg.Keys, EvictRange: cfg.EvictRange,
	})
	if err != nil {
		return nil, fmt.Errorf("disk tier: %w", err)
	}
	t.Space = sp
	t.seqs.init(sp.Capacity(), cfg.ChunkBytes)
	if err := t.holdMapped(); err != nil {
		return nil, fmt.Errorf("disk tier: %w", err)
	}

	t.hdrMem, err = vfs.AlignedBuffer(len(t.files) * cfg.QueueDepth * slot.HeaderSize)
	if err != nil {
		return nil, fmt.Errorf("disk tier: header buffers: %w", err)
	}
	if t.m, err = newMetrics(cfg.Registerer, t); err != nil {
		return nil, fmt.Errorf("disk tier: metrics: %w", err)
	}

	for i, f := range t.files {
		f.q.init()
		for j := range cfg.QueueDepth {
			k := (i*cfg.QueueDepth + j) * slot.HeaderSize
			t.workers.Add(1)
			go t.worker(f, t.hdrMem[k:k+slot.HeaderSize:k+slot.HeaderSize])
		}
	}
	ok = true
	t.log.Info("disk tier open", "dirs", cfg.Dirs, "file_bytes", t.fileBytes, "chunk_bytes", cfg.ChunkBytes,
		"direct", cfg.Direct, "queue_depth", cfg.QueueDepth, "reset", cfg.Reset, "epoch", t.writes.epoch,
		"namespaces", len(t.catalog.ns))
	return t, nil
}

func (cfg *Config) check() error {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.FS == nil {
		cfg.FS = vfs.Default
	}
	if cfg.QueueDepth == 0 {
		cfg.QueueDepth = DefaultQueueDepth
	}
	if cfg.ChunkBytes == 0 {
		cfg.ChunkBytes = slots.DefaultChunkBytes(cfg.BytesPerDir)
	}
	if len(cfg.Dirs) == 0 {
		return errors.New("disk tier: no directory")
	}
	seen := map[string]bool{}
	for _, d := range cfg.Dirs {
		c := filepath.Clean(d)
		if d == "" || seen[c] {
			return fmt.Errorf("disk tier: directory %q is empty or given twice", d)
		}
		seen[c] = true
	}
	if cfg.QueueDepth < 1 || cfg.QueueDepth > maxQueueDepth {
		return fmt.Errorf("disk tier: queue depth %d, want 1 to %d", cfg.QueueDepth, maxQueueDepth)
	}
	if cfg.ChunkBytes%layout.SlotAlign != 0 || cfg.ChunkBytes < SlotBytes(1) {
		return fmt.Errorf("disk tier: chunk of %d bytes, want a multiple of %d of at least %d", cfg.ChunkBytes, layout.SlotAlign, SlotBytes(1))
	}
	if cfg.ChunkBytes > SlotBytes(slot.MaxPayloadLen) {
		return fmt.Errorf("disk tier: chunk of %d bytes is too large", cfg.ChunkBytes)
	}
	if cfg.BytesPerDir < cfg.ChunkBytes {
		return fmt.Errorf("disk tier: %d bytes per directory holds no %d-byte chunk", cfg.BytesPerDir, cfg.ChunkBytes)
	}
	if !(cfg.Reserve >= 0 && cfg.Reserve < 1) {
		return fmt.Errorf("disk tier: reserve %v, want [0, 1)", cfg.Reserve)
	}
	return nil
}

func (t *Tier) loadMap(f *file) (chunkMap, error) {
	b, err := readSmall(t.fs, filepath.Join(f.dir, mapFileName(f.idx)))
	if err != nil {
		return chunkMap{}, err
	}
	return decodeMap(b, uint32(f.idx), t.chunkBytes, t.fileChunks)
}

// saveMap persists f.chunks with the current epoch. Callers hold f.mapMu
// or own f alone.
func (t *Tier) saveMap(f *file) error {
	t.writes.Lock()
	epoch := t.writes.epoch
	t.writes.Unlock()
	m := chunkMap{file: uint32(f.idx), epoch: epoch, chunkBytes: t.chunkBytes, chunks: f.chunks}
	return writeDurably(t.fs, f.dir, mapFileName(f.idx), encodeMap(m))
}

// loadCatalog merges the catalogs of every directory: each holds the
// same namespaces unless a save failed half way.
func (t *Tier) loadCatalog() {
	for _, f := range t.files {
		b, err := readSmall(t.fs, filepath.Join(f.dir, catalogFileName(f.idx)))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		var ns map[[32]byte][]byte
		if err == nil {
			ns, err = decodeCatalog(b)
		}
		if err != nil {
			t.log.Error("disk tier: namespace catalog unreadable; its namespaces are lost unless another directory has them",
				"dir", f.dir, "err", err)
			continue
		}
		for d, meta := range ns {
			if _, ok := t.catalog.ns[d]; !ok {
				t.catalog.ns[d] = meta
			}
		}
	}
}

func (t *Tier) saveCatalog(ns map[[32]byte][]byte) error {
	data := encodeCatalog(ns)
	var errs []error
	for _, f := range t.files {
		if err := writeDurably(t.fs, f.dir, catalogFileName(f.idx), data); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// SaveNamespace records meta (the namespace's fingerprint and layout, in
// the caller's encoding) under digest, the namespace digest slot headers
// carry, durably in every directory before it returns. Saving a digest
// again replaces its meta.
func (t *Tier) SaveNamespace(digest [32]byte, meta []byte) error {
	if len(meta) > MaxNamespaceMeta {
		return fmt.Errorf("%w: namespace metadata of %d bytes, at most %d", ErrInvalid, len(meta), MaxNamespaceMeta)
	}
	t.catalog.Lock()
	defer t.catalog.Unlock()
	ns := maps.Clone(t.catalog.ns)
	ns[digest] = append([]byte(nil), meta...)
	if err := t.saveCatalog(ns); err != nil {
		return fmt.Errorf("disk tier: save namespace catalog: %w", err)
	}
	t.catalog.ns = ns
	return nil
}

// Namespaces returns the catalog: what Open loaded (nothing after Reset)
// and what SaveNamespace added since. The map and its slices are copies.
func (t *Tier) Namespaces() map[[32]byte][]byte {
	t.catalog.Lock()
	defer t.catalog.Unlock()
	out := make(map[[32]byte][]byte, len(t.catalog.ns))
	for d, meta := range t.catalog.ns {
		out[d] = append([]byte(nil), meta...)
	}
	return out
}

// FileBytes is the size of the part of each slot file the tier uses.
func (t *Tier) FileBytes() uint64 { return t.fileBytes }

// Sync flushes every slot file to stable storage.
func (t *Tier) Sync() error {
	var errs []error
	for _, f := range t.files {
		if err := f.f.Sync(); err != nil {
			errs = append(errs, fmt.Errorf("disk tier: sync: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Close stops recovery (StopRecovery), waits for every queued request to
// finish (their done callbacks run), syncs and closes the files and stops
// the policy. Requests made after Close fail with ErrClosed. A second
// Close does nothing.
func (t *Tier) Close() error {
	t.closeMu.Lock()
	if t.closed {
		t.closeMu.Unlock()
		return nil
	}
	t.closed = true
	t.closeMu.Unlock()
	// Recovery first: it queues discards and hands blocks to the owner.
	t.StopRecovery()
	t.rec.wg.Wait()
	t.rec.doneOnce.Do(func() { close(t.rec.done) })
	for _, f := range t.files {
		f.q.close()
	}
	t.workers.Wait()
	err := t.Sync()
	return errors.Join(err, t.release())
}

// release frees what Open acquired; no worker may be running.
func (t *Tier) release() error {
	var errs []error
	for _, f := range t.files {
		if err := f.f.Close(); err != nil {
			errs = append(errs, fmt.Errorf("disk tier: close: %w", err))
		}
	}
	if t.hdrMem != nil {
		if err := vfs.FreeBuffer(t.hdrMem); err != nil {
			errs = append(errs, err)
		}
		t.hdrMem = nil
	}
	if t.m != nil {
		t.m.unregister()
	}
	if t.Space != nil {
		t.Space.Close()
	}
	// Last: another daemon may take the directories once the files are
	// closed.
	for _, l := range t.locks {
		if err := l.Close(); err != nil {
			errs = append(errs, fmt.Errorf("disk tier: unlock: %w", err))
		}
	}
	t.locks = nil
	return errors.Join(errs...)
}
