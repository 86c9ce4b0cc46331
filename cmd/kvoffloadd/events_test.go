package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// zmqEvent is one event as the Python decoder printed it.
type zmqEvent struct {
	Subscribed bool     `json:"subscribed"`
	Error      string   `json:"error"`
	Seq        uint64   `json:"seq"`
	Type       string   `json:"type"`
	Hashes     []string `json:"hashes"`
	Medium     string   `json:"medium"`
	Locality   string   `json:"locality"`
	Group      int      `json:"group"`
	Namespace  int64    `json:"namespace"`
}

// TestEventsZMQ runs the daemon with --events-zmq and a subscriber in
// Python (python3-zmq, python3-msgpack): kv_events_sub.py checks the
// layout of every message field by field; vllm_schema_sub.py decodes it as
// msgspec decodes into vLLM's structs and keys blocks as a router keyed on
// vLLM's constants (medium CPU or STORAGE, locality LOCAL), with the
// daemon's namespace_id. Two engines' namespaces store, some of them the
// same block hashes; the events replayed per namespace equal a Lookup of
// every key of each, through stores, demotions, evictions from both tiers,
// an invalidation and a reset.
func TestEventsZMQ(t *testing.T) {
	for _, tc := range []struct{ decoder, format, hashes string }{
		{"kv_events_sub.py", "map", "int"}, {"kv_events_sub.py", "array", "bytes"},
		{"vllm_schema_sub.py", "map", "int"}, {"vllm_schema_sub.py", "array", "int"},
	} {
		t.Run(tc.decoder+"-"+tc.format+"-"+tc.hashes, func(t *testing.T) { testEventsZMQ(t, tc.decoder, tc.format, tc.hashes) })
	}
}

