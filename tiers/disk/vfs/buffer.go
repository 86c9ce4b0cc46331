package vfs

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// AlignedBuffer returns n bytes of zeroed, page-aligned memory mapped
// outside the Go heap, usable for direct I/O when n is a multiple of
// Alignment. It is for tests and tools: the daemon's buffers come from its
// host arena. Release it with FreeBuffer.
func AlignedBuffer(n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("vfs: aligned buffer of %d bytes", n)
	}
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("vfs: mmap %d bytes: %w", n, err)
	}
	return b, nil
}

// FreeBuffer unmaps a buffer from AlignedBuffer. b must be the slice
// AlignedBuffer returned (reslicing its length is fine, its start is not);
// b must not be used afterwards.
func FreeBuffer(b []byte) error {
	return unix.Munmap(b[:cap(b)])
}
