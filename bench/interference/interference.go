// Package interference owns kvbench's view of the rest of the machine: how
// much CPU other processes used while a phase of the run was measured, read
// from /proc, so that a figure taken while a neighbour was busy is flagged
// rather than trusted. On a shared machine that is the difference between a
// ratio that says something about the daemon and one that says something
// about the neighbours.
package interference

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// userHZ is the unit of /proc/stat and /proc/PID/stat times. Linux fixes it
// at 100 for every architecture kvoffloadd runs on (USER_HZ, independent
// of the kernel's CONFIG_HZ).
const userHZ = 100

// DefaultThreshold flags a phase in which other processes used more than a
// tenth of the machine's CPU time.
const DefaultThreshold = 0.10

// Phase is what the rest of the machine did while one phase ran.
type Phase struct {
	Name    string  `json:"name"`
	Seconds float64 `json:"seconds"`
	// OtherCPUShare is the CPU time of every process but the tracked ones
	// (kvbench and the daemons and servers it started), as a share of the
	// machine's CPU time during the phase (1 = every core busy).
	OtherCPUShare float64 `json:"other_cpu_share"`
	// OwnCPUShare is the tracked processes' share, for scale.
	OwnCPUShare float64 `json:"own_cpu_share"`
	// StealShare is the time the hypervisor gave this VM's CPUs to others.
	StealShare float64 `json:"steal_share"`
	// Load1 is the one-minute load average at the end of the phase.
	Load1 float64 `json:"load1"`
	// Flagged: OtherCPUShare or StealShare was above the threshold.
	Flagged bool `json:"flagged"`
}

// Meter measures phases. Track adds the processes that belong to the run;
// their CPU time is not interference. It is safe for concurrent use.
type Meter struct {
	threshold float64
	cpus      int

	mu struct {
		sync.Mutex
		pids   map[int]bool
		phases []Phase
	}
}

// New returns a meter that flags phases above threshold (0 means
// DefaultThreshold), tracking the calling process.
func New(threshold float64) *Meter {
	if threshold <= 0 {
		threshold = DefaultThreshold
	}
	m := &Meter{threshold: threshold, cpus: runtime.NumCPU()}
	m.mu.pids = map[int]bool{os.Getpid(): true}
	return m
}

// Track counts pid's CPU time as the run's own. A process tracked while a
// phase runs must have started during it (all its CPU time is counted in
// that phase). Untrack a process only after the phase it ran in ended: one
// that exits inside a phase takes its CPU time with it, and that time
// would show as other processes'.
func (m *Meter) Track(pid int) {
	m.mu.Lock()
	m.mu.pids[pid] = true
	m.mu.Unlock()
}

// Untrack stops tracking pid.
func (m *Meter) Untrack(pid int) {
	m.mu.Lock()
	delete(m.mu.pids, pid)
	m.mu.Unlock()
}

// Mark is the machine's counters at the start of a phase.
type Mark struct {
	name string
	at   time.Time
	cpu  cpuTimes
	own  map[int]uint64
	err  error
}

// Start begins a phase.
func (m *Meter) Start(name string) Mark {
	mk := Mark{name: name, at: time.Now()}
	mk.cpu, mk.err = readCPU()
	mk.own = m.ownTicks()
	return mk
}

// End closes the phase, records it and returns it. A phase whose counters
// could not be read (no /proc) is returned with an error and not recorded.
func (m *Meter) End(mk Mark) (Phase, error) {
	if mk.err != nil {
		return Phase{}, mk.err
	}
	cpu, err := readCPU()
	if err != nil {
		return Phase{}, err
	}
	own := m.ownTicks()
	el := time.Since(mk.at)
	p := Phase{Name: mk.name, Seconds: el.Seconds(), Load1: load1()}
	var ownTicks uint64
	for pid, t := range own {
		if t0, ok := mk.own[pid]; !ok {
			// Started and tracked during the phase: all of its time
			// falls inside it.
			ownTicks += t
		} else if t >= t0 {
			ownTicks += t - t0
		}
	}
	capacity := el.Seconds() * userHZ * float64(m.cpus)
	if capacity > 0 {
		busy := float64(cpu.busy - mk.cpu.busy)
		p.OwnCPUShare = float64(ownTicks) / capacity
		p.OtherCPUShare = max(busy-float64(ownTicks), 0) / capacity
		p.StealShare = float64(cpu.steal-mk.cpu.steal) / capacity
	}
	p.Flagged = p.OtherCPUShare > m.threshold || p.StealShare > m.threshold
	m.mu.Lock()
	m.mu.phases = append(m.mu.phases, p)
	m.mu.Unlock()
	return p, nil
}

// Phases returns every phase recorded, in order.
func (m *Meter) Phases() []Phase {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Phase(nil), m.mu.phases...)
}

// Threshold is the share above which a phase is flagged.
func (m *Meter) Threshold() float64 { return m.threshold }

// ownTicks reads the CPU time of every tracked process that is still there.
func (m *Meter) ownTicks() map[int]uint64 {
	m.mu.Lock()
	pids := make([]int, 0, len(m.mu.pids))
	for p := range m.mu.pids {
		pids = append(pids, p)
	}
	m.mu.Unlock()
	out := make(map[int]uint64, len(pids))
	for _, p := range pids {
		if t, err := processTicks(p); err == nil {
			out[p] = t
		}
	}
	return out
}

// cpuTimes are /proc/stat's totals over every CPU, in USER_HZ ticks.
type cpuTimes struct {
	busy  uint64 // user+nice+system+irq+softirq (guest time is inside user)
	steal uint64
}

func readCPU() (cpuTimes, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}, err
	}
	return parseStat(string(b))
}

// parseStat reads the first ("cpu ") line of /proc/stat.
func parseStat(s string) (cpuTimes, error) {
	line, _, _ := strings.Cut(s, "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return cpuTimes{}, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	v := make([]uint64, 8)
	for i := range v {
		n, err := strconv.ParseUint(f[i+1], 10, 64)
		if err != nil {
			return cpuTimes{}, fmt.Errorf("/proc/stat: %q: %w", line, err)
		}
		v[i] = n
	}
	// user nice system idle iowait irq softirq steal
	return cpuTimes{busy: v[0] + v[1] + v[2] + v[5] + v[6], steal: v[7]}, nil
}

// processTicks is utime+stime of a process, every thread included.
func processTicks(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return parseProcessStat(string(b))
}

// parseProcessStat reads fields 14 and 15 (utime, stime) of /proc/PID/stat;
// the command name, field 2, is in parentheses and may hold spaces.
func parseProcessStat(s string) (uint64, error) {
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("/proc/PID/stat: no command name")
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state): utime is field 14, f[11].
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/PID/stat: %d fields after the name", len(f))
	}
	u, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("/proc/PID/stat: %w", err)
	}
	return u + st, nil
}

func load1() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
