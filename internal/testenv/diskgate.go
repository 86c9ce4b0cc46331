package testenv

import (
	"path/filepath"
	"sync"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// DiskGate wraps a filesystem: while held, writes to slot files wait (and,
// with HoldReads, reads), so a test can act on the daemon with disk I/O in
// flight. Use it as Options.DiskFS.
type DiskGate struct {
	vfs.FS
	mu           sync.Mutex
	cond         sync.Cond
	held         bool
	waiting      int
	readsHeld    bool
	readsWaiting int
}

// NewDiskGate wraps the OS filesystem with an open gate.
func NewDiskGate() *DiskGate {
	g := &DiskGate{FS: vfs.Default}
	g.cond.L = &g.mu
	return g
}

// Hold makes slot-file writes from now on wait.
func (g *DiskGate) Hold() {
	g.mu.Lock()
	g.held = true
	g.mu.Unlock()
}

// Waiting waits until n writes are held.
func (g *DiskGate) Waiting(n int) {
	g.mu.Lock()
	for g.waiting < n {
		g.cond.Wait()
	}
	g.mu.Unlock()
}

// Release lets held writes and every later one through.
func (g *DiskGate) Release() {
	g.mu.Lock()
	g.held = false
	g.cond.Broadcast()
	g.mu.Unlock()
}

// HoldReads makes slot-file reads from now on wait.
func (g *DiskGate) HoldReads() {
	g.mu.Lock()
	g.readsHeld = true
	g.mu.Unlock()
}

// ReadsWaiting waits until n reads are held.
func (g *DiskGate) ReadsWaiting(n int) {
	g.mu.Lock()
	for g.readsWaiting < n {
		g.cond.Wait()
	}
	g.mu.Unlock()
}

// ReleaseReads lets held reads and every later one through.
func (g *DiskGate) ReleaseReads() {
	g.mu.Lock()
	g.readsHeld = false
	g.cond.Broadcast()
	g.mu.Unlock()
}

// OpenFile implements vfs.FS.
func (g *DiskGate) OpenFile(path string, size int64, direct bool) (vfs.File, error) {
	f, err := g.FS.OpenFile(path, size, direct)
	if err != nil || filepath.Ext(path) != ".slots" {
		return f, err
	}
	return &gatedFile{File: f, g: g}, nil
}

type gatedFile struct {
	vfs.File
	g *DiskGate
}

func (f *gatedFile) WriteAt(p []byte, off int64) (int, error) {
	g := f.g
	g.mu.Lock()
	if g.held {
		g.waiting++
		g.cond.Broadcast()
		for g.held {
			g.cond.Wait()
		}
		g.waiting--
	}
	g.mu.Unlock()
	return f.File.WriteAt(p, off)
}

func (f *gatedFile) ReadAt(p []byte, off int64) (int, error) {
	g := f.g
	g.mu.Lock()
	if g.readsHeld {
		g.readsWaiting++
		g.cond.Broadcast()
		for g.readsHeld {
			g.cond.Wait()
		}
		g.readsWaiting--
	}
	g.mu.Unlock()
	return f.File.ReadAt(p, off)
}
