package baseline

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
)

// ProcessCopier is a SegmentCopier that runs in a process of its own: the
// copy a sidecar must do, done by the smallest sidecar there is. The
// daemon is another process than the engine and must be: the engine's
// pages reach it through its own mapping, in its own address space, and
// its threads sleep between steps while the engine runs. On this
// project's VM (shadow page tables) that alone made the very same copy
// code 0.67-0.81 as fast as in the process that filled the region
// (docs/benchmarks.md), so a daemon held against an in-process copy is
// held against a copy no sidecar can do there. kvbench reports both.
//
// Each Copy is one request over a pipe to the helper and its reply; the
// time is taken around both, as the daemon's is taken around its call:
// the helper's wake-up and the pipe are the least any sidecar pays for
// being told what to copy.
type ProcessCopier struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Reader
	stderr *tail // what the helper wrote on its error output (the end of it)
	spec   helperSpec
	next   int // the slot the next copy starts at
	req    []byte
	dead   error // the first error: every later Copy returns it
	waits  chan error
}

// tail keeps the last tailBytes written to it; exec copies the helper's
// error output into it from a goroutine of its own.
type tail struct {
	mu  sync.Mutex
	buf []byte
}

const tailBytes = 4 << 10

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > tailBytes {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-tailBytes:]...)
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.buf))
}

// said is the helper's error output, for an error message.
func (p *ProcessCopier) said() string {
	if s := p.stderr.String(); s != "" {
		return " (the helper said: " + s + ")"
	}
	return ""
}

// HelperArg, as a binary's first argument, makes it serve segment copies
// for a ProcessCopier (ServeSegmentCopies) instead of doing its own work:
// kvbench and this package's test binary do.
const HelperArg = "__kvbench-segment-copier"

// helperSpec is what the helper is started with.
type helperSpec struct {
	Path    string
	Shape   model.Shape
	Blocks  int
	Slots   int
	Workers int
}

const (
	helperReady = 'R' // after the warm-up copy
	opLoad      = 'L'
	opStore     = 'S'
)

// maxHelperBlocks bounds one request: a step moves at most the region.
const maxHelperBlocks = 1 << 16

// StartProcessCopier starts exe (a binary that calls ServeSegmentCopies
// when its first argument is HelperArg) as the copier of region, with a
// buffer of slots blocks (at least twice the region's) and workers
// threads, and waits until it has mapped the region and made its warm-up
// copy. The errors it returns end with what the helper wrote on its error
// output.
func StartProcessCopier(exe string, region *model.Region, slots, workers int) (*ProcessCopier, error) {
	spec := helperSpec{Path: region.Path, Shape: region.Shape, Blocks: region.Blocks, Slots: max(slots, 2*region.Blocks), Workers: max(workers, 1)}
	arg, err := json.Marshal(spec)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, HelperArg, string(arg))
	stderr := &tail{}
	cmd.Stderr = stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("segment copy baseline: start %s: %w", exe, err)
	}
	p := &ProcessCopier{cmd: cmd, in: in, out: bufio.NewReader(out), stderr: stderr, spec: spec, waits: make(chan error, 1)}
	go func() { p.waits <- cmd.Wait() }()
	if b, err := p.out.ReadByte(); err != nil || b != helperReady {
		cerr := p.Close() // waits for the helper, so all it said is in
		return nil, errors.Join(fmt.Errorf("segment copy baseline: the helper %s did not start (read %q, %v)%s", exe, b, err, p.said()), cerr)
	}
	return p, nil
}

// Pid is the helper's process id (its CPU time is the run's own).
func (p *ProcessCopier) Pid() int { return p.cmd.Process.Pid }

