package fence

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/zeebo/xxh3"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// The remote tier's fences on disk. An invalidation whose generation
// record is not written yet (a master was down) must outlive a restart:
// until it is written the store serves the old value, and a restarted node
// that forgot its fence would load it. With a disk tier the records still
// to be written are kept in a state file in every --disk-dir
// (kvoffload-<i>.remote-fences, written like the namespace catalog:
// replaced, synced, renamed, directory synced), written before Invalidate
// returns, and brought back at start: fenced again, their records written.
// A record written needs nothing on disk: it is in the store, for every
// node.
//
// A copy that exists but cannot be read (bad checksum, unknown version,
// cut short) makes the daemon refuse to start: dropping it could let the
// node load blocks it invalidated, and guessing wider (sweeping every
// namespace the node ever knew from the shared store) would cost the whole
// fleet its cache. The message says how to start without it.
//
// Format, little-endian:
//
//	0   8  magic "KVOFRFNC"
//	8   2  version (2)
//	10  2  reserved, zero
//	12  4  key count (at most maxPendingTotal)
//	16  4  namespace count (at most maxDurableNamespaces)
//	20  4  reserved, zero
//	24     keys: namespace digest (32), group (u32), hash (32, zero padded),
//	       value key length (u16, 1..maxStoreKey), value key (its
//	       record is remote.GenKey of it)
//	       namespaces: namespace digest (32), keyspace length (u16,
//	       1..maxStoreKey), the keyspace's prefix (kvo:2:<key id>:) whose
//	       copies of the namespace's generation record are to be written
//	end 8  xxh3-64 of every byte before it
//
// A file of version 1 (deletes and sweeps of version-1 values) is read as
// empty: this build neither reads those values (another key prefix) nor
// accepts them (another format version).

const (
	fencesState          = "remote-fences"
	fencesMagic          = "KVOFRFNC"
	fencesVersion        = 2
	fencesHeader         = 24
	maxStoreKey          = 1024
	maxDurableNamespaces = 1 << 16
	// maxPendingTotal bounds the keys whose record is still to be
	// written over all namespaces (the fences file's size).
	maxPendingTotal = 1 << 16
)

// durableFences is what the fences file keeps.
type durableFences struct {
	keys   []durableKey
	spaces []durableSpace
}

type durableKey struct {
	fk    Key
	store string
}

type durableSpace struct {
	ns       [32]byte
	keyspace string
}

func encodeFences(df durableFences) []byte {
	sort.Slice(df.keys, func(i, j int) bool { return df.keys[i].store < df.keys[j].store })
	sort.Slice(df.spaces, func(i, j int) bool {
		a, b := df.spaces[i], df.spaces[j]
		c := bytes.Compare(a.ns[:], b.ns[:])
		return c < 0 || c == 0 && a.keyspace < b.keyspace
	})
	le := binary.LittleEndian
	b := make([]byte, fencesHeader, 4096)
	copy(b, fencesMagic)
	le.PutUint16(b[8:], fencesVersion)
	le.PutUint32(b[12:], uint32(len(df.keys)))
	le.PutUint32(b[16:], uint32(len(df.spaces)))
	for _, k := range df.keys {
		b = append(b, k.fk.NS[:]...)
		b = le.AppendUint32(b, k.fk.Group)
		b = append(b, k.fk.Hash[:]...)
		b = le.AppendUint16(b, uint16(len(k.store)))
		b = append(b, k.store...)
	}
	for _, s := range df.spaces {
		b = append(b, s.ns[:]...)
		b = le.AppendUint16(b, uint16(len(s.keyspace)))
		b = append(b, s.keyspace...)
	}
	return le.AppendUint64(b, xxh3.Hash(b))
}

var errFences = errors.New("unreadable fences file")

