package events

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// vLLM's replay socket (ZmqEventPublisher's replay_endpoint,
// vllm/distributed/kv_events.py): a ROUTER that answers a request
// [identity, "", start_seq (8 bytes, big-endian)] with
// [identity, "", seq, payload] for every buffered batch from start_seq on,
// then [identity, "", END_SEQ (-1, 8 bytes), ""]. On the wire a peer (a
// DEALER, or a REQ) sends the frames ["", start_seq] and reads
// ["", seq, payload]: the identity frame is the ROUTER's own bookkeeping
// of which connection asked, so the replay server below answers each
// request on the connection it came from.
//
// It speaks ZMTP 3 (rfc.zeromq.org/spec/23, NULL security) itself rather
// than through go-zeromq/zmq4's ROUTER: that one allocates whatever frame
// size a peer announces (a hostile 2^62-byte header ends the process),
// has no handshake or write deadline (a peer that stops reading stalls
// every other one), and accepts connections without bound.

// Replay defaults: vLLM's buffer_steps, and a memory bound (a batch is at
// most about 140 KiB; a snapshot of a million blocks is about 10 MiB).
const (
	DefaultReplayBatches = 10000
	DefaultReplayBytes   = 64 << 20
)

// The replay server's bounds (docs/operations.md, Limits).
const (
	// ReplayMaxConns bounds the replay connections open at once; past it
	// a connection is closed at accept.
	ReplayMaxConns = 64
	// replayHandshake bounds a connection's ZMTP handshake.
	replayHandshake = 10 * time.Second
	// ReplayIdle closes a connection that sent no request for this long
	// (a ZeroMQ peer reconnects by itself when it next sends).
	ReplayIdle = 5 * time.Minute
	// ReplayWriteTimeout bounds each message of a reply: a peer that stops
	// reading is disconnected rather than holding its slot.
	ReplayWriteTimeout = 10 * time.Second
	// replayMaxFrame bounds a frame a peer sends (a request's are 0 and 8
	// bytes; the handshake's READY a few dozen); replayMaxFrames the
	// frames of one message. Past either the connection is closed.
	replayMaxFrame  = 1024
	replayMaxFrames = 8
	// replayOverhead is what the buffer counts per batch beside its
	// payload (the entry and the slice headers).
	replayOverhead = 64
)

// endSeq is vLLM's END_SEQ: -1 as 8 bytes, signed, big-endian.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// replayBuf keeps the last published batches, bounded in count and bytes.
// Batches are kept in publication order with consecutive seqs; a payload
// is never changed once added, so a reader may use it after the lock.
type replayBuf struct {
	maxN     int
	maxBytes int64

	mu    sync.Mutex
	ring  []replayBatch // len maxN; the batch of seq q is at q % maxN
	first uint64        // the oldest seq held
	n     int           // batches held: first .. first+n-1
	bytes int64
}

type replayBatch struct {
	seq     uint64
	payload []byte
}

func newReplayBuf(maxN int, maxBytes int64) *replayBuf {
	return &replayBuf{maxN: maxN, maxBytes: maxBytes, ring: make([]replayBatch, maxN)}
}

func batchBytes(p []byte) int64 { return int64(len(p)) + replayOverhead }

// add keeps the batch of seq (the one after the last added), dropping the
// oldest ones past the bounds. A batch larger than the whole byte bound
// is not kept: the buffer restarts after it (a replay from before it
// starts past it, which its requester sees as a gap).
func (b *replayBuf) add(seq uint64, payload []byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	sz := batchBytes(payload)
	if b.n > 0 && seq != b.first+uint64(b.n) {
		b.dropLocked(b.n) // not the next one: start over, never a hole
	}
	if sz > b.maxBytes {
		b.dropLocked(b.n)
		return
	}
	for b.n > 0 && (b.n == b.maxN || b.bytes+sz > b.maxBytes) {
		b.dropLocked(1)
	}
	if b.n == 0 {
		b.first = seq
	}
	b.ring[seq%uint64(b.maxN)] = replayBatch{seq: seq, payload: payload}
	b.n++
	b.bytes += sz
}

func (b *replayBuf) dropLocked(k int) {
	for ; k > 0; k-- {
		sl := &b.ring[b.first%uint64(b.maxN)]
		b.bytes -= batchBytes(sl.payload)
		*sl = replayBatch{}
		b.first++
		b.n--
	}
}

// get returns the batch of seq q if it is held.
func (b *replayBuf) get(q uint64) ([]byte, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.n == 0 || q < b.first || q-b.first >= uint64(b.n) {
		return nil, false
	}
	return b.ring[q%uint64(b.maxN)].payload, true
}

