package events

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvoffloadd/kvoffloadd/index"
)

func seqBytes(q uint64) []byte { return binary.BigEndian.AppendUint64(nil, q) }

func payloadOf(q uint64, n int) []byte {
	p := bytes.Repeat([]byte{byte(q)}, n)
	copy(p, fmt.Sprintf("batch %d", q))
	return p
}

func TestReplayBufBounds(t *testing.T) {
	b := newReplayBuf(4, 1<<20)
	for q := uint64(0); q < 10; q++ {
		b.add(q, payloadOf(q, 16))
	}
	if first, end := b.span(); first != 6 || end != 10 {
		t.Fatalf("span %d..%d, want the last 4: 6..10", first, end)
	}
	if p, ok := b.get(7); !ok || !bytes.Equal(p, payloadOf(7, 16)) {
		t.Fatalf("get(7) = %q, %v", p, ok)
	}
	if _, ok := b.get(5); ok {
		t.Fatal("get(5) found a dropped batch")
	}
	// The byte bound: three batches of 400 (464 counted) fit in 1400.
	b = newReplayBuf(100, 1400)
	for q := uint64(0); q < 5; q++ {
		b.add(q, payloadOf(q, 400))
	}
	if n, by := b.usage(); n != 3 || by != 3*(400+replayOverhead) {
		t.Fatalf("usage %d batches, %d bytes; want 3, %d", n, by, 3*(400+replayOverhead))
	}
	// A batch larger than the bound is not kept, nor is anything before it.
	b.add(5, payloadOf(5, 2000))
	if n, _ := b.usage(); n != 0 {
		t.Fatalf("%d batches held after one past the bound", n)
	}
	b.add(6, payloadOf(6, 10))
	if first, end := b.span(); first != 6 || end != 7 {
		t.Fatalf("span %d..%d after restarting, want 6..7", first, end)
	}
	// A seq that does not follow starts over: never a hole.
	b.add(9, payloadOf(9, 10))
	if first, end := b.span(); first != 9 || end != 10 {
		t.Fatalf("span %d..%d after a jump, want 9..10", first, end)
	}
}

// startReplay serves a buffer holding batches from..to-1 of size bytes each.
func startReplay(t *testing.T, maxN int, from, to uint64, size int) (*replayServer, string) {
	t.Helper()
	b := newReplayBuf(maxN, 1<<30)
	for q := from; q < to; q++ {
		b.add(q, payloadOf(q, size))
	}
	lis, err := listenReplay("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := newReplayServer(lis, b, slog.New(slog.NewTextHandler(io.Discard, nil)))
	t.Cleanup(func() { s.close() })
	return s, lis.Addr().String()
}

// dealerReplay asks for a replay from start as a vLLM subscriber does
// (a DEALER sending ["", start_seq]) and returns the seqs answered, up to
// END_SEQ, checking each payload.
func dealerReplay(t *testing.T, d zmq4.Socket, start uint64, size int) []uint64 {
	t.Helper()
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, seqBytes(start))); err != nil {
		t.Fatal(err)
	}
	var got []uint64
	for {
		m, err := d.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Frames) != 3 || len(m.Frames[0]) != 0 || len(m.Frames[1]) != 8 {
			t.Fatalf("reply frames %d, want [\"\", seq, payload]", len(m.Frames))
		}
		if bytes.Equal(m.Frames[1], endSeq) {
			if len(m.Frames[2]) != 0 {
				t.Fatal("END_SEQ with a payload")
			}
			return got
		}
		q := binary.BigEndian.Uint64(m.Frames[1])
		if !bytes.Equal(m.Frames[2], payloadOf(q, size)) {
			t.Fatalf("batch %d: wrong payload", q)
		}
		got = append(got, q)
	}
}

func seqRange(from, to uint64) []uint64 {
	var s []uint64
	for q := from; q < to; q++ {
		s = append(s, q)
	}
	return s
}