func decodeFences(b []byte) (durableFences, error) {
	le := binary.LittleEndian
	bad := func(format string, a ...any) (durableFences, error) {
		return durableFences{}, fmt.Errorf("%w: %s", errFences, fmt.Sprintf(format, a...))
	}
	if len(b) < fencesHeader+8 {
		return bad("%d bytes, shorter than a header", len(b))
	}
	body := b[:len(b)-8]
	switch {
	case string(body[:8]) != fencesMagic:
		return bad("bad magic %q", body[:8])
	case le.Uint64(b[len(body):]) != xxh3.Hash(body):
		return bad("checksum mismatch")
	case le.Uint16(body[8:]) == 1:
		return durableFences{}, nil
	case le.Uint16(body[8:]) != fencesVersion:
		return bad("version %d; this build reads version %d", le.Uint16(body[8:]), fencesVersion)
	case le.Uint16(body[10:]) != 0 || le.Uint32(body[20:]) != 0:
		return bad("reserved bytes are not zero")
	}
	nk, nn := le.Uint32(body[12:]), le.Uint32(body[16:])
	if nk > maxPendingTotal || nn > maxDurableNamespaces {
		return bad("%d keys and %d namespaces, at most %d and %d", nk, nn, maxPendingTotal, maxDurableNamespaces)
	}
	rest := body[fencesHeader:]
	str := func() (string, bool) {
		if len(rest) < 2 {
			return "", false
		}
		n := int(le.Uint16(rest))
		if n == 0 || n > maxStoreKey || len(rest) < 2+n {
			return "", false
		}
		s := string(rest[2 : 2+n])
		rest = rest[2+n:]
		return s, true
	}
	var df durableFences
	for i := range nk {
		if len(rest) < 68 {
			return bad("key %d of %d is cut short", i, nk)
		}
		var k durableKey
		copy(k.fk.NS[:], rest)
		k.fk.Group = le.Uint32(rest[32:])
		copy(k.fk.Hash[:], rest[36:68])
		rest = rest[68:]
		var ok bool
		if k.store, ok = str(); !ok {
			return bad("key %d of %d: bad store key", i, nk)
		}
		df.keys = append(df.keys, k)
	}
	for i := range nn {
		if len(rest) < 32 {
			return bad("namespace %d of %d is cut short", i, nn)
		}
		var s durableSpace
		copy(s.ns[:], rest)
		rest = rest[32:]
		var ok bool
		if s.keyspace, ok = str(); !ok {
			return bad("namespace %d of %d: bad keyspace", i, nn)
		}
		df.spaces = append(df.spaces, s)
	}
	if len(rest) != 0 {
		return bad("%d bytes after the last entry", len(rest))
	}
	return df, nil
}

// save writes the fences file if what it keeps changed since the last
// save. Without a disk tier there is nowhere to keep it.
func (s *Set) save() error {
	if s.cfg.State == nil {
		return nil
	}
	s.saveMu.Lock()
	defer s.saveMu.Unlock()
	f := &s.f
	f.mu.Lock()
	if f.version == f.saved {
		f.mu.Unlock()
		return nil
	}
	v := f.version
	var df durableFences
	for sk, fk := range f.retry {
		df.keys = append(df.keys, durableKey{fk: fk, store: sk})
	}
	for d, nf := range f.whole {
		for _, ks := range nf.pending {
			df.spaces = append(df.spaces, durableSpace{ns: d, keyspace: ks})
		}
	}
	f.mu.Unlock()
	if err := s.cfg.State.SaveState(fencesState, encodeFences(df)); err != nil {
		return err
	}
	f.mu.Lock()
	f.saved = max(f.saved, v)
	f.mu.Unlock()
	return nil
}