// span is the seqs held: first, and one past the last (equal: none).
func (b *replayBuf) span() (first, end uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.first, b.first + uint64(b.n)
}

// usage is the batches held and the bytes they count.
func (b *replayBuf) usage() (n int, bytes int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n, b.bytes
}

// ReplayStats counts what the replay socket did.
type ReplayStats struct {
	Batches   int    // batches buffered now
	Bytes     int64  // their bytes (payloads and overhead)
	Requests  uint64 // replay requests answered
	Sent      uint64 // batches sent in replies
	Malformed uint64 // requests not of vLLM's form, ignored
	Refused   uint64 // connections closed at accept (past ReplayMaxConns)
	Dropped   uint64 // connections closed for a bad handshake or frame, a write timeout, or idleness
	Conns     int    // connections open
	Truncated uint64 // replies that stopped at a batch the buffer dropped meanwhile
}

// replayServer answers replay requests from buf on lis.
type replayServer struct {
	lis net.Listener
	buf *replayBuf
	log *slog.Logger
	// writeTimeout and idle are ReplayWriteTimeout and ReplayIdle (tests
	// shorten them).
	writeTimeout, idle time.Duration

	wg sync.WaitGroup
	mu struct {
		sync.Mutex
		conns  map[net.Conn]struct{}
		closed bool
	}

	requests, sent, malformed, refused, dropped, truncated atomic.Uint64
	lastWarn                                               atomic.Int64 // unix nanos of the last rate-limited warning
}

// listenReplay binds a tcp://HOST:PORT or ipc://PATH endpoint.
func listenReplay(ep string) (net.Listener, error) {
	if p, ok := strings.CutPrefix(ep, "ipc://"); ok {
		// As ZeroMQ does: a stale socket file of an earlier run is replaced.
		if fi, err := os.Lstat(p); err == nil && fi.Mode()&os.ModeSocket != 0 {
			os.Remove(p)
		}
		return net.Listen("unix", p)
	}
	if hp, ok := strings.CutPrefix(ep, "tcp://"); ok {
		// As ZeroMQ reads it: tcp://*:PORT is every interface.
		if rest, ok := strings.CutPrefix(hp, "*:"); ok {
			hp = ":" + rest
		}
		return net.Listen("tcp", hp)
	}
	return nil, fmt.Errorf("want tcp://HOST:PORT or ipc://PATH")
}

func newReplayServer(lis net.Listener, buf *replayBuf, log *slog.Logger) *replayServer {
	s := &replayServer{lis: lis, buf: buf, log: log, writeTimeout: ReplayWriteTimeout, idle: ReplayIdle}
	s.mu.conns = map[net.Conn]struct{}{}
	s.wg.Add(1)
	go s.accept()
	return s
}

func (s *replayServer) accept() {
	defer s.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		c, err := s.lis.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors, say: the listener stays, and
			// accepting resumes once it can.
			s.warn("events: replay socket cannot accept", "err", err, "retry_in", backoff)
			time.Sleep(backoff)
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		s.mu.Lock()
		if s.mu.closed || len(s.mu.conns) >= ReplayMaxConns {
			closed := s.mu.closed
			s.mu.Unlock()
			c.Close()
			if !closed {
				s.refused.Add(1)
				s.warn("events: replay connection refused: too many open", "max", ReplayMaxConns)
			}
			continue
		}
		s.mu.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(c)
	}
}

// close stops accepting, closes every connection and waits for their
// goroutines.
func (s *replayServer) close() error {
	err := s.lis.Close()
	s.mu.Lock()
	s.mu.closed = true
	for c := range s.mu.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}

func (s *replayServer) stats() ReplayStats {
	st := ReplayStats{Requests: s.requests.Load(), Sent: s.sent.Load(), Malformed: s.malformed.Load(),
		Refused: s.refused.Load(), Dropped: s.dropped.Load(), Truncated: s.truncated.Load()}
	st.Batches, st.Bytes = s.buf.usage()
	s.mu.Lock()
	st.Conns = len(s.mu.conns)
	s.mu.Unlock()
	return st
}

// warn logs at most once a second: a peer's flood of bad input does not
// flood the log (the counters count every one).
func (s *replayServer) warn(msg string, args ...any) {
	now := time.Now().UnixNano()
	last := s.lastWarn.Load()
	if now-last < int64(time.Second) || !s.lastWarn.CompareAndSwap(last, now) {
		return
	}
	s.log.Warn(msg, args...)
}

// errZMTP is a peer that does not speak ZMTP 3 as a ROUTER's peer must.
var errZMTP = errors.New("zmtp")

func zmtpErr(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errZMTP}, args...)...)
}

