package offload

import (
	"context"
	"fmt"
	"time"
)

// The results of a registration's jobs wait in its queue until the client
// has them. Each result gets a sequence number (Seq, from 1, one counter per
// registration). A client that passes an acknowledgement (the Seq of the
// last result it processed) is answered with every result after it, and
// results leave the queue only when acknowledged: a reply lost with its
// connection is sent again. A client that passes none gets each result
// once, as before the cursor existed. Either way one reply carries at most
// MaxReplyBytes; the rest wait for the next call (More says so). A Store or
// Load with wait follows the same rule (see waiter): with an ack_seq its
// results are queued too, and the reply only carries copies. A Store or
// Load without wait but with an ack_seq answers as a Completions call with
// that ack_seq and no wait would: the finished results ride on a call the
// client makes anyway, one round trip less per engine step.

// Bytes a result can take on the wire, at most: protobuf's encoding of a
// JobResult in a repeated field with every varint at its longest, and of a
// BlockFailure with a 32-byte hash.
const (
	resultOverhead = 64
	failureBytes   = 50
	replyOverhead  = 32
)

// resultBytes bounds the encoded size of a result.
func resultBytes(requestID, failures int) int {
	return resultOverhead + requestID + failures*failureBytes
}

func (r *Result) wireBytes() int { return resultBytes(len(r.RequestID), len(r.Failures)) }

// worstBytes bounds the result a job can produce: every block failed.
func (j *Job) worstBytes() int { return resultBytes(len(j.RequestID), len(j.BlockIDs)) }

// MaxReplyBytes is the most a reply carrying results takes: every job of
// the largest request failing every block, with the longest request ids. A
// Transfer reply with wait never exceeds it; Completions replies are cut
// to it. The server's send limit must allow it.
func (l Limits) MaxReplyBytes() int {
	return replyOverhead + l.MaxJobsPerRequest*(resultOverhead+l.MaxRequestID) + l.MaxBlocksPerRequest*failureBytes
}

// Completed is one Completions answer.
type Completed struct {
	Results []Result
	// Pending is the registration's jobs accepted and not yet finished.
	Pending int
	// More is set when finished results did not fit in this answer.
	More bool
}

// Completions returns the registration's finished results, waiting up to
// wait for one when there is none, at most max of them (0: no count limit)
// and at most MaxReplyBytes. With ack (the Seq of the last result the
// client processed) the results up to it leave the queue and the others
// stay until acknowledged; without, the results returned leave the queue.
func (r *Registration) Completions(ctx context.Context, wait time.Duration, max int, ack *uint64) (Completed, error) {
	var timer <-chan time.Time
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		timer = t.C
	}
	// Once the daemon is stopping nothing new is accepted: a long poll
	// waits only while jobs of the registration are pending (the drain
	// finishes them), and returns at once when none is.
	closing, stopping := r.s.closing, false
	for {
		r.mu.Lock()
		if ack != nil {
			r.ackLocked(*ack)
		}
		if r.mu.closed && len(r.mu.pending) == 0 {
			r.mu.Unlock()
			return Completed{}, fmt.Errorf("%w: registration_id %d was unregistered", ErrUnknownRegistration, r.ID)
		}
		if len(r.mu.done) > 0 || timer == nil || (stopping && len(r.mu.pending) == 0) {
			res := r.finishedLocked(max, ack != nil)
			r.mu.Unlock()
			return res, nil
		}
		notify := r.mu.notify
		r.mu.Unlock()
		select {
		case <-notify:
		case <-timer:
			timer = nil
		case <-ctx.Done():
			return Completed{}, ctx.Err()
		case <-closing:
			closing, stopping = nil, true
		}
	}
}

