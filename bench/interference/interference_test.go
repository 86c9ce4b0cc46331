package interference

import (
	"os/exec"
	"runtime"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	c, err := parseStat("cpu  100 5 50 1000 7 3 2 11 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
	if err != nil {
		t.Fatal(err)
	}
	if c.busy != 100+5+50+3+2 || c.steal != 11 {
		t.Errorf("parseStat: %+v, want busy 160 steal 11", c)
	}
	for _, bad := range []string{"", "intr 1 2 3", "cpu 1 2 x 4 5 6 7 8"} {
		if _, err := parseStat(bad); err == nil {
			t.Errorf("parseStat(%q): no error", bad)
		}
	}
	// A command name with spaces and a parenthesis in it.
	n, err := parseProcessStat("4242 (a b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 17 4 0 0 20 0 1 0 1 0 0")
	if err != nil || n != 21 {
		t.Errorf("parseProcessStat: %d, %v; want 21", n, err)
	}
	if _, err := parseProcessStat("12 (x) S 1 2"); err == nil {
		t.Error("parseProcessStat of a short line: no error")
	}
}

// TestOtherProcess runs a CPU-bound child for a phase: untracked, its time
// counts as other processes'; tracked, as the run's own.
func TestOtherProcess(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc")
	}
	const ticks = 30 // 0.3 s of CPU
	for _, tracked := range []bool{false, true} {
		m := New(0.05)
		child := exec.Command("sh", "-c", "while :; do :; done")
		if err := child.Start(); err != nil {
			t.Fatal(err)
		}
		pid := child.Process.Pid
		if tracked {
			m.Track(pid)
		}
		mk := m.Start("spin")
		start, err := processTicks(pid)
		if err != nil {
			t.Fatal(err)
		}
		// Wait for the child to use the CPU, polling its counters.
		for {
			now, err := processTicks(pid)
			if err != nil {
				t.Fatal(err)
			}
			if now-start >= ticks {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		p, err := m.End(mk)
		child.Process.Kill()
		child.Wait()
		if err != nil {
			t.Fatal(err)
		}
		capacity := p.Seconds * userHZ * float64(m.cpus)
		used := float64(ticks-3) / capacity // tick accounting differs by a few between the files
		t.Logf("tracked=%v: %+v (child at least %.3f)", tracked, p, used)
		if tracked && p.OwnCPUShare < used {
			t.Errorf("tracked child: own share %.3f, want at least %.3f", p.OwnCPUShare, used)
		}
		if !tracked && p.OtherCPUShare < used {
			t.Errorf("untracked child: other share %.3f, want at least %.3f", p.OtherCPUShare, used)
		}
		if !tracked && !p.Flagged {
			t.Errorf("untracked child using %.3f of the machine: not flagged at threshold 0.05", used)
		}
		if got := m.Phases(); len(got) != 1 || got[0].Name != "spin" {
			t.Errorf("phases: %+v", got)
		}
	}
}
