package testenv

import (
	"sync"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// GateFS wraps a vfs.FS so a test can stop the disk tier's recovery in
// the middle, deterministically: reads of at least MinBytes from the slot
// files (recovery reads windows of up to 4 MiB; a block's read is its 4 KiB
// header and its payload, smaller in tests) pass until Allow of them have,
// then wait until Release. Everything else passes.
type GateFS struct {
	vfs.FS
	minBytes int

	mu      sync.Mutex
	cond    sync.Cond
	allow   int // reads that may pass before the gate closes; < 0: open
	passed  int
	waiting int
}

// NewGateFS lets allow big reads pass, then holds the others; allow < 0
// starts open.
func NewGateFS(inner vfs.FS, minBytes, allow int) *GateFS {
	g := &GateFS{FS: inner, minBytes: minBytes, allow: allow}
	g.cond.L = &g.mu
	return g
}

// OpenFile wraps the file so its big reads go through the gate.
func (g *GateFS) OpenFile(path string, size int64, direct bool) (vfs.File, error) {
	f, err := g.FS.OpenFile(path, size, direct)
	if err != nil {
		return nil, err
	}
	return &bigReadFile{File: f, g: g}, nil
}

// Waiting blocks until n big reads are held at the gate.
func (g *GateFS) Waiting(n int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for g.waiting < n {
		g.cond.Wait()
	}
}

// Release opens the gate for good.
func (g *GateFS) Release() {
	g.mu.Lock()
	g.allow = -1
	g.mu.Unlock()
	g.cond.Broadcast()
}

// Passed counts the big reads that went through.
func (g *GateFS) Passed() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.passed
}

type bigReadFile struct {
	vfs.File
	g *GateFS
}

func (f *bigReadFile) ReadAt(p []byte, off int64) (int, error) {
	if g := f.g; len(p) >= g.minBytes {
		g.mu.Lock()
		counted := false
		for g.allow >= 0 && g.passed >= g.allow {
			if !counted {
				g.waiting++
				counted = true
				g.cond.Broadcast()
			}
			g.cond.Wait()
		}
		if counted {
			g.waiting--
		}
		g.passed++
		g.mu.Unlock()
	}
	return f.File.ReadAt(p, off)
}
