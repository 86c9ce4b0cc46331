package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// TestEventsZMQReplay runs the daemon with --events-zmq and
// --events-zmq-replay and a router written to vLLM's protocol in Python
// (testdata/replay_sub.py: pyzmq's SUB and DEALER, msgpack): it joins
// after the daemon published its first batches (the reset, then stores),
// sees its first message past seq 0, asks the replay socket from 0 and
// applies what it missed; later it loses its connection while blocks are
// stored and invalidated, reconnects, sees the gap and replays it. Its view
// must then equal a fresh WatchEvents snapshot. Without the replay socket
// the router's view lacks what it missed; without a reply it fails on its
// 30 s wait. Hostile peers on the replay socket (a huge frame header,
// garbage, a malformed request) are disconnected or ignored meanwhile.
func TestEventsZMQReplay(t *testing.T) {
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	endpoint, replay := "tcp://"+freePort(t), "tcp://"+freePort(t)
	metrics := freePort(t)
	const topic = "kv@pod@model"
	_, c, _ := startDaemon(t, bin, "--socket", sock, "--metrics-addr", metrics, "--cpu-bytes", "16MiB", "--cpu-chunk-bytes", "4MiB",
		"--events-zmq", endpoint, "--events-zmq-topic", topic, "--events-zmq-replay", replay)

	m := testenv.Model{Layers: 2, SegBytes: 4 << 10, Blocks: 64}
	region := testenv.NewRegion(t, m.RegionBytes())
	ctx := context.Background()
	reg, err := c.Register(ctx, []byte("replay"), m.Layout(), m.Regions(region), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	// Hashes whose last 8 bytes (what an int hash keeps) differ.
	hash := func(seed uint64, i int) []byte {
		h := m.Hash(seed, i)
		binary.BigEndian.PutUint64(h[len(h)-8:], seed<<32|uint64(i))
		return h
	}
	nextID := uint64(1)
	store := func(hs ...[]byte) {
		t.Helper()
		for i, h := range hs {
			m.Fill(region, i, h)
		}
		res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(nextID, hs, seqIDs(len(hs)))}, true)
		if err != nil {
			t.Fatal(err)
		}
		nextID++
		if !res[0].Ok {
			t.Fatalf("store: %v", res[0].Failures)
		}
	}
	batch := func(seed uint64, n int) [][]byte {
		hs := make([][]byte, n)
		for i := range hs {
			hs[i] = hash(seed, i)
		}
		return hs
	}
	invalidate := func(hs ...[]byte) {
		t.Helper()
		if _, err := c.API.Invalidate(ctx, &pb.InvalidateRequest{NamespaceIds: []uint32{reg.NamespaceId}, Keys: testenv.Keys(hs...)}); err != nil {
			t.Fatal(err)
		}
	}
	// Before the router comes: only a replay from 0 tells it of these.
	for s := uint64(1); s <= 4; s++ {
		store(batch(s, 16)...)
	}
	invalidate(batch(1, 16)[:5]...)

	hostileReplayPeers(t, strings.TrimPrefix(replay, "tcp://"))

	r := startReplayRouter(t, endpoint, replay, topic)
	// A ZeroMQ subscription takes effect some time after the connect:
	// store blocks until the router sees one (and the gap before it).
	probe := 0
	untilReplayed := func(what string) {
		t.Helper()
		for i := 0; ; i++ {
			if i == 300 {
				t.Fatalf("%s: the router never replayed", what)
			}
			store(hash(99, probe))
			probe++
			if e, ok := r.wait(100*time.Millisecond, "replayed"); ok {
				t.Logf("%s: replayed %s", what, e["replayed"])
				return
			}
		}
	}
	untilReplayed("joining late")

	store(batch(5, 16)...)
	invalidate(batch(2, 16)[3:9]...)
	r.send("drop")
	r.wait(30*time.Second, "dropped")
	// While the router is away: stores, invalidations, and a
	// whole-namespace reset (AllBlocksCleared, then a snapshot).
	store(batch(6, 32)...)
	invalidate(batch(5, 16)[:4]...)
	if _, err := c.API.Invalidate(ctx, &pb.InvalidateRequest{NamespaceIds: []uint32{reg.NamespaceId}}); err != nil {
		t.Fatal(err)
	}
	store(batch(7, 24)...)
	store(batch(8, 8)...)
	invalidate(batch(7, 24)[10:12]...)
	r.send("connect")
	r.wait(30*time.Second, "connected")
	untilReplayed("after a lost connection")

	// Once the router has the last block stored, it must hold what a
	// fresh snapshot says (nothing else changes: a CPU tier with room).
	for i := 0; ; i++ {
		if i == 100 {
			t.Fatal("the router's view never equalled a fresh snapshot")
		}
		end := hash(1000, i)
		store(end)
		want := snapshotView(t, c)
		got := r.viewWith(t, fmt.Sprintf("%d %s", reg.NamespaceId, hex.EncodeToString(end[len(end)-8:])))
		if strings.Join(got.View, "\n") == strings.Join(want, "\n") {
			if got.Gaps < 2 || got.Replays < 2 {
				t.Fatalf("the router saw %d gaps and made %d replays, want 2 each", got.Gaps, got.Replays)
			}
			if len(want) < 25 {
				t.Fatalf("only %d blocks in the snapshot", len(want))
			}
			break
		}
		t.Logf("round %d: the router holds %d blocks, a snapshot %d", i, len(got.View), len(want))
	}
	text := scrape(t, metrics)
	if n := metricLabelled(t, text, `kvoffload_events_replay_requests_total{result="answered"}`); n < 2 {
		t.Fatalf("%v replay requests answered, want 2 or more", n)
	}
	if n := metricLabelled(t, text, `kvoffload_events_replay_requests_total{result="malformed"}`); n != 1 {
		t.Fatalf("%v malformed replay requests, want 1", n)
	}
	if n := metricLabelled(t, text, `kvoffload_events_replay_closed_connections_total{reason="dropped"}`); n < 2 {
		t.Fatalf("%v replay connections dropped, want the 2 hostile ones", n)
	}
}

