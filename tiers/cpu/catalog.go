package cpu

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
)

// The namespace catalog of a persistent arena (CatalogFileName): a record
// names its block's namespace by digest only, so the daemon keeps each
// namespace's fingerprint and layout (an opaque meta of the owner's) beside
// the arena, in the disk tier's catalog format (docs/disk-format.md).

// maxCatalogFile bounds the catalog file read at start.
const maxCatalogFile = 64 << 20

// loadCatalog reads the catalog of p's directory; a missing or damaged
// one is empty (logged by the caller from the error).
func (p *persist) loadCatalog() (map[[32]byte][]byte, error) {
	path := filepath.Join(p.dir, CatalogFileName)
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return map[[32]byte][]byte{}, nil
	}
	if err != nil {
		return map[[32]byte][]byte{}, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return map[[32]byte][]byte{}, err
	}
	if !fi.Mode().IsRegular() || fi.Size() > maxCatalogFile {
		return map[[32]byte][]byte{}, fmt.Errorf("%s is not a regular file of at most %d bytes", path, maxCatalogFile)
	}
	b := make([]byte, fi.Size())
	if _, err := f.ReadAt(b, 0); err != nil {
		return map[[32]byte][]byte{}, err
	}
	ns, err := disk.DecodeCatalog(b)
	if err != nil {
		return map[[32]byte][]byte{}, err
	}
	return ns, nil
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