// load brings the fences file back at start (before the sweeper runs):
// the keys and namespaces fenced again and their records written. An
// unreadable copy is an error: the daemon refuses to start.
func (s *Set) load() error {
	if s.cfg.State == nil {
		return nil
	}
	copies, err := s.cfg.State.LoadState(fencesState)
	if err != nil {
		return fmt.Errorf("remote tier: %w; it lists invalidations not yet recorded in the cluster, and without it this node could load those blocks; refusing to start (move the file away to start without it)", err)
	}
	f := &s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	keys, spaces := 0, 0
	for path, b := range copies {
		df, err := decodeFences(b)
		if err != nil {
			return fmt.Errorf("remote tier: %s: %w; it lists invalidations not yet recorded in the cluster, and without it this node could load those blocks; refusing to start (move the file away to start without it)", path, err)
		}
		for _, sp := range df.spaces {
			if nf := f.whole[sp.ns]; nf == nil || !containsString(nf.pending, sp.keyspace) {
				s.wholeLocked(sp.ns, sp.keyspace)
				spaces++
			}
		}
		for _, k := range df.keys {
			if _, ok := f.retry[k.store]; ok {
				continue
			}
			if _, ok := f.whole[k.fk.NS]; ok {
				continue // invalidated whole
			}
			f.retry[k.store] = k.fk
			keys++
			// Fenced for reading in this node's keyspace only: a key
			// of another (the key file changed) is only recorded.
			if strings.HasPrefix(k.store, s.cfg.Keyspace.Prefix()) {
				f.gen++
				f.keys[k.fk] = &keyFence{store: k.store, pending: true, gen: f.gen}
				f.perNS[k.fk.NS]++
			}
		}
	}
	f.countLocked()
	if keys+spaces == 0 {
		return nil
	}
	f.version, f.saved = 1, 0 // the copies are rewritten alike at the next save
	f.kick()
	s.cfg.Log.Warn("remote tier: invalidations not yet recorded in the cluster brought back from disk: their records are written again; until then this node does not read those blocks from the cluster",
		"keys", keys, "namespaces", spaces)
	return nil
}

// nsPrefixOf is the namespace prefix of a store key (docs/remote.md):
// kvo:2:<key id>:{<namespace>: of kvo:2:<key id>:{<namespace>:<group>:<hash>}.
func nsPrefixOf(store string) string {
	n := 0
	for i := 0; i < len(store); i++ {
		if store[i] == ':' {
			if n++; n == 4 {
				return store[:i+1]
			}
		}
	}
	return store
}

// DirState is a StateFile in one directory of its own, for a node without
// a disk tier (--remote-state-dir): each file is written like the disk
// tier's (a temporary file written and synced, renamed over the old one,
// the directory synced), so after a crash it holds the old or the new
// contents, never a mix. The directory is locked (kvoffload.remote.lock,
// flock) from OpenDirState to Close: two daemons on one directory would
// overwrite each other's fences file, and each would forget the records
// the other still owes the cluster.
type DirState struct {
	dir  string
	lock io.Closer
}

// ErrStateDirInUse: another daemon holds the directory's lock.
var ErrStateDirInUse = errors.New("in use by another kvoffloadd")

// stateLockName is the lock file of a --remote-state-dir.
const stateLockName = "kvoffload.remote.lock"

// OpenDirState locks dir (which must exist) for this process; a directory
// another process holds is refused (ErrStateDirInUse, naming the holder's
// pid).
func OpenDirState(dir string) (*DirState, error) {
	lock, err := vfs.Default.Lock(filepath.Join(dir, stateLockName))
	if errors.Is(err, vfs.ErrLocked) {
		return nil, fmt.Errorf("--remote-state-dir: directory %s is %w (%w); two daemons on one directory would overwrite each other's fences file and forget the invalidations the other still owes the cluster", dir, ErrStateDirInUse, err)
	}
	if err != nil {
		return nil, fmt.Errorf("--remote-state-dir: lock %s: %w", dir, err)
	}
	return &DirState{dir: dir, lock: lock}, nil
}

// Close releases the directory's lock.
func (d *DirState) Close() error { return d.lock.Close() }

// SaveState implements StateFile.
func (d *DirState) SaveState(name string, data []byte) error {
	dir := d.dir
	tmp, err := os.CreateTemp(dir, "."+name+".tmp-*")
	if err != nil {
		return err
	}
	_, err = tmp.Write(data)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), d.path(name))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("save %s in %s: %w", name, dir, err)
	}
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = f.Sync()
	f.Close()
	return err
}

// LoadState implements StateFile.
func (d *DirState) LoadState(name string) (map[string][]byte, error) {
	p := d.path(name)
	b, err := os.ReadFile(p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, nil
	case err != nil:
		return nil, err
	}
	return map[string][]byte{p: b}, nil
}

func (d *DirState) path(name string) string { return filepath.Join(d.dir, "kvoffload."+name) }
