package model

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Reduce looks for a shorter sequence that fails the same way as f, the
// first finding of a run of o: it cuts the run after the failing step, then
// drops chunks of operations, halving the chunk size down to single
// operations (delta debugging), as long as budget allows. Each try is a
// fresh daemon. It returns the operation indices that still fail and their
// finding.
//
// A run is not fully deterministic (the daemon's copy workers, policies and
// disk queues race), so a try that passes does not prove its operations
// innocent; tries repeats each candidate to make that less likely.
func Reduce(o Options, f Finding, budget time.Duration, tries int, logf func(string, ...any)) ([]int, Finding) {
	deadline := time.Now().Add(budget)
	keep := make([]int, 0, o.Steps)
	for i := 0; i < o.Steps && i <= f.Step; i++ {
		keep = append(keep, i)
	}
	if o.Keep != nil {
		keep = keep[:0]
		for _, i := range o.Keep {
			if i <= f.Step {
				keep = append(keep, i)
			}
		}
	}
	best := f
	runs := 0
	fails := func(cand []int) (bool, Finding) {
		for t := 0; t < max(1, tries); t++ {
			if time.Now().After(deadline) {
				return false, Finding{}
			}
			ro := o
			ro.Keep, ro.Dir, ro.Trace, ro.Duration = cand, "", false, 0
			// A finding before the end needs no end checks to show.
			ro.SkipFinal = f.Step < o.Steps
			ro.DropDir = true
			ro.Logf = func(string, ...any) {}
			_, err := Run(ro)
			runs++
			var ef *ErrFinding
			if errors.As(err, &ef) && ef.Category == f.Category {
				return true, ef.Finding
			}
		}
		return false, Finding{}
	}
	// cut drops what follows the failing operation of a reduced run.
	cut := func(cand []int, g Finding) []int {
		for i, x := range cand {
			if x == g.Step {
				return cand[:i+1]
			}
		}
		return cand
	}
	if ok, g := fails(keep); ok {
		keep, best = cut(keep, g), g
	} else {
		logf("reduce: the prefix through step %d did not fail again; reducing the whole run", f.Step)
		keep = keep[:0]
		for i := 0; i < o.Steps; i++ {
			keep = append(keep, i)
		}
		if o.Keep != nil {
			keep = append(keep[:0], o.Keep...)
		}
	}
	// Whole kinds first: most operations of a long run do not matter to
	// one finding, and dropping every lookup (say) at once is one try.
	ops := Generate(o.Seed, o.Shape, o.Steps, o.Off)
	for k := Kind(0); k < numKinds && time.Now().Before(deadline); k++ {
		var cand []int
		for _, i := range keep {
			if i >= len(ops) || ops[i].Kind != k || i == best.Step {
				cand = append(cand, i)
			}
		}
		if len(cand) == len(keep) || len(cand) == 0 {
			continue
		}
		if ok, g := fails(cand); ok {
			keep, best = cut(cand, g), g
			logf("reduce: without %s operations, %d still fail (%s)", k, len(keep), g.Category)
		}
	}
	for n := 2; len(keep) > 1 && time.Now().Before(deadline); {
		chunk := (len(keep) + n - 1) / n
		removed := false
		for start := 0; start < len(keep) && time.Now().Before(deadline); start += chunk {
			cand := append(append([]int{}, keep[:start]...), keep[min(len(keep), start+chunk):]...)
			if len(cand) == 0 {
				continue
			}
			if ok, g := fails(cand); ok {
				keep, best = cut(cand, g), g
				logf("reduce: %d operations still fail (%s)", len(keep), g.Category)
				n = max(n-1, 2)
				removed = true
				break
			}
		}
		if !removed {
			if chunk == 1 {
				break
			}
			n = min(2*n, len(keep))
		}
	}
	logf("reduce: %d runs; %d operations left", runs, len(keep))
	return keep, best
}

// FormatKeep writes indices as ranges: 0-3,17,45-60.
func FormatKeep(keep []int) string {
	var b strings.Builder
	for i := 0; i < len(keep); {
		j := i
		for j+1 < len(keep) && keep[j+1] == keep[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		if j > i {
			fmt.Fprintf(&b, "%d-%d", keep[i], keep[j])
		} else {
			fmt.Fprintf(&b, "%d", keep[i])
		}
		i = j + 1
	}
	return b.String()
}

// ParseKeep reads what FormatKeep writes.
func ParseKeep(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(f, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			return nil, fmt.Errorf("keep %q: %w", f, err)
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil || b < a {
				return nil, fmt.Errorf("keep %q: bad range", f)
			}
		}
		for i := a; i <= b; i++ {
			out = append(out, i)
		}
	}
	return out, nil
}

// Script prints the operations of a (reduced) run, one a line.
func Script(o Options, keep []int) string {
	ops := Generate(o.Seed, o.Shape, o.Steps, o.Off)
	var b strings.Builder
	for _, i := range keep {
		if i < len(ops) {
			fmt.Fprintf(&b, "  %5d  %s\n", i, ops[i])
		}
	}
	return b.String()
}