func (s *replayServer) serve(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		c.Close()
		s.mu.Lock()
		delete(s.mu.conns, c)
		s.mu.Unlock()
	}()
	r := bufio.NewReaderSize(c, 512)
	if err := handshake(c, r); err != nil {
		s.drop(c, "handshake", err)
		return
	}
	for {
		c.SetReadDeadline(time.Now().Add(s.idle))
		frames, cmd, err := readMsg(r, replayMaxFrame)
		if err != nil {
			s.drop(c, "request", err)
			return
		}
		if cmd {
			if err := pong(c, frames[0], s.writeTimeout); err != nil {
				s.drop(c, "pong", err)
				return
			}
			continue
		}
		start, ok := parseRequest(frames)
		if !ok {
			s.malformed.Add(1)
			s.warn("events: malformed replay request ignored (want the frames \"\" and an 8-byte big-endian start seq)", "peer", c.RemoteAddr().String(), "frames", len(frames))
			continue
		}
		s.requests.Add(1)
		if err := s.reply(c, start); err != nil {
			s.drop(c, "reply", err)
			return
		}
	}
}

func (s *replayServer) drop(c net.Conn, what string, err error) {
	s.mu.Lock()
	closed := s.mu.closed
	s.mu.Unlock()
	if closed || errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
		return // the peer went, or the daemon is stopping
	}
	s.dropped.Add(1)
	var ne net.Error
	if what == "request" && errors.As(err, &ne) && ne.Timeout() {
		// Idle: the peer's ZeroMQ socket reconnects when it next asks.
		s.log.Debug("events: idle replay connection closed", "peer", c.RemoteAddr().String(), "idle", s.idle)
		return
	}
	s.warn("events: replay connection closed", "peer", c.RemoteAddr().String(), "in", what, "err", err)
}

// parseRequest reads [“”, start_seq]. vLLM reads start_seq with
// int.from_bytes(frame, "big"): 1 to 8 bytes are taken the same way.
func parseRequest(frames [][]byte) (uint64, bool) {
	if len(frames) != 2 || len(frames[0]) != 0 || len(frames[1]) == 0 || len(frames[1]) > 8 {
		return 0, false
	}
	var q uint64
	for _, b := range frames[1] {
		q = q<<8 | uint64(b)
	}
	return q, true
}

// reply sends every batch held from start on, up to the last one
// published when the request came, then END_SEQ. A batch the buffer drops
// while the reply is under way ends it early: the reply never skips one,
// so its requester sees the rest as a gap still to fill.
func (s *replayServer) reply(c net.Conn, start uint64) error {
	first, end := s.buf.span()
	var seqb [8]byte
	for q := max(start, first); q < end; q++ {
		p, ok := s.buf.get(q)
		if !ok {
			s.truncated.Add(1)
			break
		}
		binary.BigEndian.PutUint64(seqb[:], q)
		if err := writeMsg(c, seqb[:], p, s.writeTimeout); err != nil {
			return err
		}
		s.sent.Add(1)
	}
	return writeMsg(c, endSeq, nil, s.writeTimeout)
}

// ZMTP 3 framing.

const (
	flagMore    = 1
	flagLong    = 2
	flagCommand = 4
)

// greeting is ZMTP 3.1's, NULL mechanism, as-server 0.
func greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9] = 0xff, 0x7f
	g[10], g[11] = 3, 1
	copy(g[12:], "NULL")
	return g
}

// handshake exchanges greetings and READY commands with a peer, which must
// be a DEALER, a REQ or a ROUTER (ZMTP's peers of a ROUTER).
func handshake(c net.Conn, r *bufio.Reader) error {
	c.SetDeadline(time.Now().Add(replayHandshake))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write(greeting()); err != nil {
		return err
	}
	var g [64]byte
	if _, err := io.ReadFull(r, g[:]); err != nil {
		return err
	}
	if g[0] != 0xff || g[9]&1 != 1 {
		return zmtpErr("not a ZMTP 3 greeting")
	}
	if g[10] < 3 {
		return zmtpErr("ZMTP version %d.%d, want 3", g[10], g[11])
	}
	if mech := strings.TrimRight(string(g[12:32]), "\x00"); mech != "NULL" {
		return zmtpErr("security mechanism %q, want NULL", mech)
	}
	ready := appendCommand(nil, "READY", appendProp(nil, "Socket-Type", "ROUTER"))
	if _, err := c.Write(ready); err != nil {
		return err
	}
	frames, cmd, err := readMsg(r, replayMaxFrame)
	if err != nil {
		return err
	}
	name, props, ok := parseCommand(frames[0])
	if !cmd || !ok || name != "READY" {
		return zmtpErr("want a READY command")
	}
	md, ok := parseProps(props)
	if !ok {
		return zmtpErr("malformed READY metadata")
	}
	switch strings.ToUpper(md["socket-type"]) {
	case "DEALER", "REQ", "ROUTER":
		return nil
	}
	return zmtpErr("peer socket type %q cannot talk to a ROUTER", md["socket-type"])
}

