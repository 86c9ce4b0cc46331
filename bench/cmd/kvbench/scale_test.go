package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

// TestQuickScale runs the scale scenario at 4,096 blocks against the daemon
// built from this tree: every block stored with room is held, none reported
// stored is dropped over the disk tier, and after the kill -9 every block
// that was on disk comes back.
func TestQuickScale(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds and runs the daemon")
	}
	defer leakcheck.VerifyNone(t)
	rep, _ := runQuick(t, "--scenarios", "scale", "--scale-blocks", "4096", "--steps", "2", "--seed", "4")
	if len(rep.Scale) != 1 {
		t.Fatalf("scale rows: %+v", rep.Scale)
	}
	sc := rep.Scale[0]
	if sc.CPUStoredOK != 4096 || sc.CPUHeld != 4096 || sc.StatsMaxMs <= 0 {
		t.Fatalf("CPU tier: %+v", sc)
	}
	// The snapshot during Lookups: every block, each time (kvbench fails
	// otherwise), with Lookups all along (a snapshot of 4,096 blocks may
	// end within one Lookup).
	if sc.SnapshotBlocks != 4096 || len(sc.SnapshotSeconds) != 3 || sc.LookupsIdle == 0 {
		t.Fatalf("snapshot during Lookups: %+v", sc)
	}
	if sc.DiskSkipped != "" {
		t.Skipf("disk part skipped: %s", sc.DiskSkipped)
	}
	if sc.DiskStoredOK != 4096 || sc.DiskDropped != 0 || sc.DiskLost != 0 || sc.DiskOnDisk == 0 || sc.RecoveredBlocks < sc.DiskOnDisk || sc.BadSlots != 0 {
		t.Fatalf("disk tier: %+v", sc)
	}
}

// runQuick runs kvbench --quick with args (and --engine-blocks 48, no
// baselines, no Redis) against the daemon built from this tree, within 4
// minutes, logging its output; a kvbench error fails the test. It returns
// the report and what kvbench printed.
func runQuick(t *testing.T, args ...string) (*report.Report, string) {
	t.Helper()
	bin := buildDaemon(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	all := append([]string{"--quick", "--daemon", bin, "--engine-blocks", "48", "--baselines=false", "--redis-server", "none"}, args...)
	rep, err := run(ctx, all, &stdout, &stderr)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("kvbench: %v", err)
	}
	return rep, stdout.String()
}

// TestScaleFailedPhaseIsNotMet: when a phase of the scale scenario fails
// (here the daemon refuses to start), kvbench exits with the error, the
// row says so, and each of the phase's goals is NOT met with that error,
// never "met" off the zeros it did not fill in (a 4*10^6 run whose CPU
// tier could not be mapped reported every CPU goal met).
func TestScaleFailedPhaseIsNotMet(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds and runs the daemon")
	}
	bin := buildDaemon(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	rep, err := run(ctx, []string{"--quick", "--daemon", bin, "--baselines=false", "--redis-server", "none", "--scenarios", "scale",
		"--scale-blocks", "4096", "--daemon-arg=--io-workers=0"}, &stdout, &stderr)
	if err == nil || rep == nil {
		t.Fatalf("kvbench with a daemon that cannot start: %v\n%s", err, stdout.String())
	}
	if len(rep.Scale) != 1 || rep.Scale[0].CPUFailed == "" || (rep.Scale[0].DiskSkipped == "" && rep.Scale[0].DiskFailed == "") {
		t.Fatalf("scale rows: %+v", rep.Scale)
	}
	seen := 0
	for _, g := range rep.Goals {
		if !strings.HasPrefix(g.Name, "scale_4096_") {
			continue
		}
		seen++
		if g.Met == nil || *g.Met || g.Value != nil || !strings.Contains(g.Note, "the phase failed") {
			t.Errorf("goal %s of a failed phase: met %v, value %v, note %q", g.Name, g.Met, g.Value, g.Note)
		}
	}
	if seen < 3 {
		t.Fatalf("%d scale goals, want the CPU phase's 3 at least", seen)
	}
	if !strings.Contains(stdout.String(), "failed") {
		t.Fatalf("the report does not say the phase failed:\n%s", stdout.String())
	}
}

// TestScaleCPUBytes: room for 2N where memory allows, what it allows (less
// 2 GiB) down to 9N/8, an error below that.
func TestScaleCPUBytes(t *testing.T) {
	const n = 4_000_000
	for _, tc := range []struct {
		avail, want uint64
		fails       bool
	}{
		{avail: 0, want: 2 * n * 4096},               // unknown
		{avail: 64 << 30, want: 2 * n * 4096},        // room for 2N
		{avail: 22 << 30, want: 20 << 30},            // what is available, less 2 GiB
		{avail: n*4096*9/8 + 2<<30 - 1, fails: true}, // short of 9N/8
	} {
		got, err := scaleCPUBytes(n, tc.avail)
		if tc.fails != (err != nil) || (!tc.fails && (got < tc.want-(64<<20) || got > tc.want+(64<<20) || got%(64<<20) != 0)) {
			t.Errorf("avail %d: %d, %v; want about %d (fails %v)", tc.avail, got, err, tc.want, tc.fails)
		}
	}
}

// TestArenaRSS: the arena's resident bytes (and all anonymous ones, from
// the same read) are found whether its mapping is
// one or split in pieces, with other anonymous mappings right beside it and
// a file mapping in between.
func TestArenaRSS(t *testing.T) {
	m := func(start, end uint64, path string, rss uint64) string {
		h := fmt.Sprintf("%x-%x rw-p 00000000 00:00 0", start, end)
		if path != "" {
			h = fmt.Sprintf("%x-%x r-xp 00000000 fd:01 1234                       %s", start, end, path)
		}
		return fmt.Sprintf("%s\nSize:           %8d kB\nRss:            %8d kB\nAnonymous:      %8d kB\n", h, (end-start)>>10, rss>>10, rss>>10)
	}
	const G = 1 << 30
	whole := m(0x1000000000, 0x1000000000+4*G, "", 3*G)
	split := m(0x1000000000-G, 0x1000000000, "", 100<<20) + // a neighbour below
		m(0x1000000000, 0x1000000000+G, "", G) + m(0x1000000000+G, 0x1000000000+4*G, "", 2*G) +
		m(0x1000000000+4*G, 0x1000000000+5*G, "/usr/bin/x", 10<<20)
	for name, tc := range map[string]struct {
		smaps string
		anon  uint64
	}{"whole": {whole, 3 * G}, "split": {split, 3*G + 100<<20 + 10<<20}} {
		if anon, arena := anonAndArena(tc.smaps, 4*G); arena != 3*G || anon != tc.anon {
			t.Errorf("%s: anonymous %d, arena %d; want %d, %d", name, anon, arena, tc.anon, 3*G)
		}
	}
	// The Go runtime's reservations (no access) and a run of its heap
	// arenas that add up to the arena's size are not the arena.
	reserved := strings.Replace(m(0x2000000000, 0x2000000000+4*G, "", 16<<10), "rw-p", "---p", 1)
	heap := m(0x3000000000, 0x3000000000+2*G, "", 1<<20) + m(0x3000000000+2*G, 0x3000000000+4*G, "", 2<<20)
	if _, arena := anonAndArena(reserved+heap+whole, 4*G); arena != 3*G {
		t.Errorf("beside reservations and heap arenas of its size: arena %d, want %d", arena, 3*G)
	}
	if _, arena := anonAndArena(split, 8*G); arena != 0 {
		t.Errorf("an arena of no such size: %d", arena)
	}
}