func equalSeqs(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestReplayDealer: a zmq4 DEALER (another ZMTP implementation) gets what
// vLLM's ROUTER would answer: the held batches from start_seq, then
// END_SEQ; a start past the buffer gets END_SEQ alone, one before it the
// batches from the oldest held (the requester sees the gap).
func TestReplayDealer(t *testing.T) {
	s, addr := startReplay(t, 50, 0, 100, 300)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		start    uint64
		from, to uint64
	}{{60, 60, 100}, {0, 50, 100}, {99, 99, 100}, {100, 0, 0}, {1 << 63, 0, 0}, {^uint64(0), 0, 0}} {
		if got := dealerReplay(t, d, tc.start, 300); !equalSeqs(got, seqRange(tc.from, tc.to)) {
			t.Fatalf("replay from %d: seqs %v, want %d..%d", tc.start, got, tc.from, tc.to)
		}
	}
	if st := s.stats(); st.Requests != 6 || st.Sent != 40+50+1 || st.Malformed != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// rawPeer is a hand-driven ZMTP peer.
type rawPeer struct {
	c net.Conn
	r *bufio.Reader
}

func dialRaw(t *testing.T, addr string) *rawPeer {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawPeer{c: c, r: bufio.NewReader(c)}
}

// handshake greets as a DEALER.
func (p *rawPeer) handshake(t *testing.T) {
	t.Helper()
	p.c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := p.c.Write(greeting()); err != nil {
		t.Fatal(err)
	}
	var g [64]byte
	if _, err := io.ReadFull(p.r, g[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := p.c.Write(appendCommand(nil, "READY", appendProp(nil, "Socket-Type", "DEALER"))); err != nil {
		t.Fatal(err)
	}
	frames, cmd, err := readMsg(p.r, replayMaxFrame)
	if err != nil || !cmd {
		t.Fatalf("READY: %v %v", cmd, err)
	}
	if name, _, _ := parseCommand(frames[0]); name != "READY" {
		t.Fatalf("command %q, want READY", name)
	}
}

// send writes frames as one message.
func (p *rawPeer) send(t *testing.T, frames ...[]byte) {
	t.Helper()
	var b []byte
	for i, f := range frames {
		var fl byte
		if i < len(frames)-1 {
			fl = flagMore
		}
		b = append(append(b, fl, byte(len(f))), f...)
	}
	if _, err := p.c.Write(b); err != nil {
		t.Fatal(err)
	}
}

// replay asks from start and reads the seqs up to END_SEQ.
func (p *rawPeer) replay(t *testing.T, start uint64) []uint64 {
	t.Helper()
	p.send(t, nil, seqBytes(start))
	var got []uint64
	for {
		frames, _, err := readMsg(p.r, 1<<32)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(frames[1], endSeq) {
			return got
		}
		got = append(got, binary.BigEndian.Uint64(frames[1]))
	}
}

// closedByServer reports whether the server closed p (reads EOF).
func (p *rawPeer) closedByServer(t *testing.T) bool {
	t.Helper()
	p.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	_, err := io.Copy(io.Discard, p.r)
	return err == nil // EOF
}

// waitStats waits until cond holds of the server's counters.
func waitStats(t *testing.T, s *replayServer, what string, cond func(ReplayStats) bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond(s.stats()) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: stats %+v", what, s.stats())
		}
		time.Sleep(time.Millisecond)
	}
}

// TestReplayHostile: malformed requests are ignored and counted and the
// connection keeps working; bad greetings, huge frame headers and frames
// past the bounds close the connection, never the process; requests for
// seqs past the buffer get END_SEQ alone.
func TestReplayHostile(t *testing.T) {
	s, addr := startReplay(t, 100, 0, 20, 10)

	p := dialRaw(t, addr)
	p.handshake(t)
	p.send(t, seqBytes(3))                                         // no delimiter (2 frames on a ROUTER)
	p.send(t, []byte("x"), seqBytes(3))                            // a delimiter that is not empty
	p.send(t, nil, append(seqBytes(3), 0))                         // 9 bytes of seq
	p.send(t, nil, nil)                                            // no seq
	p.send(t, nil, seqBytes(3), seqBytes(4))                       // one frame too many
	if got := p.replay(t, 15); !equalSeqs(got, seqRange(15, 20)) { // still served
		t.Fatalf("replay after malformed requests: %v", got)
	}
	if got := p.replay(t, ^uint64(0)-1); len(got) != 0 {
		t.Fatalf("replay from a huge seq: %v", got)
	}
	// A shorter start_seq reads as vLLM's int.from_bytes does.
	p.send(t, nil, []byte{18})
	for _, want := range []uint64{18, 19} {
		frames, _, err := readMsg(p.r, 1<<32)
		if err != nil || binary.BigEndian.Uint64(frames[1]) != want {
			t.Fatalf("1-byte start_seq: %v %v", frames, err)
		}
	}
	if frames, _, err := readMsg(p.r, 1<<32); err != nil || !bytes.Equal(frames[1], endSeq) {
		t.Fatalf("1-byte start_seq: want END_SEQ, got %v %v", frames, err)
	}
	if st := s.stats(); st.Malformed != 5 || st.Dropped != 0 {
		t.Fatalf("stats %+v, want 5 malformed and no connection dropped", st)
	}

	for _, tc := range []struct {
		name string
		send func(p *rawPeer)
	}{
		{"not ZMTP", func(p *rawPeer) { p.c.Write(bytes.Repeat([]byte("GET / HTTP/1.1\r\n"), 4)) }},
		{"ZMTP 2", func(p *rawPeer) { g := greeting(); g[10] = 2; p.c.Write(g) }},
		{"a PUB peer", func(p *rawPeer) {
			p.c.Write(greeting())
			p.c.Write(appendCommand(nil, "READY", appendProp(nil, "Socket-Type", "PUB")))
		}},
		{"a 2^62-byte frame", func(p *rawPeer) {
			p.handshake(t)
			p.c.Write(binary.BigEndian.AppendUint64([]byte{flagLong | flagMore}, 1<<62))
		}},
		{"a 2^64-1-byte command", func(p *rawPeer) {
			p.handshake(t)
			p.c.Write(binary.BigEndian.AppendUint64([]byte{flagLong | flagCommand}, ^uint64(0)))
		}},
		{"too many frames", func(p *rawPeer) {
			p.handshake(t)
			for range replayMaxFrames + 1 {
				p.c.Write([]byte{flagMore, 0})
			}
		}},
		{"bad flags", func(p *rawPeer) { p.handshake(t); p.c.Write([]byte{0x80, 0}) }},
	} {
		before := s.stats().Dropped
		q := dialRaw(t, addr)
		tc.send(q)
		if !q.closedByServer(t) {
			t.Fatalf("%s: the connection stayed open", tc.name)
		}
		waitStats(t, s, tc.name, func(st ReplayStats) bool { return st.Dropped == before+1 })
	}
	// And the first connection is still served.
	if got := p.replay(t, 10); !equalSeqs(got, seqRange(10, 20)) {
		t.Fatalf("replay after hostile peers: %v", got)
	}
}

// TestReplayConnBound: connections past ReplayMaxConns are closed at
// accept; those open are served; one closed frees its place.
func TestReplayConnBound(t *testing.T) {
	s, addr := startReplay(t, 100, 0, 5, 10)
	peers := make([]*rawPeer, ReplayMaxConns)
	for i := range peers {
		peers[i] = dialRaw(t, addr)
		peers[i].handshake(t)
	}
	extra := dialRaw(t, addr)
	if !extra.closedByServer(t) {
		t.Fatal("a connection past the bound stayed open")
	}
	waitStats(t, s, "refused", func(st ReplayStats) bool { return st.Refused == 1 && st.Conns == ReplayMaxConns })
	var wg sync.WaitGroup
	errs := make(chan string, len(peers))
	for _, p := range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.send(t, nil, seqBytes(0))
			n := 0
			for {
				frames, _, err := readMsg(p.r, 1<<32)
				if err != nil {
					errs <- err.Error()
					return
				}
				if bytes.Equal(frames[1], endSeq) {
					break
				}
				n++
			}
			if n != 5 {
				errs <- fmt.Sprintf("%d batches, want 5", n)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	peers[0].c.Close()
	waitStats(t, s, "closed", func(st ReplayStats) bool { return st.Conns == ReplayMaxConns-1 })
	late := dialRaw(t, addr)
	late.handshake(t)
	if got := late.replay(t, 3); !equalSeqs(got, seqRange(3, 5)) {
		t.Fatalf("replay on a freed place: %v", got)
	}
}

// TestReplayStalledPeer: a peer that asks for a large replay and stops
// reading does not stall another one, and is disconnected after the
// write timeout.
func TestReplayStalledPeer(t *testing.T) {
	s, addr := startReplay(t, 24, 0, 24, 1<<20) // 24 MiB: more than the socket buffers
	s.writeTimeout = 300 * time.Millisecond
	stalled := dialRaw(t, addr)
	stalled.handshake(t)
	stalled.send(t, nil, seqBytes(0))
	// The stalled one's goroutine is blocked in a write once it has sent
	// some batches and no more go.
	waitStats(t, s, "the stalled reply started", func(st ReplayStats) bool { return st.Sent > 0 })
	other := dialRaw(t, addr)
	other.handshake(t)
	if got := other.replay(t, 22); !equalSeqs(got, seqRange(22, 24)) {
		t.Fatalf("replay beside a stalled peer: %v", got)
	}
	waitStats(t, s, "the stalled peer dropped", func(st ReplayStats) bool { return st.Dropped == 1 && st.Conns == 1 })
}

// TestReplayIPC: an ipc:// endpoint (a unix socket, replacing the stale
// one a killed daemon left) answers a zmq4 DEALER.
func TestReplayIPC(t *testing.T) {
	path := t.TempDir() + "/replay.ipc"
	stale, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()
	lis, err := listenReplay("ipc://" + path)
	if err != nil {
		t.Fatal(err)
	}
	b := newReplayBuf(10, 1<<20)
	for q := uint64(0); q < 3; q++ {
		b.add(q, payloadOf(q, 10))
	}
	s := newReplayServer(lis, b, slog.New(slog.NewTextHandler(io.Discard, nil)))
	defer s.close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial("ipc://" + path); err != nil {
		t.Fatal(err)
	}
	if got := dealerReplay(t, d, 1, 10); !equalSeqs(got, seqRange(1, 3)) {
		t.Fatalf("replay over ipc: %v", got)
	}
}

// TestPublisherHostilePeers: on the --events-zmq PUB socket, a peer
// announcing a 2^62-byte frame is cut off (zmq4 alone would allocate it
// and the process would end), and one that never greets holds up later
// subscribers only until the handshake deadline.
func TestPublisherHostilePeers(t *testing.T) {
	old := pubHandshake
	pubHandshake = 300 * time.Millisecond
	defer func() { pubHandshake = old }()
	ix := index.New()
	h := New(ix, Config{})
	h.SetHashLen(1, 16)
	p, err := NewPublisher(h, ZMQConfig{Endpoint: "tcp://127.0.0.1:0", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	addr := strings.TrimPrefix(p.Addr(), "tcp://")

	huge := dialRaw(t, addr)
	huge.c.Write(greeting())
	huge.c.Write(appendCommand(nil, "READY", appendProp(nil, "Socket-Type", "SUB")))
	huge.c.Write(binary.BigEndian.AppendUint64([]byte{flagLong | flagCommand}, 1<<62))
	if !huge.closedByServer(t) {
		t.Fatal("a 2^62-byte frame: the connection stayed open")
	}
	silent := dialRaw(t, addr) // never greets
	_ = silent

	subscribeUntilMessage(t, ix, p.Addr(), "no message for a subscriber beside a silent peer")
}

// subscribeUntilMessage subscribes to the publisher at ep and changes
// blocks in ix until a message comes (a subscription takes effect some time
// after the connect), failing with msg after 3,000 changes.
func subscribeUntilMessage(t *testing.T, ix *index.Index, ep, msg string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.Dial(ep); err != nil {
		t.Fatal(err)
	}
	sub.SetOption(zmq4.OptionSubscribe, "")
	got := make(chan error, 1)
	go func() { _, err := sub.Recv(); got <- err }()
	for i := uint64(0); ; i++ {
		if i == 3000 {
			t.Fatal(msg)
		}
		set(ix, key(1, i), index.InCPU)
		select {
		case err := <-got:
			if err != nil {
				t.Fatal(err)
			}
			return
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// TestPublisherIPC: the guarded transport serves ipc:// too.
func TestPublisherIPC(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{})
	h.SetHashLen(1, 16)
	ep := "ipc://" + t.TempDir() + "/pub.ipc"
	p, err := NewPublisher(h, ZMQConfig{Endpoint: ep, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	subscribeUntilMessage(t, ix, ep, "no message over ipc")
}

// TestAppendBatchShortHash: a block whose namespace's hash length the hub
// was never told (HashLen 0) is encoded, not a panic of the publisher.
func TestAppendBatchShortHash(t *testing.T) {
	for _, hl := range []uint8{0, 4, 8, 16} {
		e := Event{Kind: Stored, Tier: index.InCPU, HashLen: hl, Key: key(1, 7)}
		if _, n := (VLLM{BlockSize: 16}).AppendBatch(nil, 1, []Event{e}); n != 1 {
			t.Fatalf("hash length %d: %d events", hl, n)
		}
	}
}