// Copy is SegmentCopier.Copy done by the helper: the time from the request
// to the reply, and the bytes moved. An error means the helper is gone or
// the request was wrong; the copier is then unusable.
func (p *ProcessCopier) Copy(blocks []int, toArena bool) (time.Duration, uint64, error) {
	if p.dead != nil {
		return 0, 0, p.dead
	}
	if len(blocks) == 0 {
		return 0, 0, nil
	}
	if len(blocks) > p.spec.Slots || len(blocks) > maxHelperBlocks {
		return 0, 0, fmt.Errorf("segment copy baseline: %d blocks in one copy, at most %d", len(blocks), min(p.spec.Slots, maxHelperBlocks))
	}
	op := byte(opLoad)
	if toArena {
		op = opStore
	}
	req := append(p.req[:0], op)
	req = binary.LittleEndian.AppendUint32(req, uint32(p.next))
	req = binary.LittleEndian.AppendUint32(req, uint32(len(blocks)))
	for _, b := range blocks {
		if b < 0 || b >= p.spec.Blocks {
			return 0, 0, fmt.Errorf("segment copy baseline: block %d of a region of %d", b, p.spec.Blocks)
		}
		req = binary.LittleEndian.AppendUint32(req, uint32(b))
	}
	p.req = req
	p.next = (p.next + len(blocks)) % p.spec.Slots
	t0 := time.Now()
	if _, err := p.in.Write(req); err != nil {
		p.dead = fmt.Errorf("segment copy baseline: helper: %w%s", err, p.said())
		return 0, 0, p.dead
	}
	var reply [8]byte
	if _, err := io.ReadFull(p.out, reply[:]); err != nil {
		p.dead = fmt.Errorf("segment copy baseline: helper gave no reply: %w%s", err, p.said())
		return 0, 0, p.dead
	}
	el := time.Since(t0)
	n := binary.LittleEndian.Uint64(reply[:])
	if want := uint64(len(blocks)) * uint64(p.spec.Shape.BlockBytes()); n != want {
		p.dead = fmt.Errorf("segment copy baseline: helper copied %d bytes of %d", n, want)
		return 0, 0, p.dead
	}
	return el, n, nil
}

// Close ends the helper (end of input, then a kill after 10 s) and waits
// for it.
func (p *ProcessCopier) Close() error {
	if p.cmd == nil {
		return nil
	}
	_ = p.in.Close()
	var err error
	select {
	case err = <-p.waits:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		err = <-p.waits
	}
	p.cmd = nil
	if p.dead == nil {
		p.dead = errors.New("segment copy baseline: closed")
	}
	if err != nil {
		return fmt.Errorf("segment copy baseline: helper: %w%s", err, p.said())
	}
	return nil
}

// ServeSegmentCopies is the helper's side: it makes the SegmentCopier arg
// describes, says it is ready on w, then copies what each request on r
// asks and replies with the bytes moved, until r ends. A malformed request
// ends it with an error.
func ServeSegmentCopies(arg string, r io.Reader, w io.Writer) error {
	var spec helperSpec
	if err := json.Unmarshal([]byte(arg), &spec); err != nil {
		return fmt.Errorf("segment copier helper: %w", err)
	}
	if err := spec.Shape.Validate(); err != nil || spec.Blocks < 1 || spec.Blocks > maxHelperBlocks {
		return fmt.Errorf("segment copier helper: bad spec %+v (%v)", spec, err)
	}
	c, err := newSegmentCopier(spec.Path, spec.Shape, spec.Blocks, spec.Slots, spec.Workers)
	if err != nil {
		return err
	}
	defer c.Close()
	bw := bufio.NewWriter(w)
	if err := bw.WriteByte(helperReady); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	br := bufio.NewReader(r)
	var hdr [9]byte
	var blocks []int
	for {
		if _, err := io.ReadFull(br, hdr[:]); err == io.EOF {
			return nil
		} else if err != nil {
			return fmt.Errorf("segment copier helper: %w", err)
		}
		op, first, n := hdr[0], int(binary.LittleEndian.Uint32(hdr[1:])), int(binary.LittleEndian.Uint32(hdr[5:]))
		if op != opLoad && op != opStore || first >= c.slots || n > c.slots || n > maxHelperBlocks {
			return fmt.Errorf("segment copier helper: bad request %q first %d n %d", op, first, n)
		}
		blocks = blocks[:0]
		var b [4]byte
		for range n {
			if _, err := io.ReadFull(br, b[:]); err != nil {
				return fmt.Errorf("segment copier helper: %w", err)
			}
			v := int(binary.LittleEndian.Uint32(b[:]))
			if v >= c.blocks {
				return fmt.Errorf("segment copier helper: block %d of a region of %d", v, c.blocks)
			}
			blocks = append(blocks, v)
		}
		_, moved := c.copyAt(first, blocks, op == opStore)
		var reply [8]byte
		binary.LittleEndian.PutUint64(reply[:], moved)
		if _, err := bw.Write(reply[:]); err != nil {
			return err
		}
		if err := bw.Flush(); err != nil {
			return err
		}
	}
}

// ServeIfHelper runs ServeSegmentCopies and exits when the process was
// started as a ProcessCopier's helper (its first argument is HelperArg);
// otherwise it returns. A binary that starts ProcessCopiers of itself
// calls it first thing in main (or TestMain).
func ServeIfHelper() {
	if len(os.Args) < 3 || os.Args[1] != HelperArg {
		return
	}
	if err := ServeSegmentCopies(os.Args[2], os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}
