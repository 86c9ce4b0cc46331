package cpu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/zeebo/xxh3"
	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// A persistent arena: with --cpu-arena-dir the arena is a file in a tmpfs
// or hugetlbfs directory, mapped shared, so its bytes outlive the process
// (a crash, a kill -9, an upgrade) until the file is removed or the host
// reboots. The file starts with a superblock naming its format and
// geometry, then one record per 4 KiB of arena (records.go), then the
// arena itself. docs/disk-format.md ("CPU arena file") is the byte-level
// specification.

const (
	// ArenaFileName, LockFileName and CatalogFileName are the files the
	// daemon keeps in --cpu-arena-dir.
	ArenaFileName   = "kvoffload-cpu.arena"
	LockFileName    = "kvoffload-cpu.lock"
	CatalogFileName = "kvoffload-cpu.namespaces"

	superMagic   = "KVOFCPUA"
	superVersion = 1
	superBytes   = 4096
	superSumOff  = superBytes - 8
	// arenaAlign aligns the arena within the file and the file's size:
	// huge pages (transparent on tmpfs, or hugetlbfs) map it whole.
	arenaAlign = 2 << 20
)

// Filesystem magics (statfs f_type) of the filesystems an arena may live on.
const (
	tmpfsMagic     = 0x01021994
	hugetlbfsMagic = 0x958458f6
)

// geometry is where things lie in an arena file of a given arena size.
type geometry struct {
	arenaBytes uint64
	chunkBytes uint64
	recordsOff uint64
	records    uint64 // one per SlotAlign of arena
	arenaOff   uint64
	fileBytes  uint64
}

func geometryOf(arenaBytes, chunkBytes uint64) geometry {
	g := geometry{arenaBytes: arenaBytes, chunkBytes: chunkBytes, recordsOff: superBytes, records: arenaBytes / layout.SlotAlign}
	g.arenaOff = alignTo(g.recordsOff+g.records*RecordBytes, arenaAlign)
	g.fileBytes = alignTo(g.arenaOff+arenaBytes, arenaAlign)
	return g
}

func alignTo(n, a uint64) uint64 { return (n + a - 1) / a * a }

// superblock is the decoded first 4096 bytes of an arena file.
type superblock struct {
	version uint16
	geometry
	recordBytes uint32
	epoch       uint32
}

// Superblock offsets (little-endian); the bytes not named are zero, and
// the last 8 are the xxh3-64 of the 4088 before them.
const (
	sbMagic       = 0
	sbVersion     = 8
	sbRecordBytes = 12
	sbEpoch       = 16
	sbArenaBytes  = 24
	sbChunkBytes  = 32
	sbRecordsOff  = 40
	sbArenaOff    = 48
	sbFileBytes   = 56
	sbEnd         = 64
)

func encodeSuper(sb superblock, buf []byte) {
	clear(buf[:superBytes])
	le := binary.LittleEndian
	copy(buf[sbMagic:], superMagic)
	le.PutUint16(buf[sbVersion:], sb.version)
	le.PutUint32(buf[sbRecordBytes:], sb.recordBytes)
	le.PutUint32(buf[sbEpoch:], sb.epoch)
	le.PutUint64(buf[sbArenaBytes:], sb.arenaBytes)
	le.PutUint64(buf[sbChunkBytes:], sb.chunkBytes)
	le.PutUint64(buf[sbRecordsOff:], sb.recordsOff)
	le.PutUint64(buf[sbArenaOff:], sb.arenaOff)
	le.PutUint64(buf[sbFileBytes:], sb.fileBytes)
	le.PutUint64(buf[superSumOff:], xxh3.Hash(buf[:superSumOff]))
}

