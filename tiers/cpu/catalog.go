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

// SaveNamespaces records metas (digest → the owner's meta) in the catalog
// and, when keepOnly, drops every other entry. Without a persistent arena
// it does nothing.
func (t *Tier) SaveNamespaces(metas map[[32]byte][]byte, keepOnly bool) error {
	p := t.persist
	if p == nil {
		return nil
	}
	p.catMu.Lock()
	defer p.catMu.Unlock()
	next := maps.Clone(metas)
	if !keepOnly {
		next = maps.Clone(p.catalog)
		maps.Copy(next, metas)
	}
	if err := p.saveCatalog(next); err != nil {
		return fmt.Errorf("cpu tier: save the namespace catalog in %s: %w", p.dir, err)
	}
	p.catalog = next
	return nil
}