func testEventsZMQ(t *testing.T, decoder, format, hashes string) {
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	endpoint := "tcp://" + freePort(t)
	const topic = "kv@pod@model"
	_, c, _ := startDaemon(t, bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "8MiB", "--cpu-chunk-bytes", "4MiB",
		"--disk-dir", t.TempDir(), "--disk-bytes", "16MiB", "--disk-chunk-bytes", "4MiB", "--disk-direct", "fallback",
		"--events-zmq", endpoint, "--events-zmq-topic", topic, "--events-zmq-format", format, "--events-zmq-hashes", hashes,
		"--events-zmq-block-size", "32")

	next := startDecoder(t, decoder, endpoint, topic, format, hashes, "32")

	m := testenv.Model{Layers: 4, SegBytes: 64 << 10, Blocks: 64}
	ctx := context.Background()
	// Two engines (two fingerprints): the events must say whose each block is.
	var regs [2]*pb.RegisterResponse
	var regions [2]*testenv.Region
	for i := range regs {
		regions[i] = testenv.NewRegion(t, m.RegionBytes())
		reg, err := c.Register(ctx, []byte(fmt.Sprintf("zmq-%d", i)), m.Layout(), m.Regions(regions[i]), t.Name())
		if err != nil {
			t.Fatal(err)
		}
		regs[i] = reg
	}
	if regs[0].NamespaceId == regs[1].NamespaceId {
		t.Fatal("two fingerprints, one namespace")
	}
	reg := regs[0]
	// Block hashes whose last 8 bytes (what an int hash keeps) differ.
	hash := func(seed uint64, i int) []byte {
		h := m.Hash(seed, i)
		binary.BigEndian.PutUint64(h[len(h)-8:], seed<<32|uint64(i))
		return h
	}
	var all [2][][]byte
	inAll := [2]map[string]bool{{}, {}}
	nextID := uint64(1)
	// storeIn stores hs in engine e's namespace and reports whether every
	// block was taken (the admission policy may keep hotter blocks
	// instead), and whether a block found no room.
	storeIn := func(e int, hs [][]byte) (ok, noSpace bool) {
		t.Helper()
		for i, h := range hs {
			m.Fill(regions[e], i, h)
		}
		res, err := c.Store(ctx, regs[e].RegistrationId, []*pb.Job{testenv.Job(nextID, hs, seqIDs(len(hs)))}, true)
		if err != nil {
			t.Fatal(err)
		}
		nextID++
		for _, h := range hs {
			if !inAll[e][string(h)] {
				inAll[e][string(h)] = true
				all[e] = append(all[e], h)
			}
		}
		for _, f := range res[0].Failures {
			noSpace = noSpace || f.Status == pb.BlockStatus_BLOCK_STATUS_NO_SPACE
		}
		return res[0].Ok, noSpace
	}
	store := func(hs [][]byte) (ok, noSpace bool) { return storeIn(0, hs) }
	name := func(h []byte) string {
		if hashes == "int" {
			return hex.EncodeToString(h[len(h)-8:])
		}
		return hex.EncodeToString(h)
	}
	// held is the view per namespace id.
	held := map[uint32]map[string]pb.Tier{}
	apply := func(e zmqEvent) {
		t.Helper()
		if e.Type == "AllBlocksCleared" {
			held = map[uint32]map[string]pb.Tier{}
			return
		}
		var tier pb.Tier
		switch {
		case e.Medium == "CPU" && e.Locality == "LOCAL":
			tier = pb.Tier_TIER_CPU
		case e.Medium == "STORAGE" && e.Locality == "LOCAL":
			tier = pb.Tier_TIER_DISK
		default:
			t.Fatalf("%s of medium %q locality %q: want CPU or STORAGE, LOCAL", e.Type, e.Medium, e.Locality)
		}
		if e.Namespace != int64(regs[0].NamespaceId) && e.Namespace != int64(regs[1].NamespaceId) {
			t.Fatalf("%s %v: namespace %d, want %d or %d", e.Type, e.Hashes, e.Namespace, regs[0].NamespaceId, regs[1].NamespaceId)
		}
		ns := uint32(e.Namespace)
		if held[ns] == nil {
			held[ns] = map[string]pb.Tier{}
		}
		switch e.Type {
		case "BlockStored":
			for _, h := range e.Hashes {
				held[ns][h] |= tier
			}
		case "BlockRemoved":
			for _, h := range e.Hashes {
				if held[ns][h] &^= tier; held[ns][h] == 0 {
					delete(held[ns], h)
				}
			}
		}
	}
	// until reads events until one says hash h is stored.
	until := func(h []byte) {
		t.Helper()
		for {
			e, ok := next(30 * time.Second)
			if !ok {
				t.Fatalf("no event for %x", h[:8])
			}
			apply(e)
			if e.Type == "BlockStored" {
				for _, x := range e.Hashes {
					if x == name(h) {
						return
					}
				}
			}
		}
	}

	// A ZeroMQ subscription takes effect some time after the connect:
	// store probe blocks until the decoder sees one.
	for i := 0; ; i++ {
		if i == 300 {
			t.Fatal("the decoder never received an event")
		}
		store([][]byte{hash(99, i)})
		if e, ok := next(100 * time.Millisecond); ok {
			apply(e)
			break
		}
	}
	// From here the decoder's stream has no gap (it checks the seqs),
	// but it missed the start: drain the probes, then reset the view
	// with a whole-namespace invalidation.
	if _, err := c.API.Invalidate(ctx, &pb.InvalidateRequest{NamespaceIds: []uint32{reg.NamespaceId}}); err != nil {
		t.Fatal(err)
	}
	all[0], inAll[0] = nil, map[string]bool{}
	cleared := false
	for !cleared {
		e, ok := next(30 * time.Second)
		if !ok {
			t.Fatal("no AllBlocksCleared after invalidating the namespace")
		}
		apply(e)
		cleared = e.Type == "AllBlocksCleared"
	}

	// Four times the CPU tier, more than both tiers hold; the second
	// engine stores every other prefix the first one stored, the same
	// hashes in its own namespace. A store that comes before the disk's
	// writes free CPU slots fails NO_SPACE for some blocks; how many (1 to
	// 70 of 128 here) depended on the machine's load, and with too many of
	// them the tiers held fewer than 40 blocks at the end (issue 26). Each
	// store is repeated until no block of it finds no room, so both tiers
	// fill in every run.
	for s := 0; s < 32; s++ {
		hs := make([][]byte, 4)
		for i := range hs {
			hs[i] = hash(uint64(s-s%2), i)
		}
		for deadline := time.Now().Add(60 * time.Second); ; {
			if _, noSpace := storeIn(s%2, hs); !noSpace {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("store %d still refused after 60 s", s)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	if _, err := c.API.Invalidate(ctx, &pb.InvalidateRequest{NamespaceIds: []uint32{reg.NamespaceId}, Keys: testenv.Keys(all[0][len(all[0])-8:]...)}); err != nil {
		t.Fatal(err)
	}
	mediums := map[string]bool{}
	for i := 0; ; i++ {
		// Every earlier event has come once a later block's has; the
		// disk tier may still be writing demoted blocks, so repeat until
		// the view equals what Lookup says.
		if i == 100 {
			t.Fatal("the events never caught up with Lookup")
		}
		end := hash(1000, i)
		if ok, _ := store([][]byte{end}); !ok {
			continue
		}
		until(end)
		if sameAsLookup(t, c, regs[0], all[0], held[regs[0].NamespaceId], name) &&
			sameAsLookup(t, c, regs[1], all[1], held[regs[1].NamespaceId], name) {
			break
		}
	}
	for _, v := range held {
		for _, tier := range v {
			mediums[tier.String()] = true
		}
	}
	if n0, n1 := len(held[regs[0].NamespaceId]), len(held[regs[1].NamespaceId]); !mediums[pb.Tier_TIER_DISK.String()] || n0 < 8 || n1 < 8 || n0+n1 < 30 {
		t.Fatalf("the events hold %d and %d blocks of the two namespaces in %v; want more, and blocks on disk", n0, n1, mediums)
	}
}

// sameAsLookup reports whether the replayed view equals a Lookup of every
// key.
func sameAsLookup(t *testing.T, c *client.Client, reg *pb.RegisterResponse, all [][]byte, held map[string]pb.Tier, name func([]byte) string) bool {
	t.Helper()
	n := 0
	for _, h := range all {
		lr, err := c.Lookup(context.Background(), []uint32{reg.NamespaceId}, testenv.Keys(h), 0)
		if err != nil {
			t.Fatal(err)
		}
		var want pb.Tier
		if lr.Ready == 1 {
			want = lr.Tiers[0]
			n++
		}
		if held[name(h)] != want {
			t.Logf("block %x: the events say %v, Lookup %v", h[:8], held[name(h)], want)
			return false
		}
	}
	return n == len(held)
}

func seqIDs(n int) []uint32 {
	b := make([]uint32, n)
	for i := range b {
		b[i] = uint32(i)
	}
	return b
}

// bufferWriter is an io.Writer safe to read while the process writes.
type bufferWriter struct {
	mu sync.Mutex
	b  []byte
}

func (w *bufferWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.b = append(w.b, p...)
	return len(p), nil
}

func (w *bufferWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return string(w.b)
}

// startDecoder runs the Python decoder testdata/decoder on the daemon's
// ZMQ stream at endpoint and waits until it has subscribed. next returns
// its next event, or false after wait; it fails the test if the decoder
// exits or reports an error.
func startDecoder(t *testing.T, decoder, endpoint, topic, format, hashes, blockSize string) (next func(wait time.Duration) (zmqEvent, bool)) {
	t.Helper()
	args := []string{"testdata/" + decoder, endpoint, topic, format}
	if decoder == "kv_events_sub.py" {
		args = append(args, hashes, blockSize)
	}
	py := exec.Command("/usr/bin/python3", args...)
	stdin, err := py.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := py.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bufferWriter
	py.Stderr = &stderr
	if err := py.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan zmqEvent, 1<<16)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var e zmqEvent
			if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
				e.Error = fmt.Sprintf("bad line %q: %v", sc.Text(), err)
			}
			lines <- e
		}
	}()
	t.Cleanup(func() {
		stdin.Close()
		py.Wait()
	})
	next = func(wait time.Duration) (zmqEvent, bool) {
		t.Helper()
		select {
		case e, ok := <-lines:
			if !ok {
				t.Fatalf("the decoder exited: %s", stderr.String())
			}
			if e.Error != "" {
				t.Fatalf("the decoder: %s", e.Error)
			}
			return e, true
		case <-time.After(wait):
			return zmqEvent{}, false
		}
	}
	if e, _ := next(30 * time.Second); !e.Subscribed {
		t.Fatal("the decoder did not start")
	}
	return next
}