// decodeSuper reads a superblock; an error says why the file cannot be
// used (damaged, another format).
func decodeSuper(buf []byte) (superblock, error) {
	le := binary.LittleEndian
	if len(buf) < superBytes {
		return superblock{}, fmt.Errorf("the file is %d bytes, shorter than its superblock", len(buf))
	}
	if string(buf[sbMagic:sbMagic+len(superMagic)]) != superMagic {
		return superblock{}, fmt.Errorf("not an arena file (magic %q)", buf[:len(superMagic)])
	}
	if got, want := le.Uint64(buf[superSumOff:]), xxh3.Hash(buf[:superSumOff]); got != want {
		return superblock{}, fmt.Errorf("superblock checksum mismatch (stored %#016x, computed %#016x): the file is damaged", got, want)
	}
	sb := superblock{version: le.Uint16(buf[sbVersion:])}
	if sb.version != superVersion {
		return sb, fmt.Errorf("format version %d, this build reads %d", sb.version, superVersion)
	}
	for _, b := range buf[sbEnd:superSumOff] {
		if b != 0 {
			return sb, errors.New("non-zero reserved bytes in the superblock")
		}
	}
	sb.recordBytes = le.Uint32(buf[sbRecordBytes:])
	sb.epoch = le.Uint32(buf[sbEpoch:])
	sb.arenaBytes = le.Uint64(buf[sbArenaBytes:])
	sb.chunkBytes = le.Uint64(buf[sbChunkBytes:])
	sb.recordsOff = le.Uint64(buf[sbRecordsOff:])
	sb.records = sb.arenaBytes / layout.SlotAlign
	sb.arenaOff = le.Uint64(buf[sbArenaOff:])
	sb.fileBytes = le.Uint64(buf[sbFileBytes:])
	return sb, nil
}

// persist is the state of a persistent arena.
type persist struct {
	dir      string
	f        *os.File
	lock     io.Closer
	file     []byte // the whole file, mapped shared
	recs     []byte // the record table
	epoch    uint32
	attached bool // the file held an arena of this geometry: recover it
	seq      seqCounter

	catMu   sync.Mutex          // orders the catalog's writes (catalog.go)
	catalog map[[32]byte][]byte // CatalogFileName's contents
	stale   atomic.Bool         // a namespace was dropped since the catalog's last rewrite
}

// checkArenaDir creates dir (0700) if missing and refuses one the daemon
// does not own alone, or one not in memory (tmpfs, hugetlbfs).
func checkArenaDir(dir string) error {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("%s: want an absolute path", dir)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return fmt.Errorf("%s is not a directory", dir)
	case !ok || int(st.Uid) != os.Geteuid():
		return fmt.Errorf("%s is not owned by the daemon's user (uid %d)", dir, os.Geteuid())
	case fi.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("%s has mode %04o: the arena holds every cached block, want 0700 (only the daemon's user)", dir, fi.Mode().Perm())
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return fmt.Errorf("statfs %s: %w", dir, err)
	}
	if fs.Type != tmpfsMagic && fs.Type != hugetlbfsMagic {
		return fmt.Errorf("%s is not on tmpfs or hugetlbfs (filesystem type %#x): an arena there would be written back to a disk; use a directory under /dev/shm or /run, or a hugetlbfs mount", dir, fs.Type)
	}
	return nil
}