// metricLabelled reads one sample, its labels included in name.
func metricLabelled(t *testing.T, text, name string) float64 {
	t.Helper()
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			var f float64
			if _, err := fmt.Sscan(v, &f); err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("no %s in the metrics", name)
	return 0
}

// hostileReplayPeers: a peer announcing a 2^62-byte frame and one that is
// not ZMTP are disconnected; a malformed request is ignored and the same
// connection is then answered. The daemon goes on (the test's later
// replays).
func hostileReplayPeers(t *testing.T, addr string) {
	t.Helper()
	greet := make([]byte, 64)
	greet[0], greet[9], greet[10], greet[11] = 0xff, 0x7f, 3, 1
	copy(greet[12:], "NULL")
	body := append([]byte{5}, "READY"...)
	body = append(append(body, 11), "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, 6)
	body = append(body, "DEALER"...)
	ready := append([]byte{4, byte(len(body))}, body...)
	dial := func() (net.Conn, *bufio.Reader) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		conn.SetDeadline(time.Now().Add(30 * time.Second))
		return conn, bufio.NewReader(conn)
	}
	handshake := func(conn net.Conn, r *bufio.Reader) {
		conn.Write(greet)
		conn.Write(ready)
		var g [64]byte
		if _, err := io.ReadFull(r, g[:]); err != nil {
			t.Fatal(err)
		}
		if fl, _ := r.ReadByte(); fl != 4 { // the daemon's READY
			t.Fatalf("want a READY command, got flags %#x", fl)
		}
		n, _ := r.ReadByte()
		r.Discard(int(n))
	}
	closed := func(what string, r *bufio.Reader) {
		if _, err := io.Copy(io.Discard, r); err != nil {
			t.Fatalf("%s: the daemon kept the connection: %v", what, err)
		}
	}
	conn, r := dial()
	handshake(conn, r)
	conn.Write(binary.BigEndian.AppendUint64([]byte{2 | 1}, 1<<62))
	closed("a 2^62-byte frame", r)

	conn, r = dial()
	conn.Write([]byte(strings.Repeat("GET / HTTP/1.1\r\n", 4)))
	closed("HTTP", r)

	conn, r = dial()
	handshake(conn, r)
	conn.Write([]byte{1, 0, 0, 3, 1, 2, 3}) // ["", 3 bytes]: a start_seq vLLM reads as 0x010203
	conn.Write([]byte{0, 2, 0, 0})          // [2 bytes]: no delimiter, malformed
	conn.Write(append([]byte{1, 0, 0, 8}, make([]byte, 8)...))
	// The first is answered (END_SEQ alone: nothing that far), the
	// second ignored, the third answered from the oldest batch.
	frames := func() [][]byte {
		var fs [][]byte
		for {
			fl, err := r.ReadByte()
			if err != nil {
				t.Fatal(err)
			}
			var size uint64
			if fl&2 != 0 {
				var b [8]byte
				io.ReadFull(r, b[:])
				size = binary.BigEndian.Uint64(b[:])
			} else {
				b, _ := r.ReadByte()
				size = uint64(b)
			}
			f := make([]byte, size)
			if _, err := io.ReadFull(r, f); err != nil {
				t.Fatal(err)
			}
			if fs = append(fs, f); fl&1 == 0 {
				return fs
			}
		}
	}
	end := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	if fs := frames(); len(fs) != 3 || string(fs[1]) != string(end) {
		t.Fatalf("a replay from past the end: %q, want END_SEQ", fs)
	}
	if fs := frames(); len(fs) != 3 || binary.BigEndian.Uint64(fs[1]) != 0 {
		t.Fatalf("a replay from 0: first reply %q, want seq 0", fs)
	}
}

