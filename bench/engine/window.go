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

// resolveHit applies the rule: f is the full-attention groups' ready
// prefix in units (the request's maximum when there are none); each round
// looks up every windowed group's window ending at f with trail (which
// returns the length of the window's trailing run present, asking the
// daemon with the keys in reverse order). A window whose run falls short
// at missing block m moves the candidate to floor(m/bpu), the last unit
// end at or before m. After maxRounds rounds without every window present
// the answer is 0 (no hit is offered that was not checked). It returns the
// hit in units and every lookup it made.
func resolveHit(f int, bpu, w []int, maxRounds int, trail func(g, start, end int) (int, error)) (int, []WindowLookup, error) {
	var asked []WindowLookup
	for round := 0; round < maxRounds && f > 0; round++ {
		next := f
		for g := range bpu {
			if w[g] == 0 {
				continue
			}
			start, end := windowStart(f, bpu[g], w[g]), f*bpu[g]
			r, err := trail(g, start, end)
			if err != nil {
				return 0, asked, err
			}
			asked = append(asked, WindowLookup{Group: g, Start: start, End: end, Run: r})
			if r < end-start {
				m := end - 1 - r
				next = min(next, m/bpu[g])
			}
		}
		if next == f {
			return f, asked, nil
		}
		f = next
	}
	return 0, asked, nil
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
