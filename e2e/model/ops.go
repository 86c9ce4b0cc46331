package model

import (
	"fmt"
	"strings"
)

// Kind is what an operation does.
type Kind uint8

// The operations. Each names the client (connection) and registration slot
// it acts through; the runner skips an operation that does not apply (a
// store on a slot with no registration), so any subsequence of a run is a
// run: that is what lets the reducer drop operations.
const (
	Register       Kind = iota // map a fresh region and register it in a namespace
	Unregister                 // drain the registration's jobs and drop it
	Resolve                    // namespace ids of every spec's fingerprint
	Lookup                     // ready prefix of a chain over a namespace set; maybe a lease, maybe a peek
	Store                      // jobs from engine blocks into the cache; maybe wait, maybe give up waiting
	Load                       // jobs from the cache into engine blocks; maybe naming a lease
	Completions                // read finished jobs
	InvalidateKeys             // drop keys of a namespace set
	InvalidateNS               // drop every block of a namespace set
	Disconnect                 // close a connection, jobs in flight or not
	Restart                    // SIGTERM, start again (maybe another fault plan, maybe --disk-reset)
	Kill                       // SIGKILL, start again
	Corrupt                    // flip bytes of written disk slots from outside
	RegionFault                // shrink a registration's region file under a store and a load, then restore it
	BadRequest                 // a malformed or refused request: the right code, and nothing accepted
	Stats                      // Stats agrees with the model
	Burst                      // stores, loads, lookups and completions sent at once
	RegisterRace               // a Register racing the close of its connection (issue 9 item 6)
	Check                      // quiesce, then every accounting check
	numKinds
)

var kindNames = [...]string{"register", "unregister", "resolve", "lookup", "store", "load", "completions",
	"invalidate-keys", "invalidate-ns", "disconnect", "restart", "kill", "corrupt", "region-fault",
	"bad-request", "stats", "burst", "register-race", "check"}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", k)
}

// ParseKinds reads a comma-separated list of kind names.
func ParseKinds(s string) (map[Kind]bool, error) {
	out := map[Kind]bool{}
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		found := false
		for k, n := range kindNames {
			if n == f {
				out[Kind(k)] = true
				found = true
			}
		}
		if !found {
			return nil, fmt.Errorf("unknown operation kind %q (have %s)", f, strings.Join(kindNames[:], ", "))
		}
	}
	return out, nil
}

// Bad request variants.
const (
	BadLayoutMismatch   = iota // a known fingerprint with another layout: FAILED_PRECONDITION
	BadRegionPath              // a region outside the shm directory: INVALID_ARGUMENT
	BadBlockRange              // a load into an engine block past the region: INVALID_ARGUMENT, no job accepted
	BadDuplicateJob            // two jobs with one id in a request: INVALID_ARGUMENT
	BadUnknownReg              // a registration id nobody holds: NOT_FOUND
	BadUnknownNS               // a lookup of a namespace id nobody made: INVALID_ARGUMENT
	BadSameBlockInJob          // one load job writing one engine block twice: INVALID_ARGUMENT
	BadSameBlockTwoJobs        // two jobs of one load writing one engine block (issue 9 item 3): INVALID_ARGUMENT
	BadForeignReg              // a store naming another connection's registration (item 4): refused
	numBad
)

var badNames = [...]string{"layout-mismatch", "region-path", "block-range", "duplicate-job", "unknown-registration",
	"unknown-namespace", "same-block-in-job", "same-block-two-jobs", "foreign-registration"}

// Op is one step of a run. Fields not used by its kind are zero.
type Op struct {
	Kind   Kind
	Client int
	Slot   int
	NS     int // Register: namespace spec; Lookup, Invalidate*: namespace set
	Group  int
	Chain  int
	From   int
	N      int
	Jobs   int // Store, Load: jobs in the request
	Wait   bool
	// Abandon: wait with a deadline too short for the jobs; their
	// results must then come through Completions.
	Abandon bool
	// Ack: a transfer over a registration using the cursor sends ack_seq:
	// with wait its results stay queued until acknowledged; without, the
	// reply carries the finished results after ack_seq (piggybacked).
	Ack      bool
	LeaseMs  uint32
	Peek     bool
	UseLease bool
	WaitMs   uint32
	MaxJobs  uint32
	// Restart: the fault plan of the next daemon ("" none) and whether it
	// starts with --disk-reset.
	Faults string
	Reset  bool
	Count  int // Corrupt: slots to damage; BadRequest: the variant
	Seed   uint64
	Sub    []Op // Burst: the operations sent at once
}

func (o Op) String() string {
	var b strings.Builder
	b.WriteString(o.Kind.String())
	switch o.Kind {
	case Register:
		fmt.Fprintf(&b, " c%d/r%d ns%d", o.Client, o.Slot, o.NS)
	case Unregister:
		fmt.Fprintf(&b, " c%d/r%d", o.Client, o.Slot)
	case Resolve, Stats:
		fmt.Fprintf(&b, " c%d", o.Client)
	case Lookup:
		fmt.Fprintf(&b, " c%d set%d g%d chain %d [0,%d)", o.Client, o.NS, o.Group, o.Chain, o.N)
		if o.LeaseMs > 0 {
			fmt.Fprintf(&b, " lease %dms", o.LeaseMs)
		}
		if o.Peek {
			b.WriteString(" peek")
		}
	case Store, Load:
		fmt.Fprintf(&b, " c%d/r%d g%d chain %d [%d,%d) jobs %d", o.Client, o.Slot, o.Group, o.Chain, o.From, o.From+o.N, o.Jobs)
		if o.Wait {
			b.WriteString(" wait")
		}
		if o.Ack {
			b.WriteString(" ack")
		}
		if o.Abandon {
			b.WriteString(" abandon")
		}
		if o.UseLease {
			b.WriteString(" lease")
		}
	case Completions:
		fmt.Fprintf(&b, " c%d/r%d wait %dms max %d", o.Client, o.Slot, o.WaitMs, o.MaxJobs)
	case InvalidateKeys:
		fmt.Fprintf(&b, " c%d set%d g%d chain %d [%d,%d)", o.Client, o.NS, o.Group, o.Chain, o.From, o.From+o.N)
	case InvalidateNS:
		fmt.Fprintf(&b, " c%d set%d", o.Client, o.NS)
	case Disconnect:
		fmt.Fprintf(&b, " c%d", o.Client)
	case Restart:
		if o.Faults != "" {
			fmt.Fprintf(&b, " faults %s", o.Faults)
		}
		if o.Reset {
			b.WriteString(" reset")
		}
	case Corrupt:
		fmt.Fprintf(&b, " %d slots of ns%d g%d", o.Count, o.NS, o.Group)
	case RegionFault:
		fmt.Fprintf(&b, " c%d/r%d g%d chain %d", o.Client, o.Slot, o.Group, o.Chain)
	case BadRequest:
		fmt.Fprintf(&b, " %s c%d/r%d", badNames[o.Count], o.Client, o.Slot)
	case RegisterRace:
		fmt.Fprintf(&b, " c%d ns%d", o.Client, o.NS)
	case Burst:
		b.WriteString(" [")
		for i, s := range o.Sub {
			if i > 0 {
				b.WriteString("; ")
			}
			b.WriteString(s.String())
		}
		b.WriteString("]")
	}
	fmt.Fprintf(&b, " #%x", o.Seed&0xffff)
	return b.String()
}
