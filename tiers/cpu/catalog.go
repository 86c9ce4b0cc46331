package cpu

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
)

// The namespace catalog of a persistent arena (CatalogFileName): a record
// names its block's namespace by digest only, so the daemon keeps each
// namespace's fingerprint and layout (an opaque meta of the owner's) beside
// the arena, in the disk tier's catalog format (docs/disk-format.md).

// maxCatalogFile bounds the catalog file read whole at start. The daemon
// keeps no more entries than namespaces (a few hundred bytes each); a
// larger file (an older daemon kept every namespace ever made) is read as
// a stream, keeping only the namespaces the arena's records name
// (oversized), so that it never costs the arena its blocks.
var maxCatalogFile int64 = 64 << 20

// loadCatalog reads the catalog of p's directory; a missing or damaged
// one is empty (logged by the caller from the error). oversized says it
// was past maxCatalogFile (only the entries of recorded namespaces kept).
func (p *persist) loadCatalog() (_ map[[32]byte][]byte, oversized bool, err error) {
	ns, err := p.readCatalog(&oversized)
	if err != nil {
		return map[[32]byte][]byte{}, oversized, err
	}
	return ns, oversized, nil
}

func (p *persist) readCatalog(oversized *bool) (map[[32]byte][]byte, error) {
	path := filepath.Join(p.dir, CatalogFileName)
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return map[[32]byte][]byte{}, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	if fi.Size() > maxCatalogFile {
		*oversized = true
		named := p.recordedNamespaces()
		return disk.ReadCatalog(f, fi.Size(), func(d [32]byte) bool { return named[d] })
	}
	b := make([]byte, fi.Size())
	if _, err := f.ReadAt(b, 0); err != nil {
		return nil, err
	}
	return disk.DecodeCatalog(b)
}

// recordedNamespaces are the namespace digests the arena's records name.
func (p *persist) recordedNamespaces() map[[32]byte]bool {
	out := map[[32]byte]bool{}
	var buf [slot.HeaderSize]byte // past RecordBytes always zero
	for off := 0; off+RecordBytes <= len(p.recs); off += RecordBytes {
		r := p.recs[off : off+RecordBytes]
		if bytes.Equal(r, zeroRecord[:]) {
			continue
		}
		copy(buf[:RecordBytes], r)
		if h, err := slot.Decode(buf[:]); err == nil {
			out[h.Namespace] = true
		}
	}
	return out
}

// saveCatalog replaces the catalog file (a temporary file renamed over it:
// a crash leaves the old or the new one).
func (p *persist) saveCatalog(ns map[[32]byte][]byte) error {
	path := filepath.Join(p.dir, CatalogFileName)
	tmp := path + ".tmp"
	if err := os.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(disk.EncodeCatalog(ns))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, path)
}

// Namespaces is the catalog the arena file's records refer to: what the
// last run saved (empty when the arena was not re-attached), and what this
// one saved since.
func (t *Tier) Namespaces() map[[32]byte][]byte {
	p := t.persist
	if p == nil {
		return nil
	}
	p.catMu.Lock()
	defer p.catMu.Unlock()
	return maps.Clone(p.catalog)
}

// The catalog keeps the owner's namespaces (digest → the owner's meta),
// and no more: all, the owner's snapshot of them, is read under the
// catalog's lock, so a namespace the owner adds after a snapshot is saved
// after that write (AddNamespace waits for it). Nothing here runs under a
// lock of the owner's but DroppedNamespace: the file is never written
// under a lock the owner's hot paths take. A save that fails costs the
// arena's blocks at the next start, nothing now.

// SaveNamespaces replaces the catalog with all(). Without a persistent
// arena it does nothing.
func (t *Tier) SaveNamespaces(all func() map[[32]byte][]byte) error {
	p := t.persist
	if p == nil {
		return nil
	}
	p.catMu.Lock()
	defer p.catMu.Unlock()
	// Cleared before the snapshot: a namespace dropped after it is
	// dropped at the next rewrite.
	p.stale.Store(false)
	return p.replaceCatalog(all())
}

// AddNamespace records a namespace the owner made, before any block of it
// is stored; after a DroppedNamespace, the whole catalog is rewritten from
// all instead, without the namespaces dropped.
func (t *Tier) AddNamespace(d [32]byte, meta []byte, all func() map[[32]byte][]byte) error {
	p := t.persist
	if p == nil {
		return nil
	}
	if p.stale.Load() {
		return t.SaveNamespaces(all)
	}
	p.catMu.Lock()
	defer p.catMu.Unlock()
	next := maps.Clone(p.catalog)
	next[d] = meta
	return p.replaceCatalog(next)
}

// DroppedNamespace notes that the owner dropped a namespace (no block of
// it is left in the arena): the catalog drops it at its next rewrite
// (CompactNamespaces, or the next AddNamespace). It takes no lock.
func (t *Tier) DroppedNamespace() {
	if t.persist != nil {
		t.persist.stale.Store(true)
	}
}

// CompactNamespaces rewrites the catalog from all when a namespace was
// dropped since its last rewrite.
func (t *Tier) CompactNamespaces(all func() map[[32]byte][]byte) error {
	if t.persist == nil || !t.persist.stale.Load() {
		return nil
	}
	return t.SaveNamespaces(all)
}

// replaceCatalog saves next as the catalog; the caller holds catMu.
func (p *persist) replaceCatalog(next map[[32]byte][]byte) error {
	if err := p.saveCatalog(next); err != nil {
		return fmt.Errorf("cpu tier: save the namespace catalog in %s: %w", p.dir, err)
	}
	p.catalog = next
	return nil
}
