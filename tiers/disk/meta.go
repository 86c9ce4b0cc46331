package disk

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"sort"

	"github.com/zeebo/xxh3"

	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// The small files beside each slot file. docs/disk-format.md specifies
// them. Names carry the file's index because errorfs seeds its faults by
// base name, and so that two tiers never share a name.
func slotFileName(i int) string    { return fmt.Sprintf("kvoffload-%d.slots", i) }
func mapFileName(i int) string     { return fmt.Sprintf("kvoffload-%d.chunks", i) }
func catalogFileName(i int) string { return fmt.Sprintf("kvoffload-%d.namespaces", i) }

// lockFileName is the file each directory's lock is taken on (vfs.FS.Lock).
const lockFileName = "kvoffload.lock"

// tmpSuffix names the file writeDurably writes before renaming it.
const tmpSuffix = ".tmp"

// checkFiles refuses a directory where a file the tier keeps is a
// symbolic link or not a regular file: whoever planted it could make the
// daemon write through it. Every open refuses links too (vfs); this
// check makes the refusal come at start, clearly, rather than as a
// chunk map or catalog that "could not be read" and was quietly replaced.
func checkFiles(fsys vfs.FS, dir string, i int) error {
	for _, name := range []string{slotFileName(i), mapFileName(i), catalogFileName(i),
		mapFileName(i) + tmpSuffix, catalogFileName(i) + tmpSuffix} {
		path := filepath.Join(dir, name)
		fi, err := fsys.Stat(path)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return fmt.Errorf("disk tier: %w", err)
		case fi.Mode()&fs.ModeSymlink != 0:
			return fmt.Errorf("disk tier: %w: %s is a symbolic link; refusing to follow it (remove it, or point --disk-dir elsewhere)", vfs.ErrSymlink, path)
		case !fi.Mode().IsRegular():
			return fmt.Errorf("disk tier: %s is not a regular file (%v); refusing to use it", path, fi.Mode().Type())
		}
	}
	return nil
}

const (
	mapMagic     = "KVOFCMAP"
	catalogMagic = "KVOFNSCT"
	metaVersion  = 1

	mapHeaderLen = 40
	mapEntryLen  = 8
	sumLen       = 8 // trailing xxh3-64 of everything before it

	// maxMetaFile bounds what Open reads from a chunk map or catalog, so
	// a damaged size field cannot make it allocate without limit.
	maxMetaFile = 64 << 20
	// MaxNamespaceMeta bounds the metadata SaveNamespace keeps per
	// namespace.
	MaxNamespaceMeta = 1 << 20
)

// errMeta marks a chunk map or catalog that is damaged or belongs to
// another configuration.
var errMeta = errors.New("unreadable")

// chunkEntry is what the chunk map says about one chunk of a file.
type chunkEntry struct {
	slotBytes uint64 // 0: the chunk holds no slots
	// minEpoch is the epoch in which the chunk took this slot size; a
	// slot written before it belongs to an earlier life of the chunk.
	minEpoch uint32
}

// chunkMap is one slot file's chunk map.
type chunkMap struct {
	file       uint32
	epoch      uint32 // of the incarnation that wrote it
	chunkBytes uint64
	chunks     []chunkEntry
}

func encodeMap(m chunkMap) []byte {
	b := make([]byte, mapHeaderLen+len(m.chunks)*mapEntryLen, mapHeaderLen+len(m.chunks)*mapEntryLen+sumLen)
	le := binary.LittleEndian
	copy(b, mapMagic)
	le.PutUint16(b[8:], metaVersion)
	le.PutUint32(b[12:], m.file)
	le.PutUint32(b[16:], m.epoch)
	le.PutUint64(b[24:], m.chunkBytes)
	le.PutUint32(b[32:], uint32(len(m.chunks)))
	for i, e := range m.chunks {
		p := b[mapHeaderLen+i*mapEntryLen:]
		le.PutUint32(p, uint32(e.slotBytes/layout.SlotAlign))
		le.PutUint32(p[4:], e.minEpoch)
	}
	return le.AppendUint64(b, xxh3.Hash(b))
}

// decodeMap parses a chunk map and checks it against the configuration
// it is read for.
func decodeMap(b []byte, file uint32, chunkBytes uint64, chunks int) (chunkMap, error) {
	body, err := checkSummed(b, mapMagic, mapHeaderLen)
	if err != nil {
		return chunkMap{}, err
	}
	le := binary.LittleEndian
	m := chunkMap{file: le.Uint32(body[12:]), epoch: le.Uint32(body[16:]), chunkBytes: le.Uint64(body[24:])}
	n := int(le.Uint32(body[32:]))
	switch {
	case le.Uint16(body[10:]) != 0 || le.Uint32(body[20:]) != 0 || le.Uint32(body[36:]) != 0:
		return chunkMap{}, fmt.Errorf("%w: reserved bytes are not zero", errMeta)
	case len(body) != mapHeaderLen+n*mapEntryLen:
		return chunkMap{}, fmt.Errorf("%w: %d bytes for %d chunks", errMeta, len(b), n)
	case m.file != file:
		return chunkMap{}, fmt.Errorf("%w: written for file %d, found beside file %d (were --disk-dir reordered?)", errMeta, m.file, file)
	case m.chunkBytes != chunkBytes || n != chunks:
		return chunkMap{}, fmt.Errorf("%w: written for %d chunks of %d bytes, the tier now has %d chunks of %d bytes", errMeta, n, m.chunkBytes, chunks, chunkBytes)
	}
	m.chunks = make([]chunkEntry, n)
	for i := range m.chunks {
		p := body[mapHeaderLen+i*mapEntryLen:]
		e := chunkEntry{slotBytes: uint64(le.Uint32(p)) * layout.SlotAlign, minEpoch: le.Uint32(p[4:])}
		if e.slotBytes != 0 && (e.slotBytes < slot.HeaderSize || e.slotBytes > chunkBytes) {
			return chunkMap{}, fmt.Errorf("%w: chunk %d has %d-byte slots, outside [%d, %d]", errMeta, i, e.slotBytes, slot.HeaderSize, chunkBytes)
		}
		if e.minEpoch > m.epoch {
			return chunkMap{}, fmt.Errorf("%w: chunk %d was assigned in epoch %d, after the map's epoch %d", errMeta, i, e.minEpoch, m.epoch)
		}
		m.chunks[i] = e
	}
	return m, nil
}

