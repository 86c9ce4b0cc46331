package errorfs

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Kind is a kind of injected fault.
type Kind uint8

const (
	// ReadEIO fails a read with EIO; nothing is read.
	ReadEIO Kind = iota
	// WriteEIO fails a write or a sync with EIO; nothing is written.
	WriteEIO
	// ShortRead returns a prefix of the data, a whole number of 4 KiB
	// units shorter than asked (possibly none), with io.EOF.
	ShortRead
	// TornWrite writes only a prefix of the buffer, a whole number of
	// 4 KiB units shorter than asked (possibly none), and returns the
	// prefix length with EIO: the disk wrote part of it and said so.
	TornWrite
	// BitFlip flips one bit of the data a read returns and reports
	// success: the disk lies, only a checksum catches it.
	BitFlip
	// ENOSPC fails a write or a preallocation with ENOSPC; nothing is
	// written or allocated.
	ENOSPC
	// Latency delays a read, write, sync or preallocation by an
	// exponentially distributed time (mean Plan.Latency, capped at ten
	// times it) before doing it normally.
	Latency
	// Index fails the operation chosen with FS.FailAtIndex with EIO.
	Index

	numKinds
)

var kindNames = [numKinds]string{
	ReadEIO:   "read-eio",
	WriteEIO:  "write-eio",
	ShortRead: "short-read",
	TornWrite: "torn-write",
	BitFlip:   "bitflip",
	ENOSPC:    "enospc",
	Latency:   "latency",
	Index:     "index",
}

