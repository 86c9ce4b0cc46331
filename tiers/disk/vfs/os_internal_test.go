package vfs

import (
	"errors"
	"io/fs"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// The kernel on a test machine may have no filesystem that refuses
// O_DIRECT (tmpfs accepts it since 6.6), so the EINVAL mapping is checked
// on the error itself.
func TestDirectError(t *testing.T) {
	einval := &os.PathError{Op: "open", Path: "/dev/shm/x", Err: unix.EINVAL}
	err := directError(einval, "/dev/shm/x")
	if !errors.Is(err, ErrDirectUnsupported) || !errors.Is(err, unix.EINVAL) {
		t.Errorf("EINVAL: %v; want ErrDirectUnsupported wrapping EINVAL", err)
	}
	if !strings.Contains(err.Error(), "tmpfs") || !strings.Contains(err.Error(), "/dev/shm/x") {
		t.Errorf("message %q should name the path and the tmpfs case", err)
	}
	enoent := &os.PathError{Op: "open", Path: "/x", Err: fs.ErrNotExist}
	if err := directError(enoent, "/x"); err != enoent {
		t.Errorf("ENOENT: %v; want it unchanged", err)
	}
}
