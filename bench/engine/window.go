package engine

// The lookup rule for windowed KV cache groups (/work/notes/windows.md, the
// rule the Python connector follows too), in units of U = lcm(group block
// sizes) tokens: group g has bpu[g] blocks per unit and needs, for a hit
// ending at unit N, its blocks [0, N*bpu) when full attention (W = 0) or
// [max(0, N*bpu - W), N*bpu) when windowed with W blocks.

// windowStart is the first block of group (bpu, w) a hit of n units needs.
func windowStart(n, bpu, w int) int {
	if w == 0 {
		return 0
	}
	return max(0, n*bpu-w)
}

// storeNeeded reports whether block i of a group (bpu, w) can be inside
// some hit's window when hits end only at unit boundaries: always for full
// attention and for windows of a unit or more, else only the last w blocks
// of each unit.
func storeNeeded(i, bpu, w int) bool {
	return w == 0 || w >= bpu || i%bpu >= bpu-w
}

// WindowLookup is one lookup of a windowed group's window ending at a
// candidate hit: blocks [Start, End) of group Group, asked last block first.
type WindowLookup struct {
	Group, Start, End int
	// Run is the daemon's answer: the window's trailing run present.
	Run int
}

// probeCalls bounds a round's probe Lookups per request (the connector's
// _PROBE_CALLS).
const probeCalls = 24

// resolveHit applies the rule: f is the full-attention groups' ready
// prefix in units (the request's maximum when there are none); each round
// looks up every windowed group's window ending at f with trail (which
// returns the length of the window's trailing run present, asking the
// daemon with the keys in reverse order). A window whose run falls short
// at missing block m rules out every candidate whose windows hold m; the
// next candidate is the longest one not ruled out (floor(m/bpu) after one
// miss). Where every window fits in one unit (Mamba's one state block),
// each round after the first also probes the windows of up to probes
// candidates below f (trail's probe is true: a peek; at most probeCalls
// Lookups in all), and a candidate a probe found whole settles at once.
// After maxRounds rounds without every window present the answer is 0 (no
// hit is offered that was not checked). It returns the hit in units, every
// lookup it made and the rounds.
func resolveHit(f int, bpu, w []int, maxRounds, probes int, trail func(g, start, end int, probe bool) (int, error)) (int, []WindowLookup, int, error) {
	windowed := 0
	for g := range bpu {
		if w[g] != 0 {
			windowed++
			if w[g] > bpu[g] {
				probes = 0
			}
		}
	}
	if windowed == 0 {
		probes = 0
	} else if probes > 0 {
		// A probe is a Lookup per windowed group: at most probeCalls a
		// round, as the connector.
		probes = min(probes, max(1, probeCalls/windowed))
	}
	missing := map[[2]int]bool{} // {group, block}
	ruledOut := func(c int) bool {
		for g := range bpu {
			for i := windowStart(c, bpu[g], w[g]); w[g] != 0 && i < c*bpu[g]; i++ {
				if missing[[2]int{g, i}] {
					return true
				}
			}
		}
		return false
	}
	var asked []WindowLookup
	rounds := 0
	for round := 0; round < maxRounds && f > 0; round++ {
		rounds++
		cs := []int{f}
		for c := f - 1; round > 0 && c > 0 && c >= f-probes; c-- {
			if !ruledOut(c) {
				cs = append(cs, c)
			}
		}
		whole := map[int]bool{}
		for k, c := range cs {
			ok := true
			for g := range bpu {
				if w[g] == 0 {
					continue
				}
				start, end := windowStart(c, bpu[g], w[g]), c*bpu[g]
				r, err := trail(g, start, end, k > 0)
				if err != nil {
					return 0, asked, rounds, err
				}
				asked = append(asked, WindowLookup{Group: g, Start: start, End: end, Run: r})
				if r < end-start {
					missing[[2]int{g, end - 1 - r}] = true
					ok = false
				}
			}
			whole[c] = ok
		}
		next := 0
		for c := f; c > 0; c-- {
			if !ruledOut(c) {
				next = c
				break
			}
		}
		if whole[next] {
			return next, asked, rounds, nil
		}
		f = next
	}
	return 0, asked, rounds, nil
}

// bruteHit is the longest hit of at most maxUnits units that presence
// allows: every full-attention group's blocks from 0 and every windowed
// group's window present. presence[g][i] tells block i of group g.
func bruteHit(maxUnits int, bpu, w []int, presence [][]bool) int {
	for n := maxUnits; n > 0; n-- {
		ok := true
		for g := range bpu {
			for i := windowStart(n, bpu[g], w[g]); i < n*bpu[g] && ok; i++ {
				ok = i < len(presence[g]) && presence[g][i]
			}
		}
		if ok {
			return n
		}
	}
	return 0
}