// String is the kind's name in a fault spec and in metrics.
func (k Kind) String() string {
	if k < numKinds {
		return kindNames[k]
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// Plan says how often each kind of fault is injected. A rate is the
// probability, in [0,1], that one eligible operation gets the fault. The
// zero Plan injects nothing.
type Plan struct {
	ReadEIO   float64
	WriteEIO  float64
	ShortRead float64
	TornWrite float64
	BitFlip   float64
	ENOSPC    float64
	// Latency is the mean added delay; LatencyRate how often it is added.
	Latency     time.Duration
	LatencyRate float64
	// Seed makes the faults reproducible: with the same seed, a file of
	// the same name sees the same faults at the same positions of its
	// sequence of operations.
	Seed uint64
}

// rateKinds lists the kinds that a spec gives as kind=rate, in the
// canonical order of Plan.String.
var rateKinds = [...]Kind{ReadEIO, WriteEIO, ShortRead, TornWrite, BitFlip, ENOSPC}

// rate returns a pointer to the plan's rate for k, nil for the kinds
// without a plain rate.
func (p *Plan) rate(k Kind) *float64 {
	switch k {
	case ReadEIO:
		return &p.ReadEIO
	case WriteEIO:
		return &p.WriteEIO
	case ShortRead:
		return &p.ShortRead
	case TornWrite:
		return &p.TornWrite
	case BitFlip:
		return &p.BitFlip
	case ENOSPC:
		return &p.ENOSPC
	case Latency:
		return &p.LatencyRate
	}
	return nil
}

// Rate returns the plan's rate for k (0 for Index, which has none).
func (p Plan) Rate(k Kind) float64 {
	if r := p.rate(k); r != nil {
		return *r
	}
	return 0
}

// Enabled reports whether the plan injects anything.
func (p Plan) Enabled() bool {
	for _, k := range rateKinds {
		if p.Rate(k) > 0 {
			return true
		}
	}
	return p.LatencyRate > 0 && p.Latency > 0
}

// Validate checks what ParsePlan checks, for a Plan built in code: every
// rate is in [0,1], and a latency with a rate is positive.
func (p Plan) Validate() error {
	for _, k := range append(rateKinds[:], Latency) {
		if r := p.Rate(k); !(r >= 0 && r <= 1) {
			return fmt.Errorf("%w: %s rate %v is outside [0,1]", ErrSpec, k, r)
		}
	}
	if p.Latency < 0 || (p.LatencyRate > 0 && p.Latency == 0) {
		return fmt.Errorf("%w: latency %v at rate %v: the latency must be positive", ErrSpec, p.Latency, p.LatencyRate)
	}
	return nil
}

// String is the plan in canonical spec form, for logs: the kinds with a
// non-zero rate in a fixed order, then latency, then the seed. ParsePlan
// reads it back to an equal Plan. The zero Plan is "".
func (p Plan) String() string {
	var parts []string
	for _, k := range rateKinds {
		if r := p.Rate(k); r != 0 {
			parts = append(parts, k.String()+"="+formatRate(r))
		}
	}
	if p.Latency != 0 || p.LatencyRate != 0 {
		parts = append(parts, "latency="+p.Latency.String()+"@"+formatRate(p.LatencyRate))
	}
	if len(parts) > 0 || p.Seed != 0 {
		parts = append(parts, "seed="+strconv.FormatUint(p.Seed, 10))
	}
	return strings.Join(parts, ",")
}

func formatRate(r float64) string { return strconv.FormatFloat(r, 'g', -1, 64) }

// ParsePlan reads a --fault-spec: a comma-separated list of kind=rate
// (kinds read-eio, write-eio, short-read, torn-write, bitflip, enospc),
// latency=DURATION@RATE and seed=N, each at most once, for example
// "read-eio=0.01,bitflip=0.001,latency=2ms@0.05,seed=7". Spaces around
// tokens are ignored. The empty spec is the zero Plan: no faults. Errors
// wrap ErrSpec and quote the offending token.
func ParsePlan(spec string) (Plan, error) {
	var p Plan
	if strings.TrimSpace(spec) == "" {
		return p, nil
	}
	seen := make(map[string]bool)
	for _, tok := range strings.Split(spec, ",") {
		tok = strings.TrimSpace(tok)
		bad := func(format string, args ...any) (Plan, error) {
			return Plan{}, fmt.Errorf("%w: token %q: %s", ErrSpec, tok, fmt.Sprintf(format, args...))
		}
		name, val, ok := strings.Cut(tok, "=")
		name, val = strings.TrimSpace(name), strings.TrimSpace(val)
		if !ok || name == "" {
			return bad("want kind=value")
		}
		if seen[name] {
			return bad("%s is given twice", name)
		}
		seen[name] = true
		switch name {
		case "seed":
			seed, err := strconv.ParseUint(val, 10, 64)
			if err != nil {
				return bad("seed must be an unsigned integer")
			}
			p.Seed = seed
		case "latency":
			ds, rs, ok := strings.Cut(val, "@")
			if !ok {
				return bad("want latency=DURATION@RATE, for example latency=2ms@0.05")
			}
			d, err := time.ParseDuration(ds)
			if err != nil || d <= 0 {
				return bad("latency %q is not a positive duration", ds)
			}
			r, err := parseRate(rs)
			if err != nil {
				return bad("%v", err)
			}
			p.Latency, p.LatencyRate = d, r
		default:
			k, ok := rateKindByName(name)
			if !ok {
				return bad("unknown kind %q (known: %s, latency, seed)", name, knownRateKinds())
			}
			r, err := parseRate(val)
			if err != nil {
				return bad("%v", err)
			}
			*p.rate(k) = r
		}
	}
	return p, nil
}

func parseRate(s string) (float64, error) {
	r, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return 0, fmt.Errorf("rate %q is not a number", s)
	}
	if !(r >= 0 && r <= 1) {
		return 0, fmt.Errorf("rate %s is outside [0,1]", s)
	}
	return r, nil
}

func rateKindByName(name string) (Kind, bool) {
	for _, k := range rateKinds {
		if k.String() == name {
			return k, true
		}
	}
	return 0, false
}

func knownRateKinds() string {
	names := make([]string, len(rateKinds))
	for i, k := range rateKinds {
		names[i] = k.String()
	}
	return strings.Join(names, ", ")
}