// openPersist locks dir and opens or creates its arena file for an arena
// of g. A file of another format, version or geometry, or a damaged one,
// is discarded (logged) and starts empty.
func openPersist(dir string, g geometry, log *slog.Logger) (_ *persist, err error) {
	if err := checkArenaDir(dir); err != nil {
		return nil, fmt.Errorf("--cpu-arena-dir: %w", err)
	}
	lock, err := vfs.Default.Lock(filepath.Join(dir, LockFileName))
	if errors.Is(err, vfs.ErrLocked) {
		return nil, fmt.Errorf("--cpu-arena-dir: directory %s is in use by another kvoffloadd (%w); two daemons on one arena would overwrite each other's blocks", dir, err)
	}
	if err != nil {
		return nil, fmt.Errorf("--cpu-arena-dir: lock %s: %w", dir, err)
	}
	p := &persist{dir: dir, lock: lock}
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	path := filepath.Join(dir, ArenaFileName)
	p.f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("--cpu-arena-dir: %s is a symbolic link; refusing to follow it", path)
	}
	if err != nil {
		return nil, fmt.Errorf("--cpu-arena-dir: %w", err)
	}
	fi, err := p.f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("--cpu-arena-dir: %s is not a regular file", path)
	}

	// What the file holds: an arena of this geometry to re-attach, or
	// nothing usable.
	var old superblock
	var why error
	switch size := uint64(fi.Size()); {
	case size == 0:
	default:
		buf := make([]byte, superBytes)
		if _, rerr := p.f.ReadAt(buf, 0); rerr != nil {
			why = fmt.Errorf("superblock unreadable: %w", rerr)
			break
		}
		if old, why = decodeSuper(buf); why != nil {
			break
		}
		switch {
		case old.recordBytes != RecordBytes:
			why = fmt.Errorf("records of %d bytes, this build writes %d", old.recordBytes, RecordBytes)
		case old.arenaBytes != g.arenaBytes || old.chunkBytes != g.chunkBytes:
			why = fmt.Errorf("an arena of %d bytes in %d-byte chunks, this daemon is configured for %d bytes in %d-byte chunks (--cpu-bytes, --cpu-chunk-bytes)",
				old.arenaBytes, old.chunkBytes, g.arenaBytes, g.chunkBytes)
		case old.geometry != g:
			why = fmt.Errorf("its layout (records at %d, arena at %d, %d bytes) is not this build's (%d, %d, %d)",
				old.recordsOff, old.arenaOff, old.fileBytes, g.recordsOff, g.arenaOff, g.fileBytes)
		case size != g.fileBytes:
			why = fmt.Errorf("the file is %d bytes, its superblock says %d: it is damaged", size, g.fileBytes)
		default:
			p.attached = true
		}
	}
	if why != nil {
		log.Warn("cpu tier: the arena file in --cpu-arena-dir cannot be used; it is discarded and the CPU tier starts empty",
			"file", path, "reason", why.Error())
		if err := p.f.Truncate(0); err != nil {
			return nil, fmt.Errorf("--cpu-arena-dir: discard %s: %w", path, err)
		}
	} else if !p.attached {
		log.Info("cpu tier: creating the arena file", "file", path, "bytes", g.fileBytes)
	}
	if err := p.f.Truncate(int64(g.fileBytes)); err != nil {
		return nil, fmt.Errorf("--cpu-arena-dir: size %s: %w", path, err)
	}
	// Backed now, not at the first store into a page: a tmpfs (or pool of
	// huge pages) too small for the arena would otherwise kill the
	// daemon with SIGBUS mid-copy. Pages already there are kept; a file
	// whose every page is there (a re-attached arena the last run
	// populated) is left alone, since walking 4 GiB of pages costs a
	// loaded host a second of the start.
	if allocated(p.f) < g.fileBytes {
		if err := unix.Fallocate(int(p.f.Fd()), 0, 0, int64(g.fileBytes)); err != nil {
			return nil, fmt.Errorf("--cpu-arena-dir: reserve %d bytes for %s (is the tmpfs or the huge page pool large enough?): %w", g.fileBytes, path, err)
		}
	}
	p.file, err = unix.Mmap(int(p.f.Fd()), 0, int(g.fileBytes), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("--cpu-arena-dir: mmap %s: %w", path, err)
	}
	p.recs = p.file[g.recordsOff : g.recordsOff+g.records*RecordBytes : g.recordsOff+g.records*RecordBytes]
	// Epochs grow across starts, so the records of this run are newer
	// than any left by earlier ones.
	p.epoch = 1
	if p.attached {
		p.epoch = old.epoch + 1
		if p.epoch == 0 {
			// Wrapped after 2^32 starts: the records are not
			// comparable with this run's; start empty.
			log.Warn("cpu tier: the arena file's epoch wrapped; it is discarded", "file", path)
			p.attached = false
			clear(p.recs)
			p.epoch = 1
		}
	}
	p.catalog = map[[32]byte][]byte{}
	if p.attached {
		var cerr error
		var oversized bool
		if p.catalog, oversized, cerr = p.loadCatalog(); cerr != nil {
			log.Error("cpu tier: the namespace catalog beside the arena is unreadable; the arena's blocks will not come back",
				"dir", dir, "err", cerr)
		} else if oversized {
			log.Warn("cpu tier: the namespace catalog beside the arena is larger than this daemon writes one; only the namespaces the arena's records name are kept",
				"dir", dir, "namespaces", len(p.catalog), "bound_bytes", maxCatalogFile)
		}
	}
	encodeSuper(superblock{version: superVersion, geometry: g, recordBytes: RecordBytes, epoch: p.epoch}, p.file[:superBytes])
	return p, nil
}