// replayRouter drives testdata/replay_sub.py.
type replayRouter struct {
	t     *testing.T
	stdin io.Writer
	lines chan map[string]json.RawMessage
	errs  *bufferWriter
}

func startReplayRouter(t *testing.T, endpoint, replay, topic string) *replayRouter {
	t.Helper()
	py := exec.Command("/usr/bin/python3", "testdata/replay_sub.py", endpoint, replay, topic)
	stdin, err := py.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := py.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	r := &replayRouter{t: t, stdin: stdin, lines: make(chan map[string]json.RawMessage, 1<<10), errs: &bufferWriter{}}
	py.Stderr = r.errs
	if err := py.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(r.lines)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 64<<20)
		for sc.Scan() {
			var e map[string]json.RawMessage
			if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
				e = map[string]json.RawMessage{"error": json.RawMessage(fmt.Sprintf("%q", sc.Text()))}
			}
			r.lines <- e
		}
	}()
	t.Cleanup(func() {
		stdin.Close()
		py.Wait()
	})
	r.wait(30*time.Second, "subscribed")
	return r
}

func (r *replayRouter) send(cmd string) {
	if _, err := io.WriteString(r.stdin, cmd+"\n"); err != nil {
		r.t.Fatal(err)
	}
}

// wait reads lines until one has key (false after d without one); a gap
// line is logged, an error fails the test.
func (r *replayRouter) wait(d time.Duration, key string) (map[string]json.RawMessage, bool) {
	r.t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case e, ok := <-r.lines:
			if !ok {
				r.t.Fatalf("the router exited: %s", r.errs.String())
			}
			if msg, bad := e["error"]; bad {
				r.t.Fatalf("the router: %s", msg)
			}
			if g, ok := e["gap"]; ok {
				r.t.Logf("the router saw a gap: %s", g)
			}
			if _, ok := e[key]; ok {
				return e, true
			}
		case <-timer.C:
			if key == "replayed" {
				return nil, false
			}
			r.t.Fatalf("no %q from the router in %v", key, d)
		}
	}
}

type routerView struct {
	View    []string
	Gaps    int
	Replays int
}

// viewWith asks for the router's view until it holds block (bounded).
func (r *replayRouter) viewWith(t *testing.T, block string) routerView {
	t.Helper()
	for i := 0; i < 300; i++ {
		r.send("view")
		e, _ := r.wait(30*time.Second, "view")
		var rows [][]any
		if err := json.Unmarshal(e["view"], &rows); err != nil {
			t.Fatal(err)
		}
		v := routerView{}
		json.Unmarshal(e["gaps"], &v.Gaps)
		json.Unmarshal(e["replays"], &v.Replays)
		found := false
		for _, row := range rows {
			s := fmt.Sprintf("%v %v %v/%v", row...)
			v.View = append(v.View, s)
			found = found || strings.HasPrefix(s, block+" ")
		}
		sort.Strings(v.View)
		if found {
			return v
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("the router never received block %s", block)
	return routerView{}
}

// snapshotView is what a fresh WatchEvents snapshot says: one line per
// block and tier, as the router's view prints them.
func snapshotView(t *testing.T, c *client.Client) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	w, err := c.API.WatchEvents(ctx, &pb.WatchEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var v []string
	for {
		resp, err := w.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range resp.Events {
			switch e.Kind {
			case pb.EventKind_EVENT_KIND_BLOCK_STORED:
				where := "CPU/LOCAL"
				if e.Tier == pb.Tier_TIER_DISK {
					where = "STORAGE/LOCAL"
				}
				v = append(v, fmt.Sprintf("%d %s %s", e.NamespaceId, hex.EncodeToString(e.Hash[len(e.Hash)-8:]), where))
			case pb.EventKind_EVENT_KIND_CAUGHT_UP:
				sort.Strings(v)
				return v
			}
		}
	}
}
