package errorfs

import (
	"errors"
	"fmt"
)

// ErrInjected matches every error this package injects: errors.Is(err,
// ErrInjected) tells an injected fault from a real one. The injected error
// also matches what a real fault of its kind would (syscall.EIO,
// syscall.ENOSPC, io.EOF), so code under test sees ordinary errors.
var ErrInjected = errors.New("errorfs: injected fault")

// ErrSpec means a --fault-spec string is malformed; the message names the
// offending token.
var ErrSpec = errors.New("fault spec")

// Error is an injected fault.
type Error struct {
	Kind Kind
	Op   Op
	Path string
	Off  int64 // file offset of a read or write, else 0
	Err  error // what a real fault would return: syscall.EIO, syscall.ENOSPC or io.EOF
}

func (e *Error) Error() string {
	return fmt.Sprintf("errorfs: injected %s: %s %s at offset %d: %v", e.Kind, e.Op, e.Path, e.Off, e.Err)
}

// Unwrap returns the error a real fault would give.
func (e *Error) Unwrap() error { return e.Err }

// Is makes every injected error match ErrInjected.
func (e *Error) Is(target error) bool { return target == ErrInjected }
