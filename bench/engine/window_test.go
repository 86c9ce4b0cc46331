package engine

import (
	"math/rand/v2"
	"testing"
	"time"
)

// The rule against a brute-force model: random groups (full attention or
// windowed, 1-4 blocks per unit), random presence per group; with rounds
// enough the rule finds exactly the longest valid hit, and with 4 rounds it
// finds it or nothing, never a hit the presence does not allow. Every
// lookup asks only blocks inside the window ending at its candidate.
func TestResolveHitMatchesBruteForce(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	for trial := range 20000 {
		groups := 1 + rng.IntN(4)
		bpu, w := make([]int, groups), make([]int, groups)
		presence := make([][]bool, groups)
		maxUnits := rng.IntN(12)
		for g := range groups {
			bpu[g] = 1 + rng.IntN(4)
			if rng.IntN(3) > 0 {
				w[g] = 1 + rng.IntN(3*bpu[g]+2)
			}
			p := rng.Float64()
			presence[g] = make([]bool, maxUnits*bpu[g])
			for i := range presence[g] {
				presence[g][i] = rng.Float64() < 0.6+0.4*p
			}
		}
		f := maxUnits
		for g := range groups {
			if w[g] != 0 {
				continue
			}
			run := 0
			for run < len(presence[g]) && presence[g][run] {
				run++
			}
			f = min(f, run/bpu[g])
		}
		trail := func(g, start, end int, _ bool) (int, error) {
			r := 0
			for i := end - 1; i >= start && presence[g][i]; i-- {
				r++
			}
			return r, nil
		}
		want := bruteHit(maxUnits, bpu, w, presence)
		for _, probes := range []int{0, 8} {
			got, asked, _, err := resolveHit(f, bpu, w, 1<<20, probes, trail)
			if err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Fatalf("trial %d (seed %d): bpu %v w %v presence %v probes %d: hit %d, brute force %d", trial, seed, bpu, w, presence, probes, got, want)
			}
			for _, a := range asked {
				if a.Start < 0 || a.End > maxUnits*bpu[a.Group] || w[a.Group] == 0 || a.End-a.Start > w[a.Group] || a.End%bpu[a.Group] != 0 {
					t.Fatalf("trial %d (seed %d): lookup %+v outside a window of %d blocks (bpu %d)", trial, seed, a, w[a.Group], bpu[a.Group])
				}
			}
			got4, _, _, _ := resolveHit(f, bpu, w, 4, probes, trail)
			if got4 != want && got4 != 0 {
				t.Fatalf("trial %d (seed %d): 4 rounds of %d probes give %d, the longest valid hit is %d", trial, seed, probes, got4, want)
			}
		}
	}
}

// Windows of one unit or less (Mamba's state block): within 4 rounds,
// probes settle every case one candidate per round settles, and more.
func TestProbesSettleMoreWithinTheBound(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 2))
	cut := map[int]int{}
	for trial := range 5000 {
		bpu := []int{1 + rng.IntN(2), 1 + rng.IntN(4)}
		w := []int{0, 1 + rng.IntN(bpu[1])}
		maxUnits := 4 + rng.IntN(20)
		presence := [][]bool{make([]bool, maxUnits*bpu[0]), make([]bool, maxUnits*bpu[1])}
		for i := range presence[0] {
			presence[0][i] = true
		}
		p := []float64{0.2, 0.5, 0.8}[rng.IntN(3)]
		for i := range presence[1] {
			presence[1][i] = rng.Float64() < p
		}
		peeks := 0
		trail := func(g, start, end int, probe bool) (int, error) {
			if probe {
				peeks++
			}
			r := 0
			for i := end - 1; i >= start && presence[g][i]; i-- {
				r++
			}
			return r, nil
		}
		want := bruteHit(maxUnits, bpu, w, presence)
		got := map[int]int{}
		for _, probes := range []int{0, 8} {
			peeks = 0
			got[probes], _, _, _ = resolveHit(maxUnits, bpu, w, 4, probes, trail)
			if probes == 0 && peeks != 0 {
				t.Fatalf("trial %d (seed %d): %d probes with probes off", trial, seed, peeks)
			}
			if got[probes] != want {
				cut[probes]++
			}
		}
		if got[0] == want && got[8] != want {
			t.Fatalf("trial %d (seed %d): bpu %v w %v presence %v: one candidate a round finds %d, probes %d", trial, seed, bpu, w, presence, want, got[8])
		}
	}
	t.Logf("cut to 0 within 4 rounds: %d of 5000 without probes, %d with 8", cut[0], cut[8])
	if cut[8] >= cut[0] {
		t.Errorf("probes settled no more cases: %v", cut)
	}
}

// A windowed block is stored exactly when some hit ending at a unit
// boundary has it in its window.
func TestStoreNeededMatchesWindows(t *testing.T) {
	for bpu := 1; bpu <= 6; bpu++ {
		for w := 0; w <= 3*bpu+1; w++ {
			for i := range 8 * bpu {
				inSome := false
				for n := 1; n <= 10; n++ {
					inSome = inSome || i >= windowStart(n, bpu, w) && i < n*bpu
				}
				if storeNeeded(i, bpu, w) != inSome {
					t.Errorf("bpu %d, w %d, block %d: storeNeeded %v, inside some window %v", bpu, w, i, storeNeeded(i, bpu, w), inSome)
				}
			}
		}
	}
}
