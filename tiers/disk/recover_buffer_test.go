package disk

import (
	"testing"
	"unsafe"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// TestRecoveryBuffer: a reader's buffer is n bytes on a huge page boundary
// inside its mapping, with no room past n, and usable for direct I/O.
func TestRecoveryBuffer(t *testing.T) {
	for _, n := range []int{4096, recoveryWindow, recoveryWindow + 8192, 3 * hugePage} {
		buf, mem, err := recoveryBuffer(n)
		if err != nil {
			t.Fatal(err)
		}
		start := uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
		lo := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
		if len(buf) != n || cap(buf) != n || start%hugePage != 0 || start < lo || start+uintptr(n) > lo+uintptr(len(mem)) {
			t.Fatalf("n=%d: buffer of %d (cap %d) at %#x, mapping %#x+%d", n, len(buf), cap(buf), start, lo, len(mem))
		}
		buf[0], buf[n-1] = 1, 2 // mapped and writable
		if err := vfs.FreeBuffer(mem); err != nil {
			t.Fatal(err)
		}
	}
}
