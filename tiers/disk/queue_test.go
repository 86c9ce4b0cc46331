package disk_test

import (
	"path/filepath"
	"sync"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// heldFS holds every write to a slot file until release is closed, and
// says when the first one arrived.
type heldFS struct {
	vfs.FS
	release chan struct{}
	arrived chan struct{}
	once    sync.Once
}

func (h *heldFS) OpenFile(path string, size int64, direct bool) (vfs.File, error) {
	f, err := h.FS.OpenFile(path, size, direct)
	if err != nil || filepath.Ext(path) != ".slots" {
		return f, err
	}
	return &heldFile{File: f, h: h}, nil
}

type heldFile struct {
	vfs.File
	h *heldFS
}

func (f *heldFile) WriteAt(p []byte, off int64) (int, error) {
	f.h.once.Do(func() { close(f.h.arrived) })
	<-f.h.release
	return f.File.WriteAt(p, off)
}

// A read queued behind writes goes first: it waits only for the write the
// file's one worker has in hand. And a writer feeding the tier through
// WaitWriteRoom waits while the queue holds as many writes as it allows.
func TestReadsBeforeWrites(t *testing.T) {
	mem := vfs.NewMem()
	h := &heldFS{FS: mem, release: make(chan struct{}), arrived: make(chan struct{})}
	cfg := disk.Config{Dirs: []string{"/disk/nvme0"}, BytesPerDir: 8 * chunk, ChunkBytes: chunk, FS: mem, Direct: true, QueueDepth: 1, Logger: quiet()}
	const payload = 64 << 10
	blocks := make([]block, 6)
	for i := range blocks {
		blocks[i] = newBlock(i, payload, 32)
	}
	// The block the read wants is written before the gate goes up (a
	// tier on the plain filesystem, then reopened on the held one).
	first := open(t, cfg)
	s0 := alloc(t, first, payload, blocks[:1])[0]
	if err := writeBlock(t, first, s0, blocks[0]); err != nil {
		t.Fatal(err)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	cfg.FS = h
	tier := open(t, cfg)
	rec := recovered(t, tier)
	if _, ok := rec[s0]; !ok {
		t.Fatalf("slot %d not recovered: %v", s0, rec)
	}
	ss := alloc(t, tier, payload, blocks[1:])

	var mu sync.Mutex
	var order []string
	done := func(what string) func(error) {
		return func(err error) {
			if err != nil {
				t.Errorf("%s: %v", what, err)
			}
			mu.Lock()
			order = append(order, what)
			mu.Unlock()
		}
	}
	var wg sync.WaitGroup
	wg.Add(len(ss) + 1)
	write := func(i int) {
		buf := arena(t, layout.AlignUp(payload))
		blocks[i+1].fill(buf)
		tier.Write(ss[i], blocks[i+1].meta, buf, func(err error) { done("write")(err); wg.Done() })
	}
	write(0)
	<-h.arrived // the worker holds write 0
	for i := 1; i < len(ss); i++ {
		write(i)
	}
	// Four writes wait: a writer allowing four waits, one allowing five
	// does not.
	if !tier.WaitWriteRoom(5, nil) {
		t.Fatal("WaitWriteRoom(5) with 4 writes queued refused")
	}
	stop := make(chan struct{})
	waited := make(chan bool)
	go func() { waited <- tier.WaitWriteRoom(4, stop) }()
	dst := arena(t, layout.AlignUp(payload))
	tier.Read(s0, blocks[0].meta, dst, func(err error) { done("read")(err); wg.Done() })
	close(h.release)
	if !<-waited {
		t.Error("WaitWriteRoom(4) returned false once writes left the queue")
	}
	wg.Wait()
	if want := []string{"write", "read", "write", "write", "write", "write"}; len(order) != len(want) || order[1] != "read" {
		t.Errorf("completion order %v, want %v: the read waited behind queued writes", order, want)
	}
	close(stop)
}
