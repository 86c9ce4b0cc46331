package vfs

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// memPage is the unit in which Mem stores file contents. Pages never
// written read as zeros, so preallocating a large file costs nothing.
const memPage = Alignment

// NewMem returns an empty in-memory FS for tests. It holds the root and
// the current directory; other directories must be made with MkdirAll
// before files are created in them, as on a real disk. Files opened with
// direct=true enforce the alignment rule. Removing an open file keeps its
// contents for the handles that have it open, as on Linux.
func NewMem() FS {
	m := &memFS{}
	m.mu.files = make(map[string]*memNode)
	m.mu.dirs = map[string]bool{"/": true, ".": true}
	m.mu.locked = make(map[string]bool)
	return m
}

// Lock holds path's lock until the Closer is closed, as flock on the OS
// does for an open file description.
func (m *memFS) Lock(path string) (io.Closer, error) {
	f, err := m.OpenFile(path, 0, false)
	if err != nil {
		return nil, err
	}
	f.Close()
	path = filepath.Clean(path)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mu.locked[path] {
		return nil, fmt.Errorf("%w: %s", ErrLocked, path)
	}
	m.mu.locked[path] = true
	return &memLock{m: m, path: path}, nil
}

type memLock struct {
	m    *memFS
	path string
	once sync.Once
}

func (l *memLock) Close() error {
	l.once.Do(func() {
		l.m.mu.Lock()
		delete(l.m.mu.locked, l.path)
		l.m.mu.Unlock()
	})
	return nil
}

type memFS struct {
	mu struct {
		sync.Mutex
		files  map[string]*memNode
		dirs   map[string]bool
		locked map[string]bool
	}
}

type memNode struct {
	mu    sync.RWMutex
	size  int64
	pages map[int64]*[memPage]byte
}

func (m *memFS) OpenFile(path string, size int64, direct bool) (File, error) {
	path = filepath.Clean(path)
	m.mu.Lock()
	if m.mu.dirs[path] {
		m.mu.Unlock()
		return nil, &os.PathError{Op: "open", Path: path, Err: syscall.EISDIR}
	}
	if !m.mu.dirs[filepath.Dir(path)] {
		m.mu.Unlock()
		return nil, &os.PathError{Op: "open", Path: path, Err: fs.ErrNotExist}
	}
	n := m.mu.files[path]
	if n == nil {
		n = &memNode{pages: make(map[int64]*[memPage]byte)}
		m.mu.files[path] = n
	}
	m.mu.Unlock()

	f := &memFile{node: n, name: path, direct: direct}
	if size > 0 {
		if err := f.Preallocate(size); err != nil {
			return nil, err
		}
	}
	return f, nil
}

func (m *memFS) Remove(path string) error {
	path = filepath.Clean(path)
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.mu.files[path]; ok {
		delete(m.mu.files, path)
		return nil
	}
	if !m.mu.dirs[path] {
		return &os.PathError{Op: "remove", Path: path, Err: fs.ErrNotExist}
	}
	if path == "/" || path == "." {
		return &os.PathError{Op: "remove", Path: path, Err: syscall.EBUSY}
	}
	for p := range m.mu.files {
		if filepath.Dir(p) == path {
			return &os.PathError{Op: "remove", Path: path, Err: syscall.ENOTEMPTY}
		}
	}
	for d := range m.mu.dirs {
		if d != path && filepath.Dir(d) == path {
			return &os.PathError{Op: "remove", Path: path, Err: syscall.ENOTEMPTY}
		}
	}
	delete(m.mu.dirs, path)
	return nil
}

func (m *memFS) Stat(path string) (os.FileInfo, error) {
	path = filepath.Clean(path)
	m.mu.Lock()
	n, isFile := m.mu.files[path]
	isDir := m.mu.dirs[path]
	m.mu.Unlock()
	switch {
	case isFile:
		n.mu.RLock()
		defer n.mu.RUnlock()
		return memInfo{name: filepath.Base(path), size: n.size, mode: 0o600}, nil
	case isDir:
		return memInfo{name: filepath.Base(path), mode: fs.ModeDir | 0o700}, nil
	}
	return nil, &os.PathError{Op: "stat", Path: path, Err: fs.ErrNotExist}
}

func (m *memFS) MkdirAll(dir string, perm os.FileMode) error {
	dir = filepath.Clean(dir)
	m.mu.Lock()
	defer m.mu.Unlock()
	var missing []string
	for d := dir; !m.mu.dirs[d]; d = filepath.Dir(d) {
		if _, ok := m.mu.files[d]; ok {
			return &os.PathError{Op: "mkdir", Path: d, Err: syscall.ENOTDIR}
		}
		missing = append(missing, d)
	}
	for _, d := range missing {
		m.mu.dirs[d] = true
	}
	return nil
}