// readMsg reads one message (frames until one without MORE), or one
// command (cmd true, its body in frames[0]), of frames of at most maxFrame
// bytes (a peer's: replayMaxFrame) and at most replayMaxFrames frames.
func readMsg(r *bufio.Reader, maxFrame uint64) (frames [][]byte, cmd bool, err error) {
	for {
		flags, err := r.ReadByte()
		if err != nil {
			return nil, false, err
		}
		if flags&^(flagMore|flagLong|flagCommand) != 0 {
			return nil, false, zmtpErr("frame flags %#x", flags)
		}
		var size uint64
		if flags&flagLong != 0 {
			var b [8]byte
			if _, err := io.ReadFull(r, b[:]); err != nil {
				return nil, false, err
			}
			size = binary.BigEndian.Uint64(b[:])
		} else {
			b, err := r.ReadByte()
			if err != nil {
				return nil, false, err
			}
			size = uint64(b)
		}
		if size > maxFrame {
			return nil, false, zmtpErr("a frame of %d bytes, at most %d", size, maxFrame)
		}
		body := make([]byte, size)
		if _, err := io.ReadFull(r, body); err != nil {
			return nil, false, err
		}
		if flags&flagCommand != 0 {
			if len(frames) > 0 || flags&flagMore != 0 {
				return nil, false, zmtpErr("a command inside a message")
			}
			return [][]byte{body}, true, nil
		}
		if frames = append(frames, body); len(frames) > replayMaxFrames {
			return nil, false, zmtpErr("a message of more than %d frames", replayMaxFrames)
		}
		if flags&flagMore == 0 {
			return frames, false, nil
		}
	}
}

// writeMsg sends the frames "", seq, payload within timeout.
func writeMsg(c net.Conn, seq, payload []byte, timeout time.Duration) error {
	var hdr [2 + 2 + 9]byte
	h := hdr[:0]
	h = append(h, flagMore, 0)              // the empty delimiter
	h = append(h, flagMore, byte(len(seq))) // seq: 8 bytes
	if len(payload) > 255 {
		h = binary.BigEndian.AppendUint64(append(h, flagLong), uint64(len(payload)))
	} else {
		h = append(h, 0, byte(len(payload)))
	}
	bufs := net.Buffers{h[:4], seq, h[4:], payload}
	c.SetWriteDeadline(time.Now().Add(timeout))
	_, err := bufs.WriteTo(c)
	return err
}

// pong answers a PING command (ZMTP 3.1 heartbeats) with its context;
// other commands are ignored.
func pong(c net.Conn, body []byte, timeout time.Duration) error {
	name, rest, ok := parseCommand(body)
	if !ok || name != "PING" || len(rest) < 2 {
		return nil
	}
	ctx := rest[2:] // after the 2-byte TTL
	c.SetWriteDeadline(time.Now().Add(timeout))
	_, err := c.Write(appendCommand(nil, "PONG", ctx))
	return err
}

func appendCommand(dst []byte, name string, data []byte) []byte {
	n := 1 + len(name) + len(data)
	if n > 255 {
		dst = binary.BigEndian.AppendUint64(append(dst, flagCommand|flagLong), uint64(n))
	} else {
		dst = append(dst, flagCommand, byte(n))
	}
	dst = append(append(dst, byte(len(name))), name...)
	return append(dst, data...)
}

func appendProp(dst []byte, name, value string) []byte {
	dst = append(append(dst, byte(len(name))), name...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(value)))
	return append(dst, value...)
}

func parseCommand(body []byte) (name string, rest []byte, ok bool) {
	if len(body) < 1 || len(body) < 1+int(body[0]) {
		return "", nil, false
	}
	return string(body[1 : 1+body[0]]), body[1+body[0]:], true
}

// parseProps reads ZMTP metadata; names are case-insensitive (lowered).
func parseProps(p []byte) (map[string]string, bool) {
	md := map[string]string{}
	for len(p) > 0 {
		n := int(p[0])
		if len(p) < 1+n+4 {
			return nil, false
		}
		name := strings.ToLower(string(p[1 : 1+n]))
		vl := binary.BigEndian.Uint32(p[1+n:])
		p = p[1+n+4:]
		if uint64(vl) > uint64(len(p)) {
			return nil, false
		}
		md[name] = string(p[:vl])
		p = p[vl:]
	}
	return md, true
}