// allocated is how many bytes of f have storage (0 when unknown).
func allocated(f *os.File) uint64 {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0
	}
	return uint64(st.Blocks) * 512
}

func (p *persist) close() error {
	var errs []error
	if p.file != nil {
		errs = append(errs, unix.Munmap(p.file))
		p.file, p.recs = nil, nil
	}
	if p.f != nil {
		errs = append(errs, p.f.Close())
		p.f = nil
	}
	if p.lock != nil {
		errs = append(errs, p.lock.Close())
		p.lock = nil
	}
	return errors.Join(errs...)
}

// NewPersistent is New with the arena in dir's arena file (see persist):
// re-attached when it holds an arena of this geometry (Attached; the
// owner recovers its blocks from the records with Recover), else started
// empty. The directory is locked until Close.
func NewPersistent(cfg Config, dir string) (*Tier, error) {
	cfg.Name = "cpu"
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.ChunkBytes == 0 {
		cfg.ChunkBytes = slots.DefaultChunkBytes(cfg.Bytes)
	}
	if cfg.ChunkBytes == 0 || cfg.Bytes/cfg.ChunkBytes == 0 {
		return New(cfg) // New names what is wrong
	}
	g := geometryOf(cfg.Bytes/cfg.ChunkBytes*cfg.ChunkBytes, cfg.ChunkBytes)
	p, err := openPersist(dir, g, cfg.Logger)
	if err != nil {
		return nil, err
	}
	// Every slot let go of loses its record first: nothing the index
	// dropped (evicted, invalidated, failed) comes back at a restart, and
	// a slot written again never shows its previous block's record.
	cfg.Released = p.clearRecord
	sp, err := slots.New(cfg)
	if err != nil {
		p.close()
		return nil, err
	}
	if sp.Capacity() != g.arenaBytes {
		sp.Close()
		p.close()
		return nil, fmt.Errorf("cpu tier: arena of %d bytes, the file was laid out for %d", sp.Capacity(), g.arenaBytes)
	}
	mem := p.file[g.arenaOff : g.arenaOff+g.arenaBytes : g.arenaOff+g.arenaBytes]
	locked := adviseAndLock(mem, g.arenaBytes, cfg.Logger)
	t := &Tier{Space: sp, mem: mem, locked: locked, persist: p, log: cfg.Logger, stopPopulate: make(chan struct{}), populated: make(chan struct{})}
	t.rec.init(p.attached)
	go func() {
		defer close(t.populated)
		populate(mem, &t.backed, t.stopPopulate, cfg.Logger)
	}()
	cfg.Logger.Info("cpu tier: arena in a file that outlives the daemon", "file", filepath.Join(dir, ArenaFileName),
		"bytes", g.arenaBytes, "reattached", p.attached, "epoch", p.epoch)
	return t, nil
}

// Persistent reports whether the arena is a file that outlives the daemon.
func (t *Tier) Persistent() bool { return t.persist != nil }

// Attached reports whether the arena file held an arena of this geometry
// from an earlier run: its records name blocks to recover.
func (t *Tier) Attached() bool { return t.persist != nil && t.persist.attached }

// ArenaDir is --cpu-arena-dir, empty without a persistent arena.
func (t *Tier) ArenaDir() string {
	if t.persist == nil {
		return ""
	}
	return t.persist.dir
}
