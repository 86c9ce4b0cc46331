package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// TestSnapshotStall measures what a WatchEvents snapshot costs the
// daemon's Lookups and memory (issue 34, item 3): the daemon holds N 4 KiB
// blocks in its CPU tier; Lookups of 16 keys run back to back, idle and
// then while a subscriber reads a snapshot of every block as fast as it
// can; the daemon's RSS is sampled meanwhile. A measurement, not a check
// (no timing is asserted): it runs only with KVOFFLOAD_SNAPSHOT_BLOCKS=N
// and logs its figures, e.g.
//
//	KVOFFLOAD_SNAPSHOT_BLOCKS=1000000 go test -count=1 -v -run TestSnapshotStall ./cmd/kvoffloadd/
func TestSnapshotStall(t *testing.T) {
	if sock := os.Getenv("KVOFFLOAD_SNAPSHOT_READER"); sock != "" {
		readSnapshot(t, sock)
		return
	}
	n, _ := strconv.Atoi(os.Getenv("KVOFFLOAD_SNAPSHOT_BLOCKS"))
	if n <= 0 {
		t.Skip("a measurement: set KVOFFLOAD_SNAPSHOT_BLOCKS=N to run it")
	}
	rounds, _ := strconv.Atoi(os.Getenv("KVOFFLOAD_SNAPSHOT_ROUNDS"))
	rounds = max(rounds, 1)
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	const chunk = 64 << 20
	cpu := (uint64(n)*4096*5/4 + chunk - 1) / chunk * chunk
	metrics := freePort(t)
	proc, c, _ := startDaemon(t, bin, "--socket", sock, "--metrics-addr", metrics, "--cpu-bytes", fmt.Sprint(cpu), "--cpu-chunk-bytes", fmt.Sprint(chunk))
	m := testenv.Model{Layers: 1, SegBytes: 4096, Blocks: 4096, HashBytes: 16}
	region := testenv.NewRegion(t, m.RegionBytes())
	ctx := context.Background()
	reg, err := c.Register(ctx, []byte("stall"), m.Layout(), m.Regions(region), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	hash := func(i int) []byte {
		h := make([]byte, 16)
		binary.LittleEndian.PutUint64(h, uint64(i)+1)
		binary.LittleEndian.PutUint64(h[8:], uint64(i)*0x9e3779b97f4a7c15)
		return h
	}
	start := time.Now()
	for base, id := 0, uint64(1); base < n; base, id = base+m.Blocks, id+1 {
		k := min(m.Blocks, n-base)
		hs := make([][]byte, k)
		for i := range hs {
			hs[i] = hash(base + i)
		}
		res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(id, hs, seqIDs(k))}, true)
		if err != nil || !res[0].Ok {
			t.Fatalf("store at %d: %v %v", base, err, res)
		}
	}
	t.Logf("stored %d blocks in %v", n, time.Since(start))
	st, err := c.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("stats: %v", st.String()[:min(300, len(st.String()))])

	// lookups runs Lookups of 16 random stored keys until stop, and
	// returns their latencies.
	lookups := func(stop <-chan struct{}) []time.Duration {
		var lat []time.Duration
		rng := rand.New(rand.NewPCG(1, 2))
		for {
			select {
			case <-stop:
				return lat
			default:
			}
			hs := make([][]byte, 16)
			for i := range hs {
				hs[i] = hash(rng.IntN(n))
			}
			t0 := time.Now()
			lr, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, testenv.Keys(hs...), 0)
			lat = append(lat, time.Since(t0))
			if err != nil || lr.Ready == 0 {
				t.Errorf("lookup: %v %v", err, lr)
				return lat
			}
		}
	}
	pct := func(lat []time.Duration) string {
		if len(lat) == 0 {
			return "none"
		}
		slices.Sort(lat)
		p := func(q float64) time.Duration { return lat[min(len(lat)-1, int(q*float64(len(lat))))] }
		return fmt.Sprintf("n=%d p50=%v p99=%v max=%v", len(lat), p(0.5).Round(time.Microsecond), p(0.99).Round(time.Microsecond), lat[len(lat)-1].Round(time.Microsecond))
	}
	rss := func() int64 {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", proc.Process.Pid))
		if err != nil {
			return 0
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
				return kb << 10
			}
		}
		return 0
	}

	for r := 0; r < rounds; r++ {
		stop := make(chan struct{})
		time.AfterFunc(3*time.Second, func() { close(stop) })
		idle := lookups(stop)
		before := rss()
		allocBefore := metric(t, scrape(t, metrics), "go_memstats_alloc_bytes_total")

		stop = make(chan struct{})
		var wg sync.WaitGroup
		var during []time.Duration
		wg.Add(1)
		go func() { defer wg.Done(); during = lookups(stop) }()
		peak := before
		done := make(chan struct{})
		go func() {
			tick := time.NewTicker(10 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-done:
					return
				case <-tick.C:
					peak = max(peak, rss())
				}
			}
		}()
		// The router: another process (this test binary again), on its
		// own connection, as a router is.
		t0 := time.Now()
		reader := exec.Command(os.Args[0], "-test.run", "^TestSnapshotStall$", "-test.v")
		reader.Env = append(os.Environ(), "KVOFFLOAD_SNAPSHOT_READER="+sock)
		outb, err := reader.CombinedOutput()
		if err != nil {
			t.Fatalf("the reader: %v\n%s", err, outb)
		}
		took := time.Since(t0)
		stored := 0
		if _, after, ok := strings.Cut(string(outb), "snapshot blocks: "); ok {
			fmt.Sscan(after, &stored)
		}
		close(stop)
		wg.Wait()
		close(done)
		after := rss()
		allocated := metric(t, scrape(t, metrics), "go_memstats_alloc_bytes_total") - allocBefore
		t.Logf("N=%d round %d: snapshot of %d blocks in %v; Lookup idle %s; during %s; RSS before %d MiB, peak %d MiB (+%d B/block), after %d MiB; allocated %.0f B/block meanwhile (the Lookups' included)",
			n, r, stored, took.Round(time.Millisecond), pct(idle), pct(during), before>>20, peak>>20, (peak-before)/int64(n), after>>20, allocated/float64(n))
		if stored != n {
			t.Errorf("the snapshot held %d blocks, want %d", stored, n)
		}
	}
}

// readSnapshot reads a snapshot of every namespace up to its CAUGHT_UP and
// prints how many blocks it held.
func readSnapshot(t *testing.T, sock string) {
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w, err := c.API.WatchEvents(ctx, &pb.WatchEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	stored := 0
	for {
		resp, err := w.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range resp.Events {
			switch e.Kind {
			case pb.EventKind_EVENT_KIND_BLOCK_STORED:
				stored++
			case pb.EventKind_EVENT_KIND_CAUGHT_UP:
				fmt.Printf("snapshot blocks: %d\n", stored)
				return
			}
		}
	}
}
