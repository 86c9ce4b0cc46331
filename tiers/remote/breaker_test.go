package remote

import (
	"testing"
	"time"
)

func TestBreaker(t *testing.T) {
	now := time.Unix(1000, 0)
	b := newBreaker()
	b.now = func() time.Time { return now }
	const a = "10.0.0.1:6379"
	if b.open(a) || b.open("") {
		t.Fatal("open before any failure")
	}
	for i, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 8 * time.Second} {
		b.trip(a)
		b.trip(a) // a second failure of the same moment does not lengthen it
		if !b.open(a) {
			t.Fatalf("trip %d: not open", i)
		}
		now = now.Add(want - time.Millisecond)
		if !b.open(a) {
			t.Fatalf("trip %d: closed before %s", i, want)
		}
		now = now.Add(time.Millisecond)
		if b.open(a) {
			t.Fatalf("trip %d: still open after %s", i, want)
		}
	}
	b.trip(a)
	b.reset(a)
	if b.open(a) || len(b.tripped()) != 0 {
		t.Fatal("open after reset")
	}
	b.trip(a)
	if b.nodes[a].backoff != time.Second {
		t.Fatalf("back-off after a reset: %s, want 1s", b.nodes[a].backoff)
	}
}
