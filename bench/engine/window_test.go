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
		trail := func(g, start, end int) (int, error) {
			r := 0
			for i := end - 1; i >= start && presence[g][i]; i-- {
				r++
			}
			return r, nil
		}
		want := bruteHit(maxUnits, bpu, w, presence)
		got, asked, err := resolveHit(f, bpu, w, 1<<20, trail)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("trial %d (seed %d): bpu %v w %v presence %v: hit %d, brute force %d", trial, seed, bpu, w, presence, got, want)
		}
		for _, a := range asked {
			if a.Start < 0 || a.End > maxUnits*bpu[a.Group] || w[a.Group] == 0 || a.End-a.Start > w[a.Group] || a.End%bpu[a.Group] != 0 {
				t.Fatalf("trial %d (seed %d): lookup %+v outside a window of %d blocks (bpu %d)", trial, seed, a, w[a.Group], bpu[a.Group])
			}
		}
		got4, _, _ := resolveHit(f, bpu, w, 4, trail)
		if got4 != want && got4 != 0 {
			t.Fatalf("trial %d (seed %d): 4 rounds give %d, the longest valid hit is %d", trial, seed, got4, want)
		}
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
