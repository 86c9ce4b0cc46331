package model

import (
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"time"
)

// Accounting checks: a light one after steps (bounds that hold at any
// moment), a full one once the daemon is quiet, and the end of a run.

// lightCheck scrapes the metrics and checks what must hold at any moment.
func (r *runner) lightCheck() error {
	m, err := r.p.Metrics()
	if err != nil {
		if e := r.alive(); e != nil {
			return e
		}
		return err
	}
	r.lastLoss = m.Losses()
	r.takeBaseline(m)
	r.faultsInc = max(r.faultsInc, m.Sum("kvoffload_faults_injected_total"))
	r.c.RSSMax = max(r.c.RSSMax, uint64(m.Sum("process_resident_memory_bytes")))
	pending := m.Sum("kvoffload_pending_jobs")
	r.settleOrphans(pending)
	if pending == 0 {
		if err := r.settleMaybes(); err != nil {
			return err
		}
	}
	live := 0
	for _, n := range r.live {
		live += n
	}
	regs := int(m.Sum("kvoffload_registrations"))
	if regs < live || regs > live+len(r.orphanRegs)+len(r.raced)+r.leaked {
		return r.fail("accounting", "kvoffload_registrations is %d: %d live, %d draining after a disconnect, %d raced with their connection's close", regs, live, len(r.orphanRegs), len(r.raced))
	}
	if regs == live {
		r.orphanRegs = nil
	}
	outstanding := len(r.orphans)
	for _, cn := range r.conns {
		for _, g := range cn.regs {
			if g != nil {
				outstanding += len(g.jobs)
			}
		}
	}
	if int(pending) > outstanding {
		return r.fail("accounting", "kvoffload_pending_jobs is %.0f, only %d jobs may be unfinished", pending, outstanding)
	}
	now := time.Now()
	ends := r.leaseEnds[:0]
	for _, e := range r.leaseEnds {
		if e.After(now) {
			ends = append(ends, e)
		}
	}
	r.leaseEnds = ends
	if l := m.Sum("kvoffload_leases"); int(l) > len(ends) {
		return r.fail("accounting", "kvoffload_leases is %.0f, only %d leases may be alive", l, len(ends))
	}
	may := 0
	for _, s := range r.m.keys {
		if len(s.present) > 0 {
			may++
		}
	}
	if e := m.Sum("kvoffload_index_entries"); int(e) > may {
		return r.fail("accounting", "kvoffload_index_entries is %.0f; at most %d keys may be there", e, may)
	}
	for _, tier := range []string{"cpu", "disk"} {
		used, capacity := m.Sum("kvoffload_tier_used_bytes", `tier="`+tier+`"`), m.Sum("kvoffload_tier_capacity_bytes", `tier="`+tier+`"`)
		if used > capacity {
			return r.fail("accounting", "%s tier uses %.0f of %.0f bytes", tier, used, capacity)
		}
	}
	return nil
}

