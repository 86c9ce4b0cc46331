package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// progress draws a bar on stderr when it is a terminal and the run has
// lasted more than a couple of seconds; elsewhere (a log, a test) it
// prints one line per phase.
type progress struct {
	w           io.Writer
	tty         bool
	start, last time.Time
	total, done int
	label       string
	drawn       bool
}

func newProgress(w io.Writer, total int) *progress {
	tty := false
	if f, ok := w.(*os.File); ok {
		_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
		tty = err == nil
	}
	return &progress{w: w, tty: tty, start: time.Now(), total: max(total, 1)}
}

// phase starts a named part of the run worth units of the total.
func (p *progress) phase(label string) {
	p.label = label
	if !p.tty {
		fmt.Fprintf(p.w, "kvbench: %s (%.0fs)\n", label, time.Since(p.start).Seconds())
		return
	}
	p.draw(true)
}

// advance marks n units done.
func (p *progress) advance(n int) {
	p.done = min(p.done+n, p.total)
	p.draw(false)
}

func (p *progress) draw(force bool) {
	if !p.tty || time.Since(p.start) < 2*time.Second || (!force && time.Since(p.last) < 100*time.Millisecond) {
		return
	}
	p.last = time.Now()
	const width = 30
	n := p.done * width / p.total
	fmt.Fprintf(p.w, "\r\033[K[%s%s] %3d%% %s (%.0fs)", strings.Repeat("#", n), strings.Repeat("-", width-n),
		100*p.done/p.total, p.label, time.Since(p.start).Seconds())
	p.drawn = true
}

// end clears the bar.
func (p *progress) end() {
	if p.drawn {
		fmt.Fprint(p.w, "\r\033[K")
	}
}
