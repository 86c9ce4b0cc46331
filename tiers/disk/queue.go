package disk

import "sync"

// queue is a file's requests waiting for an I/O worker: reads first, then
// writes and discards, each in arrival order. A load's reads are what an
// engine's step waits for; a write only holds a CPU slot a little longer,
// so a read never waits behind a burst of demotions, only for a worker to
// finish the I/O it has in hand. Pushing never blocks; the owner bounds
// what it queues (WaitWriteRoom).
type queue struct {
	mu     sync.Mutex
	cond   sync.Cond
	reads  fifo
	writes fifo // writes and discards
	closed bool
	// popped is signalled when a write leaves the queue (WaitWriteRoom).
	popped chan struct{}
}

type fifo struct {
	reqs []*request
	head int
}

func (f *fifo) len() int { return len(f.reqs) - f.head }

func (f *fifo) push(r *request) {
	if f.head > 64 && f.head > len(f.reqs)/2 {
		n := copy(f.reqs, f.reqs[f.head:])
		clear(f.reqs[n:])
		f.reqs, f.head = f.reqs[:n], 0
	}
	f.reqs = append(f.reqs, r)
}

func (f *fifo) pop() *request {
	r := f.reqs[f.head]
	f.reqs[f.head] = nil
	f.head++
	if f.head == len(f.reqs) {
		f.reqs, f.head = f.reqs[:0], 0
	}
	return r
}

func (q *queue) init() {
	q.cond.L = &q.mu
	q.popped = make(chan struct{}, 1)
}

func (q *queue) push(r *request) bool {
	q.mu.Lock()
	if q.closed || q.cond.L == nil {
		q.mu.Unlock()
		return false
	}
	if r.op == opRead {
		q.reads.push(r)
	} else {
		q.writes.push(r)
	}
	q.mu.Unlock()
	q.cond.Signal()
	return true
}

// pop waits for a request, a read if any waits; false once the queue is
// closed and drained.
func (q *queue) pop() (*request, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for q.reads.len() == 0 && q.writes.len() == 0 && !q.closed {
		q.cond.Wait()
	}
	switch {
	case q.reads.len() > 0:
		return q.reads.pop(), true
	case q.writes.len() > 0:
		r := q.writes.pop()
		select {
		case q.popped <- struct{}{}:
		default:
		}
		return r, true
	}
	return nil, false
}

// queuedWrites is the writes and discards waiting for a worker.
func (q *queue) queuedWrites() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.writes.len()
}

func (q *queue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.cond.Broadcast()
}

// WaitWriteRoom waits until fewer than limit writes and discards wait for
// an I/O worker on each file, or stop is closed (false). A writer that
// feeds the tier through it, one write after each wait, keeps the queue a
// read may find ahead of it about limit long, whatever its own backlog. It
// takes no slot: the caller waits before it allocates one, and so before
// any lock it holds while it allocates and submits.
func (t *Tier) WaitWriteRoom(limit int, stop <-chan struct{}) bool {
	for i := range t.files {
		q := &t.files[i].q
		for q.queuedWrites() >= limit {
			select {
			case <-q.popped:
			case <-stop:
				return false
			}
		}
	}
	return true
}

// QueuedWrites is the writes and discards waiting for an I/O worker, all
// files together.
func (t *Tier) QueuedWrites() int {
	n := 0
	for i := range t.files {
		n += t.files[i].q.queuedWrites()
	}
	return n
}