// waitMetrics scrapes until ok holds or d passes; it returns the last
// scrape and whether ok held.
func (r *runner) waitMetrics(d time.Duration, ok func(Metrics) bool) (Metrics, bool, error) {
	deadline := time.Now().Add(d)
	for {
		m, err := r.p.Metrics()
		if err != nil {
			return nil, false, err
		}
		if ok(m) {
			return m, true, nil
		}
		if time.Now().After(deadline) {
			return m, false, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// drainResults reads completions until every job of every live
// registration has its result. A job still without one when the daemon
// has none pending was lost.
func (r *runner) drainResults() error {
	deadline := time.Now().Add(60 * time.Second)
	for {
		left := 0
		for _, cn := range r.conns {
			for _, g := range cn.regs {
				if g == nil || len(g.jobs) == 0 {
					continue
				}
				if err := r.readCompletions(g, 100, 0); err != nil {
					return err
				}
				left += len(g.jobs)
			}
		}
		if left == 0 {
			return nil
		}
		m, err := r.p.Metrics()
		if err != nil {
			return err
		}
		if young := r.youngestMaybe(); m.Sum("kvoffload_pending_jobs") == 0 && young > 0 {
			// A job its caller gave up on may still turn up.
			time.Sleep(young)
			continue
		}
		if m.Sum("kvoffload_pending_jobs") == 0 {
			// Nothing runs: one more read takes every result there is. A
			// job leaves the gauge just before its result is queued
			// (offload/jobs.go finish: the gauge counts copies, not
			// results), so the read waits for a result briefly: a
			// result that is on its way arrives in microseconds.
			for _, cn := range r.conns {
				for _, g := range cn.regs {
					if g != nil && len(g.jobs) > 0 {
						if err := r.readCompletions(g, 500, 0); err != nil {
							return err
						}
					}
				}
			}
			return r.lostJobs()
		}
		if time.Now().After(deadline) {
			return r.fail("lost-result", "%d jobs still unfinished after 60s; kvoffload_pending_jobs %.0f", left, m.Sum("kvoffload_pending_jobs"))
		}
	}
}

// youngestMaybe is how long until every maybe-job is maybeGrace old.
func (r *runner) youngestMaybe() time.Duration {
	var d time.Duration
	for _, cn := range r.conns {
		for _, g := range cn.regs {
			if g == nil {
				continue
			}
			for _, j := range g.jobs {
				if j.maybe {
					d = max(d, maybeGrace-time.Since(j.returned))
				}
			}
		}
	}
	return d
}

// maybeGrace is how long after its call gave up a job that the daemon may
// have taken can still turn up: the handler of a request whose caller left
// still runs it (the daemon accepts before it looks at the deadline), a
// few scheduling delays later, or many on a loaded machine.
const maybeGrace = 3 * time.Second

// lostJobs settles the jobs with no result once nothing is pending: a job
// the daemon may never have accepted (its call gave up) was not; any other
// is a lost result.
func (r *runner) lostJobs() error {
	for _, cn := range r.conns {
		for _, g := range cn.regs {
			if g == nil {
				continue
			}
			for _, id := range sortedKeys(g.jobs, func(a, b uint64) bool { return a < b }) {
				j := g.jobs[id]
				// Without the cursor a reply cut off loses its results,
				// as documented.
				if !j.maybe && !(g.legacy && g.cutoff > j.issued) {
					return r.fail("lost-result", "%s job %d of registration %d (step %d) was accepted and never reported; nothing is pending", j.op, j.id, g.id, j.step)
				}
				r.settleJob(g, j)
			}
		}
	}
	return nil
}

// settleJob gives up on a job with no result: a maybe-job was not taken,
// any other job's result was lost.
func (r *runner) settleJob(g *reg, j *jobRec) {
	delete(g.jobs, j.id)
	for _, b := range j.blocks {
		delete(g.busy, [2]int{j.group, int(b.block)})
	}
	if !j.maybe {
		r.settleLost(j)
		return
	}
	g.notTaken[j.id] = true
	for i := range j.blocks {
		if j.op == Load {
			r.m.loadSettled(j.blocks[i].key, j.incarnation == r.p.Incarnation, false)
		}
	}
	r.maybesSettled++
	if j.lossy || r.o.Tol["lost-wait-results"] {
		r.lossySettled++
	}
	if j.op == Store {
		for i := range j.blocks {
			r.m.storeSettled(j.blocks[i].key, &j.blocks[i], false, true, j.incarnation, r.p.Incarnation)
		}
	}
}

// settleMaybes decides the jobs whose call gave up before it could say
// whether the daemon took them. Called when nothing is pending: a job the
// daemon took (maybeGrace after its call) has finished, so its result is
// queued; one with no result after a read was never taken.
func (r *runner) settleMaybes() error {
	for _, cn := range r.conns {
		for _, g := range cn.regs {
			if g == nil {
				continue
			}
			old := 0
			for _, j := range g.jobs {
				if j.maybe && time.Since(j.returned) > maybeGrace {
					old++
				}
			}
			if old == 0 {
				continue
			}
			if err := r.readCompletions(g, 0, 0); err != nil {
				return err
			}
			for _, j := range g.jobs {
				if j.maybe && time.Since(j.returned) > maybeGrace {
					r.settleJob(g, j)
				}
			}
		}
	}
	return nil
}

// quiesce brings the daemon to rest (every result read, no job, lease or
// disk write in flight) and runs every accounting check.
func (r *runner) quiesce() error {
	if err := r.drainResults(); err != nil {
		return err
	}
	live := 0
	for _, n := range r.live {
		live += n
	}
	leak := 0
	if r.o.Tol["register-race-leak"] {
		leak = len(r.raced) + r.leaked
	}
	m, ok, err := r.waitMetrics(30*time.Second, func(m Metrics) bool {
		regs := int(m.Sum("kvoffload_registrations"))
		return m.Sum("kvoffload_pending_jobs") == 0 && m.Sum("kvoffload_leases") == 0 &&
			m.Sum("kvoffload_pinned_slots") == 0 && regs >= live && regs <= live+leak &&
			m.Sum("kvoffload_disk_recovering") == 0
	})
	if err != nil {
		return err
	}
	if !ok {
		return r.fail("accounting", "not quiet after 30s: kvoffload_pending_jobs %.0f, kvoffload_leases %.0f, kvoffload_pinned_slots %.0f, kvoffload_registrations %.0f (live %d, %d raced with their connection's close since the last check), kvoffload_disk_recovering %.0f",
			m.Sum("kvoffload_pending_jobs"), m.Sum("kvoffload_leases"), m.Sum("kvoffload_pinned_slots"), m.Sum("kvoffload_registrations"), live, len(r.raced), m.Sum("kvoffload_disk_recovering"))
	}
	r.settleOrphans(0)
	r.orphanRegs, r.raced = nil, nil
	r.leaked = int(m.Sum("kvoffload_registrations")) - live
	r.lastLoss = m.Losses()
	if err := r.p.DebugCheck(10 * time.Second); err != nil && err != errNoDebug {
		return r.fail("accounting", "/debug/check on a quiet daemon: %v", err)
	}
	return r.checkCounters()
}

// checkCounters compares the blocks the daemon counted with the results
// the runner read, and Stats with the metrics.
func (r *runner) checkCounters() error {
	var last error
	for try := 0; try < 20; try++ {
		if try > 0 {
			time.Sleep(25 * time.Millisecond)
		}
		m, err := r.p.Metrics()
		if err != nil {
			return err
		}
		if last = r.compareCounters(m); last == nil {
			break
		}
	}
	if last != nil {
		return r.fail("accounting", "%v", last)
	}
	return nil
}

func (r *runner) compareCounters(m Metrics) error {
	seen := map[string]bool{}
	for k := range r.tally {
		seen[k] = true
	}
	for name := range m {
		if rest, ok := strings.CutPrefix(name, "kvoffload_blocks_total{"); ok {
			op, st := labelOf(rest, "op"), labelOf(rest, "status")
			seen[op+"/"+st] = true
		}
	}
	keys := make([]string, 0, len(seen))
	for k := range seen {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var bad []string
	for _, k := range keys {
		op, st, _ := strings.Cut(k, "/")
		got := m.Sum("kvoffload_blocks_total", `op="`+op+`"`, `status="`+st+`"`)
		want := r.tally[k]
		exact := r.unobserved == 0 && r.lossySettled == 0
		if got < want || (exact && got != want) {
			bad = append(bad, fmt.Sprintf("%s: daemon counted %.0f, results said %.0f", k, got, want))
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("kvoffload_blocks_total disagrees with the results read (%d jobs' results were never read this incarnation, %d jobs whose call gave up were taken as never accepted, %d of them without ack_seq): %s", r.unobserved, r.maybesSettled, r.lossySettled, strings.Join(bad, "; "))
	}
	cl, err := r.client(0)
	if err != nil {
		return err
	}
	ctx, cancel := ctxFor(callTimeout)
	defer cancel()
	st, err := cl.Stats(ctx)
	if err != nil {
		return err
	}
	m2, err := r.p.Metrics()
	if err != nil {
		return err
	}
	failed := 0.0
	for name, v := range m2 {
		if strings.HasPrefix(name, "kvoffload_blocks_total{") && !strings.Contains(name, `status="ok"`) {
			failed += v
		}
	}
	checks := []struct {
		what      string
		stat, met float64
	}{
		{"blocks_stored", float64(st.GetBlocksStored()), m2.Sum("kvoffload_blocks_total", `op="store"`, `status="ok"`)},
		{"blocks_loaded", float64(st.GetBlocksLoaded()), m2.Sum("kvoffload_blocks_total", `op="load"`, `status="ok"`)},
		{"blocks_failed", float64(st.GetBlocksFailed()), failed},
		{"lookups", float64(st.GetLookups()), m2.Sum("kvoffload_lookups_total")},
		{"evictions", float64(st.GetEvictions()), m2.Sum("kvoffload_evictions_total") - m2.Sum("kvoffload_evictions_total", `reason="invalidate"`)},
	}
	for _, c := range checks {
		if c.stat != c.met {
			return fmt.Errorf("Stats.%s is %.0f, the metrics say %.0f", c.what, c.stat, c.met)
		}
	}
	return nil
}

func labelOf(labels, name string) string {
	i := strings.Index(labels, name+`="`)
	if i < 0 {
		return ""
	}
	v := labels[i+len(name)+2:]
	if j := strings.IndexByte(v, '"'); j >= 0 {
		return v[:j]
	}
	return v
}

// finalChecks ends a run: quiet, every block invalidated and every client
// gone, the daemon must hold no registration, mapping, pin or extra
// goroutine, stop cleanly, and (with a disk tier) offer nothing after a
// restart.
func (r *runner) finalChecks() error {
	if err := r.quiesce(); err != nil {
		return err
	}
	// Drop every block, so nothing keeps a block-size class alive.
	for set := range r.sh.Sets {
		if len(r.sh.Sets[set]) != 1 {
			continue
		}
		if err := r.invalidate(Op{Kind: InvalidateNS, NS: set}); err != nil {
			return err
		}
	}
	for c := range r.conns {
		if err := r.disconnect(c); err != nil {
			return err
		}
	}
	prefix := fmt.Sprintf("/dev/shm/kvmodel-%d-", os.Getpid())
	m, ok, err := r.waitMetrics(30*time.Second, func(m Metrics) bool {
		return int(m.Sum("kvoffload_registrations")) <= r.leaked && m.Sum("kvoffload_pending_jobs") == 0 && m.Sum("kvoffload_pinned_slots") == 0
	})
	if err != nil {
		return err
	}
	if !ok {
		return r.fail("leak", "every client gone, yet kvoffload_registrations %.0f, kvoffload_pending_jobs %.0f, kvoffload_pinned_slots %.0f",
			m.Sum("kvoffload_registrations"), m.Sum("kvoffload_pending_jobs"), m.Sum("kvoffload_pinned_slots"))
	}
	var maps []string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if maps, err = r.p.Mappings(prefix); err == nil && r.o.Tol["register-race-leak"] {
			maps = slices.DeleteFunc(maps, func(l string) bool {
				return slices.ContainsFunc(r.racedPaths, func(p string) bool { return strings.Contains(l, p) })
			})
		}
		if err != nil || len(maps) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(maps) > 0 {
		return r.fail("leak", "every registration gone, yet the daemon still maps %d region(s): %s", len(maps), strings.Join(maps[:min(3, len(maps))], " | "))
	}
	if err := r.p.DebugCheck(10 * time.Second); err != nil && err != errNoDebug {
		return r.fail("accounting", "/debug/check at the end: %v", err)
	}
	if err := r.checkGoroutines(); err != nil {
		return err
	}
	r.c.RSSEnd = r.p.RSS()
	if m, err := r.p.Metrics(); err == nil {
		r.c.GorEnd = m.Sum("go_goroutines")
		r.faultsInc = max(r.faultsInc, m.Sum("kvoffload_faults_injected_total"))
	}
	r.c.Faults += r.faultsInc
	if err := r.p.Stop(); err != nil {
		return r.fail("daemon", "%v", err)
	}
	skipped := r.c.Skipped
	defer func() { r.c.Skipped = skipped }()
	if r.sh.Durable() || r.sh.HasRemote() {
		// Everything was invalidated before a clean stop: nothing may
		// come back (docs/disk-format.md; from the remote tier,
		// docs/remote.md, Invalidation).
		r.op = Op{Kind: Restart}
		if err := r.startDaemon("", false); err != nil {
			return r.fail("daemon", "restart: %v", err)
		}
		r.m.restarted(false, false, false)
		for i := range r.nsID {
			r.nsID[i] = 0
		}
		// Recovery runs in the background: look once it has ended.
		if err := r.p.LetRecovery("all"); err != nil {
			return r.fail("daemon", "%v", err)
		}
		if _, ok, err := r.waitMetrics(60*time.Second, func(m Metrics) bool {
			return m.Sum("kvoffload_disk_recovering") == 0 && m.Sum("kvoffload_cpu_recovery_state") != 1
		}); err != nil || !ok {
			return r.fail("daemon", "the disk tier or the CPU arena still recovering 60s after the restart (%v)", err)
		}
		for set := range r.sh.Sets {
			for chain := 0; chain < r.sh.Chains; chain++ {
				for g := 0; g < r.sh.NS[r.sh.Sets[set][0]].Groups(); g++ {
					r.op = Op{Kind: Lookup, NS: set, Group: g, Chain: chain, N: r.sh.ChainLen}
					if err := r.lookup(r.op); err != nil {
						return err
					}
				}
			}
		}
		r.closeConn(0)
		if err := r.p.Stop(); err != nil {
			return r.fail("daemon", "%v", err)
		}
	}
	if probs := r.p.LogProblems(); len(probs) > 0 {
		return r.fail("daemon", "the daemon's logs report %d problem(s): %s", len(probs), strings.Join(probs[:min(5, len(probs))], " | "))
	}
	return nil
}

// checkGoroutines: with every client gone and every block dropped, the
// daemon's goroutines come back to what it had when it started. Under the
// class-goroutines tolerance the admission policies' goroutines (ristretto)
// are left out of both counts.
func (r *runner) checkGoroutines() error {
	base := r.baseGor
	count := func(m Metrics) float64 { return m.Sum("go_goroutines") }
	if r.o.Tol["class-goroutines"] {
		base = float64(countGoroutines(r.baseGorDmp, "ristretto"))
		count = func(Metrics) float64 { return float64(countGoroutines(r.p.Goroutines(), "ristretto")) }
	}
	// Namespaces with nothing left go after --namespace-linger (and a
	// sweep), their classes' goroutines with them.
	m, ok, err := r.waitMetrics(r.sh.Linger+15*time.Second, func(m Metrics) bool { return count(m) <= base })
	if err != nil {
		return err
	}
	if !ok {
		return r.fail("leak", "%.0f goroutines with every client gone and every block dropped, %.0f at start; now:\n%s\nat start:\n%s",
			count(m), base, r.p.Goroutines(), r.baseGorDmp)
	}
	return nil
}

// countGoroutines counts the goroutines of a debug=1 dump whose stacks do
// not mention skip. Each stack starts with "N @ pc..." and ends at a blank
// line.
func countGoroutines(dump, skip string) int {
	n, k := 0, 0
	var rec strings.Builder
	flush := func() {
		if k > 0 && (skip == "" || !strings.Contains(rec.String(), skip)) {
			n += k
		}
		k = 0
		rec.Reset()
	}
	for _, l := range strings.Split(dump, "\n") {
		var c int
		if _, err := fmt.Sscanf(l, "%d @", &c); err == nil && strings.Contains(l, " @ ") {
			flush()
			k = c
		}
		if strings.TrimSpace(l) == "" {
			flush()
			continue
		}
		rec.WriteString(l)
		rec.WriteByte('\n')
	}
	flush()
	return n
}
