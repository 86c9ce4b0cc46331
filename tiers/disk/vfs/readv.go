package vfs

import (
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// ReaderVAt is a File that reads into several buffers with one call: the
// disk tier reads a slot's header and payload, which lie back to back in
// the file, in one I/O (preadv) instead of two. Files without it (the
// in-memory FS, the fault injectors) are read with one ReadAt per buffer.
type ReaderVAt interface {
	// ReadvAt fills bufs in order with the bytes from off on. As ReadAt,
	// fewer bytes than asked come with an error.
	ReadvAt(bufs [][]byte, off int64) (int, error)
}

// ReadvAt reads bufs, back to back from off, from f: in one call when f
// is a ReaderVAt, else with one ReadAt per buffer, stopping at the first
// short one.
func ReadvAt(f File, bufs [][]byte, off int64) (int, error) {
	if v, ok := f.(ReaderVAt); ok {
		return v.ReadvAt(bufs, off)
	}
	total := 0
	for _, b := range bufs {
		n, err := f.ReadAt(b, off)
		total += n
		off += int64(n)
		if n < len(b) {
			if err == nil {
				err = io.ErrUnexpectedEOF
			}
			return total, err
		}
	}
	return total, nil
}

// ReadvAt implements ReaderVAt with preadv(2), repeated until every byte
// came or the file ended.
func (f *osFile) ReadvAt(bufs [][]byte, off int64) (int, error) {
	want := 0
	for _, b := range bufs {
		if f.direct {
			if err := CheckAlignment(b, off+int64(want)); err != nil {
				return 0, fmt.Errorf("read %s: %w", f.f.Name(), err)
			}
		}
		want += len(b)
	}
	rc, err := f.f.SyscallConn()
	if err != nil {
		return 0, err
	}
	total := 0
	for total < want {
		var n int
		var rerr error
		if err := rc.Control(func(fd uintptr) {
			n, rerr = unix.Preadv(int(fd), rest(bufs, total), off+int64(total))
		}); err != nil {
			return total, err
		}
		if rerr == unix.EINTR {
			continue
		}
		if rerr != nil {
			return total, &os.PathError{Op: "read", Path: f.f.Name(), Err: rerr}
		}
		if n == 0 {
			return total, io.EOF
		}
		total += n
	}
	return total, nil
}

// rest is bufs without their first skip bytes.
func rest(bufs [][]byte, skip int) [][]byte {
	for len(bufs) > 0 && skip >= len(bufs[0]) {
		skip -= len(bufs[0])
		bufs = bufs[1:]
	}
	if skip == 0 || len(bufs) == 0 {
		return bufs
	}
	out := append([][]byte{bufs[0][skip:]}, bufs[1:]...)
	return out
}