func (m *memFS) Rename(oldpath, newpath string) error {
	oldpath, newpath = filepath.Clean(oldpath), filepath.Clean(newpath)
	m.mu.Lock()
	defer m.mu.Unlock()
	n, ok := m.mu.files[oldpath]
	if !ok {
		return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: fs.ErrNotExist}
	}
	if m.mu.dirs[newpath] {
		return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: syscall.EISDIR}
	}
	if !m.mu.dirs[filepath.Dir(newpath)] {
		return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: fs.ErrNotExist}
	}
	delete(m.mu.files, oldpath)
	m.mu.files[newpath] = n
	return nil
}

// Space: memory has room for anything (its files are sparse).
func (m *memFS) Space(dir string) (Space, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.mu.dirs[filepath.Clean(dir)] {
		return Space{}, &os.PathError{Op: "statfs", Path: dir, Err: fs.ErrNotExist}
	}
	return Space{Free: 1 << 62, Total: 1 << 62}, nil
}

func (m *memFS) SyncDir(dir string) error {
	dir = filepath.Clean(dir)
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.mu.dirs[dir] {
		return &os.PathError{Op: "sync", Path: dir, Err: fs.ErrNotExist}
	}
	return nil
}

type memFile struct {
	node   *memNode
	name   string
	direct bool
	closed atomic.Bool
}

func (f *memFile) check(op string, p []byte, off int64) error {
	if f.closed.Load() {
		return &os.PathError{Op: op, Path: f.name, Err: os.ErrClosed}
	}
	if f.direct {
		if err := CheckAlignment(p, off); err != nil {
			return fmt.Errorf("%s %s: %w", op, f.name, err)
		}
	}
	if off < 0 {
		return &os.PathError{Op: op, Path: f.name, Err: fmt.Errorf("negative offset %d", off)}
	}
	return nil
}

func (f *memFile) ReadAt(p []byte, off int64) (int, error) {
	if err := f.check("read", p, off); err != nil {
		return 0, err
	}
	n := f.node
	n.mu.RLock()
	defer n.mu.RUnlock()
	if off >= n.size {
		if len(p) == 0 {
			return 0, nil
		}
		return 0, io.EOF
	}
	want := int(min(int64(len(p)), n.size-off))
	for i := 0; i < want; {
		pos := off + int64(i)
		po := int(pos % memPage)
		c := min(memPage-po, want-i)
		if pg := n.pages[pos/memPage]; pg != nil {
			copy(p[i:i+c], pg[po:po+c])
		} else {
			clear(p[i : i+c])
		}
		i += c
	}
	if want < len(p) {
		return want, io.EOF
	}
	return want, nil
}

func (f *memFile) WriteAt(p []byte, off int64) (int, error) {
	if err := f.check("write", p, off); err != nil {
		return 0, err
	}
	n := f.node
	n.mu.Lock()
	defer n.mu.Unlock()
	for i := 0; i < len(p); {
		pos := off + int64(i)
		po := int(pos % memPage)
		c := min(memPage-po, len(p)-i)
		pg := n.pages[pos/memPage]
		if pg == nil {
			pg = new([memPage]byte)
			n.pages[pos/memPage] = pg
		}
		copy(pg[po:po+c], p[i:i+c])
		i += c
	}
	n.size = max(n.size, off+int64(len(p)))
	return len(p), nil
}

func (f *memFile) Preallocate(size int64) error {
	if f.closed.Load() {
		return &os.PathError{Op: "fallocate", Path: f.name, Err: os.ErrClosed}
	}
	n := f.node
	n.mu.Lock()
	defer n.mu.Unlock()
	n.size = max(n.size, size)
	return nil
}

func (f *memFile) Sync() error {
	if f.closed.Load() {
		return &os.PathError{Op: "sync", Path: f.name, Err: os.ErrClosed}
	}
	return nil
}

func (f *memFile) Close() error {
	if f.closed.Swap(true) {
		return &os.PathError{Op: "close", Path: f.name, Err: os.ErrClosed}
	}
	return nil
}

func (f *memFile) Name() string { return f.name }

type memInfo struct {
	name string
	size int64
	mode fs.FileMode
}

func (i memInfo) Name() string       { return i.name }
func (i memInfo) Size() int64        { return i.size }
func (i memInfo) Mode() fs.FileMode  { return i.mode }
func (i memInfo) ModTime() time.Time { return time.Time{} }
func (i memInfo) IsDir() bool        { return i.mode.IsDir() }
func (i memInfo) Sys() any           { return nil }
