// Package leakcheck checks that tests leave no goroutine behind, as goleak
// does, but gives the goroutines that are on their way out (a connection's
// reader after its Close, a worker after its engine's) as long as a loaded
// machine may take to run them. goleak alone retries for about 0.4 s,
// which a busy machine under the race detector can exceed (issue 26); the
// wait here is a hang guard, and a test without a leak does not wait.
package leakcheck

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Wait is how long Find keeps retrying while goroutines are left.
const Wait = 30 * time.Second

// Find is goleak.Find, retried until no goroutine is left or Wait passed.
func Find(opts ...goleak.Option) error {
	deadline := time.Now().Add(Wait)
	for {
		err := goleak.Find(opts...)
		if err == nil || time.Now().After(deadline) {
			return err
		}
	}
}

// VerifyNone fails t if goroutines are still left after Wait.
func VerifyNone(t testing.TB, opts ...goleak.Option) {
	t.Helper()
	if err := Find(opts...); err != nil {
		t.Error(err)
	}
}

// VerifyTestMain runs the tests and, if they passed, fails the run when
// goroutines are still left after Wait.
func VerifyTestMain(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	if code == 0 {
		if err := Find(opts...); err != nil {
			fmt.Fprintln(os.Stderr, "leaked goroutines:", err)
			code = 1
		}
	}
	os.Exit(code)
}