// finishedLocked answers with the queue's oldest results, at most max (0:
// no count limit) and at most what one reply carries, never less than one
// when there is one. Unless the caller acknowledges (keep), they leave the
// queue as they are returned. Completions and a Store or Load that
// acknowledges without waiting (its results piggybacked on the reply) both
// answer with it, so the two replies are cut alike.
func (r *Registration) finishedLocked(max int, keep bool) Completed {
	n := len(r.mu.done)
	if max > 0 && n > max {
		n = max
	}
	budget := r.s.lim.MaxReplyBytes() - replyOverhead
	size := 0
	for i := 0; i < n; i++ {
		size += r.mu.done[i].wireBytes()
		if size > budget && i > 0 {
			n = i
			break
		}
	}
	out := make([]Result, n)
	copy(out, r.mu.done)
	res := Completed{Results: out, Pending: len(r.mu.pending), More: len(r.mu.done) > n}
	if !keep {
		r.dropLocked(n)
	} else if n > 0 && out[n-1].Seq > r.mu.sent {
		r.mu.sent = out[n-1].Seq
	}
	if n > 0 {
		r.s.signalRead()
	}
	return res
}

// ackLocked drops the results up to seq.
func (r *Registration) ackLocked(seq uint64) {
	n := 0
	for n < len(r.mu.done) && r.mu.done[n].Seq <= seq {
		n++
	}
	r.dropLocked(n)
}

// dropLocked takes the first n results off the queue.
func (r *Registration) dropLocked(n int) {
	if n == 0 {
		return
	}
	for i := 0; i < n; i++ {
		r.mu.doneBytes -= r.mu.done[i].wireBytes()
	}
	rest := copy(r.mu.done, r.mu.done[n:])
	clear(r.mu.done[rest:])
	r.mu.done = r.mu.done[:rest]
}

// queueLocked gives res its sequence number and queues it; it returns res
// with its Seq.
func (r *Registration) queueLocked(res Result) Result {
	r.mu.seq++
	res.Seq = r.mu.seq
	r.mu.done = append(r.mu.done, res)
	r.mu.doneBytes += res.wireBytes()
	return res
}

// waiter collects the results of a Transfer with wait set. Its fields are
// guarded by the registration's mu.
//
// A caller that acknowledges (it passed ack_seq) has every result queued
// with its Seq as it finishes, like any other, and gets a copy: the results
// stay until an ack_seq covers them, so a reply it never read is sent again
// by Completions. A caller that does not has its results returned in the
// reply instead, with Seq 0, and they leave the daemon as they are sent;
// if it gives up waiting, even once every result is in, they are queued
// for Completions, and so are those still to come.
type waiter struct {
	results   []Result
	left      int
	done      chan struct{}
	acks      bool
	abandoned bool
}

// deliver settles a finished job: it leaves pending and its result goes to
// the waiter, the queue, or both (see waiter).
func (r *Registration) deliver(w *waiter, slot int, res Result, worst int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.mu.pending, res.JobID)
	waiting := w != nil && !w.abandoned
	if waiting && !w.acks {
		// The job's reserved bytes stay until Transfer returns.
		w.results[slot] = res
	} else {
		// Kept while the registration drains, so a client that lost its
		// connection can still read them; close drops what is left.
		r.mu.reserved -= worst
		res = r.queueLocked(res)
		if waiting {
			w.results[slot] = res
		}
	}
	if waiting {
		w.left--
		if w.left == 0 {
			close(w.done)
		}
	}
	r.wakeLocked()
}

// wakeLocked wakes the Completions calls waiting for a result.
func (r *Registration) wakeLocked() {
	close(r.mu.notify)
	r.mu.notify = make(chan struct{})
}

// waitResults waits for a Transfer's results. If ctx ends first, or ends
// as the last result comes in (the caller would not read the reply), the
// results go to Completions.
func (r *Registration) waitResults(ctx context.Context, w *waiter, jobs []Job) ([]Result, error) {
	select {
	case <-w.done:
	case <-ctx.Done():
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if w.left == 0 && ctx.Err() == nil {
		if !w.acks {
			for i := range jobs {
				r.mu.reserved -= jobs[i].worstBytes()
			}
		}
		return w.results, nil
	}
	w.abandoned = true
	if !w.acks {
		for i, res := range w.results {
			if res.Op == 0 {
				continue // still running: deliver queues it
			}
			r.mu.reserved -= jobs[i].worstBytes()
			if !r.mu.closed {
				r.queueLocked(res)
			}
		}
		r.wakeLocked()
	}
	return nil, ctx.Err()
}