// encodeCatalog writes the namespaces in digest order, so equal catalogs
// are equal files.
func encodeCatalog(ns map[[32]byte][]byte) []byte {
	digests := make([][32]byte, 0, len(ns))
	size := 16 + sumLen
	for d, meta := range ns {
		digests = append(digests, d)
		size += 36 + len(meta)
	}
	sort.Slice(digests, func(i, j int) bool { return bytes.Compare(digests[i][:], digests[j][:]) < 0 })
	le := binary.LittleEndian
	b := make([]byte, 16, size)
	copy(b, catalogMagic)
	le.PutUint16(b[8:], metaVersion)
	le.PutUint32(b[12:], uint32(len(digests)))
	for _, d := range digests {
		b = append(b, d[:]...)
		b = le.AppendUint32(b, uint32(len(ns[d])))
		b = append(b, ns[d]...)
	}
	return le.AppendUint64(b, xxh3.Hash(b))
}

func decodeCatalog(b []byte) (map[[32]byte][]byte, error) {
	body, err := checkSummed(b, catalogMagic, 16)
	if err != nil {
		return nil, err
	}
	le := binary.LittleEndian
	if le.Uint16(body[10:]) != 0 {
		return nil, fmt.Errorf("%w: reserved bytes are not zero", errMeta)
	}
	n := int(le.Uint32(body[12:]))
	ns := make(map[[32]byte][]byte, min(n, 1024))
	rest := body[16:]
	var prev [32]byte
	for i := range n {
		if len(rest) < 36 {
			return nil, fmt.Errorf("%w: entry %d of %d is cut short", errMeta, i, n)
		}
		var d [32]byte
		copy(d[:], rest)
		l := uint64(le.Uint32(rest[32:]))
		if l > MaxNamespaceMeta || l > uint64(len(rest)-36) {
			return nil, fmt.Errorf("%w: entry %d holds %d bytes of metadata", errMeta, i, l)
		}
		if i > 0 && bytes.Compare(prev[:], d[:]) >= 0 {
			return nil, fmt.Errorf("%w: namespace %x is out of order or listed twice", errMeta, d[:8])
		}
		prev = d
		ns[d] = bytes.Clone(rest[36 : 36+l])
		rest = rest[36+l:]
	}
	if len(rest) != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the last entry", errMeta, len(rest))
	}
	return ns, nil
}

// checkSummed checks the magic, version and trailing checksum of a small
// file and returns it without the checksum.
func checkSummed(b []byte, magic string, minLen int) ([]byte, error) {
	if len(b) < minLen+sumLen {
		return nil, fmt.Errorf("%w: %d bytes is too short", errMeta, len(b))
	}
	body := b[:len(b)-sumLen]
	if string(body[:8]) != magic {
		return nil, fmt.Errorf("%w: bad magic %q", errMeta, body[:8])
	}
	if got := binary.LittleEndian.Uint64(b[len(body):]); got != xxh3.Hash(body) {
		return nil, fmt.Errorf("%w: checksum mismatch", errMeta)
	}
	if v := binary.LittleEndian.Uint16(body[8:]); v != metaVersion {
		return nil, fmt.Errorf("%w: version %d, this build reads %d", errMeta, v, metaVersion)
	}
	return body, nil
}

// writeDurably replaces dir/name with data so that after a crash the file
// holds either its old or its new contents, and after return the new
// contents survive one: write a temporary file, sync it, rename it over
// name, sync the directory.
func writeDurably(fsys vfs.FS, dir, name string, data []byte) error {
	path := filepath.Join(dir, name)
	tmp := path + tmpSuffix
	// OpenFile does not truncate: start from no file.
	if err := fsys.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove stale %s: %w", tmp, err)
	}
	f, err := fsys.OpenFile(tmp, 0, false)
	if err != nil {
		return err
	}
	n, err := f.WriteAt(data, 0)
	if err == nil && n != len(data) {
		err = fmt.Errorf("write %s: wrote %d of %d bytes", tmp, n, len(data))
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := fsys.Rename(tmp, path); err != nil {
		return err
	}
	return fsys.SyncDir(dir)
}

// readSmall reads a whole small file. A missing file gives an error
// matching fs.ErrNotExist.
func readSmall(fsys vfs.FS, path string) ([]byte, error) {
	fi, err := fsys.Stat(path)
	if err != nil {
		return nil, err
	}
	if fi.Size() > maxMetaFile {
		return nil, fmt.Errorf("%w: %s is %d bytes, more than %d", errMeta, path, fi.Size(), maxMetaFile)
	}
	f, err := fsys.OpenFile(path, 0, false)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, fi.Size())
	if n, err := f.ReadAt(b, 0); n != len(b) {
		return nil, fmt.Errorf("read %s: %d of %d bytes: %w", path, n, len(b), err)
	}
	return b, nil
}
