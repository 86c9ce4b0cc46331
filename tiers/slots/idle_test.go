package slots

import (
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// ReleaseIdle frees an unpinned slot at once and leaves a pinned one as
// it was.
func TestReleaseIdle(t *testing.T) {
	sp, _ := newSpace(t, 1<<20, 1<<20)
	c, err := sp.Class(512 << 10)
	if err != nil {
		t.Fatal(err)
	}
	c.Admit([]index.Key{key(1), key(2)})
	a, _ := c.Alloc()
	b, _ := c.Alloc()
	if _, ok := c.Alloc(); ok {
		t.Fatal("a third 512 KiB slot in 1 MiB")
	}
	// a: the writer's pin from Alloc is still there.
	if sp.ReleaseIdle(a) {
		t.Fatal("a pinned slot was released")
	}
	sp.Unpin(a)
	sp.Unpin(b)
	sp.Pin(b) // a load reads b
	if sp.ReleaseIdle(b) {
		t.Fatal("a slot a load reads was released")
	}
	if !sp.ReleaseIdle(a) {
		t.Fatal("an idle slot was not released")
	}
	if s, ok := c.Alloc(); !ok || s != a {
		t.Fatalf("after ReleaseIdle: Alloc %d %v, want slot %d", s, ok, a)
	}
	sp.Unpin(b)
	if used, blocks := sp.Usage(); used != 1<<20 || blocks != 2 {
		t.Errorf("usage %d bytes, %d blocks; want both slots in use", used, blocks)
	}
}
