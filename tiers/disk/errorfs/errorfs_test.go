package errorfs_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

const fileSize = 64 << 10

func newMem(t *testing.T, dirs ...string) vfs.FS {
	t.Helper()
	m := vfs.NewMem()
	for _, d := range dirs {
		if err := m.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	return m
}

func newFS(t *testing.T, inner vfs.FS, opts errorfs.Options) *errorfs.FS {
	t.Helper()
	fs, err := errorfs.New(inner, opts)
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7+i>>12)
	}
	return b
}

// seedFile writes old bytes into path through the inner FS.
func seedFile(t *testing.T, inner vfs.FS, path string, old []byte) {
	t.Helper()
	f, err := inner.OpenFile(path, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(old, 0); err != nil {
		t.Fatal(err)
	}
}

func contents(t *testing.T, inner vfs.FS, path string, n int) []byte {
	t.Helper()
	f, err := inner.OpenFile(path, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

func isInjected(err error, kind errorfs.Kind, cause error) bool {
	var e *errorfs.Error
	return errors.Is(err, errorfs.ErrInjected) && errors.Is(err, cause) && errors.As(err, &e) && e.Kind == kind
}

// Each kind, at rate 1, shows through the File API as the disk would show it.
func TestFaultKinds(t *testing.T) {
	const path = "/d/slots"
	old := pattern(fileSize, 1)
	fresh := pattern(3*vfs.Alignment, 100) // an aligned write of 3 units at offset 4096
	for _, direct := range []bool{false, true} {
		for _, c := range []struct {
			name  string
			plan  errorfs.Plan
			kind  errorfs.Kind
			check func(t *testing.T, f vfs.File, inner vfs.FS, buf []byte)
		}{
			{"read-eio", errorfs.Plan{ReadEIO: 1}, errorfs.ReadEIO, func(t *testing.T, f vfs.File, _ vfs.FS, buf []byte) {
				clear(buf)
				n, err := f.ReadAt(buf, vfs.Alignment)
				if n != 0 || !isInjected(err, errorfs.ReadEIO, syscall.EIO) {
					t.Errorf("ReadAt = %d, %v; want 0, injected EIO", n, err)
				}
				if !bytes.Equal(buf, make([]byte, len(buf))) {
					t.Error("a failed read filled the buffer")
				}
			}},
			{"short-read", errorfs.Plan{ShortRead: 1}, errorfs.ShortRead, func(t *testing.T, f vfs.File, _ vfs.FS, buf []byte) {
				n, err := f.ReadAt(buf, vfs.Alignment)
				if n >= len(buf) || n%vfs.Alignment != 0 || !isInjected(err, errorfs.ShortRead, io.EOF) {
					t.Errorf("ReadAt = %d, %v; want a shorter multiple of 4096, injected io.EOF", n, err)
				}
				if !bytes.Equal(buf[:n], old[vfs.Alignment:vfs.Alignment+n]) {
					t.Error("the short prefix is not the file's data")
				}
			}},
			{"bitflip", errorfs.Plan{BitFlip: 1}, errorfs.BitFlip, func(t *testing.T, f vfs.File, _ vfs.FS, buf []byte) {
				n, err := f.ReadAt(buf, vfs.Alignment)
				if n != len(buf) || err != nil {
					t.Fatalf("ReadAt = %d, %v; want a full, successful read", n, err)
				}
				flipped := 0
				for i := range buf {
					flipped += bits.OnesCount8(buf[i] ^ old[vfs.Alignment+i])
				}
				if flipped != 1 {
					t.Errorf("%d bits differ from the file, want 1", flipped)
				}
			}},
			{"write-eio", errorfs.Plan{WriteEIO: 1}, errorfs.WriteEIO, func(t *testing.T, f vfs.File, inner vfs.FS, buf []byte) {
				copy(buf, fresh)
				if n, err := f.WriteAt(buf, vfs.Alignment); n != 0 || !isInjected(err, errorfs.WriteEIO, syscall.EIO) {
					t.Errorf("WriteAt = %d, %v; want 0, injected EIO", n, err)
				}
				if !bytes.Equal(contents(t, inner, path, fileSize), old) {
					t.Error("a failed write changed the file")
				}
				if err := f.Sync(); !isInjected(err, errorfs.WriteEIO, syscall.EIO) {
					t.Errorf("Sync = %v; want injected EIO", err)
				}
			}},
			{"torn-write", errorfs.Plan{TornWrite: 1}, errorfs.TornWrite, func(t *testing.T, f vfs.File, inner vfs.FS, buf []byte) {
				copy(buf, fresh)
				n, err := f.WriteAt(buf, vfs.Alignment)
				if n >= len(buf) || n%vfs.Alignment != 0 || !isInjected(err, errorfs.TornWrite, syscall.EIO) {
					t.Fatalf("WriteAt = %d, %v; want a shorter multiple of 4096, injected EIO", n, err)
				}
				want := bytes.Clone(old)
				copy(want[vfs.Alignment:], fresh[:n])
				if !bytes.Equal(contents(t, inner, path, fileSize), want) {
					t.Errorf("file is not the old data with the %d-byte prefix written", n)
				}
			}},
			{"enospc", errorfs.Plan{ENOSPC: 1}, errorfs.ENOSPC, func(t *testing.T, f vfs.File, inner vfs.FS, buf []byte) {
				copy(buf, fresh)
				if n, err := f.WriteAt(buf, vfs.Alignment); n != 0 || !isInjected(err, errorfs.ENOSPC, syscall.ENOSPC) {
					t.Errorf("WriteAt = %d, %v; want 0, injected ENOSPC", n, err)
				}
				if err := f.Preallocate(2 * fileSize); !isInjected(err, errorfs.ENOSPC, syscall.ENOSPC) {
					t.Errorf("Preallocate = %v; want injected ENOSPC", err)
				}
				if fi, err := inner.Stat(path); err != nil || fi.Size() != fileSize {
					t.Errorf("size after refused preallocation: %v, %v", fi.Size(), err)
				}
				if !bytes.Equal(contents(t, inner, path, fileSize), old) {
					t.Error("a refused write changed the file")
				}
			}},
		} {
			t.Run(fmt.Sprintf("kind=%s/direct=%v", c.name, direct), func(t *testing.T) {
				inner := newMem(t, "/d")
				seedFile(t, inner, path, old)
				var events []errorfs.Event
				fs := newFS(t, inner, errorfs.Options{
					Plan:     c.plan,
					OnInject: func(e errorfs.Event) { events = append(events, e) },
				})
				f, err := fs.OpenFile(path, 0, direct)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				buf, err := vfs.AlignedBuffer(3 * vfs.Alignment)
				if err != nil {
					t.Fatal(err)
				}
				defer vfs.FreeBuffer(buf)
				copy(buf, old[vfs.Alignment:])

				c.check(t, f, inner, buf)

				counts := fs.Counts()
				if counts[c.kind] == 0 {
					t.Errorf("Counts()[%s] = 0", c.kind)
				}
				for k, n := range counts {
					if k != c.kind && n != 0 {
						t.Errorf("Counts()[%s] = %d, want 0", k, n)
					}
				}
				if len(events) != int(counts[c.kind]) {
					t.Errorf("OnInject called %d times, Counts says %d", len(events), counts[c.kind])
				}
				for _, e := range events {
					if e.Kind != c.kind || e.Path != path {
						t.Errorf("event %+v, want kind %s on %s", e, c.kind, path)
					}
				}
			})
		}
	}
}

func TestOpenFilePreallocateFaults(t *testing.T) {
	inner := newMem(t, "/d")
	fs := newFS(t, inner, errorfs.Options{Plan: errorfs.Plan{ENOSPC: 1}})
	if _, err := fs.OpenFile("/d/slots", 1<<20, false); !isInjected(err, errorfs.ENOSPC, syscall.ENOSPC) {
		t.Errorf("OpenFile(size) = %v; want injected ENOSPC", err)
	}
	// Without a size there is nothing to refuse.
	f, err := fs.OpenFile("/d/slots", 0, false)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
}

func TestLatency(t *testing.T) {
	inner := newMem(t, "/d")
	seedFile(t, inner, "/d/slots", pattern(fileSize, 1))
	var delays []time.Duration
	const mean = 2 * time.Millisecond
	fs := newFS(t, inner, errorfs.Options{
		Plan:  errorfs.Plan{Latency: mean, LatencyRate: 0.5, Seed: 1},
		Sleep: func(d time.Duration) { delays = append(delays, d) },
	})
	f, err := fs.OpenFile("/d/slots", 0, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 4096)
	const ops = 400
	for i := range ops {
		if _, err := f.ReadAt(buf, int64(i%16)*4096); err != nil {
			t.Fatalf("a delayed read failed: %v", err)
		}
	}
	if got := fs.Counts()[errorfs.Latency]; got != uint64(len(delays)) {
		t.Errorf("Counts()[latency] = %d, slept %d times", got, len(delays))
	}
	// Rate 0.5 over 400 reads: far outside 100..300 only if the rate is ignored.
	if len(delays) < ops/4 || len(delays) > 3*ops/4 {
		t.Errorf("%d of %d reads delayed at rate 0.5", len(delays), ops)
	}
	var sum time.Duration
	for _, d := range delays {
		if d < 0 || d > 10*mean {
			t.Errorf("delay %v outside [0, 10*mean]", d)
		}
		sum += d
	}
	if avg := sum / time.Duration(len(delays)); avg < mean/2 || avg > 2*mean {
		t.Errorf("average delay %v, want about %v", avg, mean)
	}
}

// trace runs a fixed mixed workload on one file and records what each
// operation returned, in a form that does not depend on the directory. It
// may run on a goroutine of its own, so it reports with t.Error.
func trace(t *testing.T, fs vfs.FS, path string, ops int) []string {
	t.Helper()
	f, err := fs.OpenFile(path, fileSize, false)
	if err != nil {
		t.Error(err)
		return nil
	}
	defer f.Close()
	out := make([]string, 0, ops)
	buf := make([]byte, 2*vfs.Alignment)
	for i := range ops {
		off := int64(i%15) * vfs.Alignment
		var n int
		var err error
		switch i % 4 {
		case 0:
			n, err = f.WriteAt(pattern(len(buf), byte(i)), off)
		case 3:
			err = f.Sync()
		default:
			clear(buf)
			n, err = f.ReadAt(buf, off)
		}
		kind := "ok"
		var e *errorfs.Error
		if errors.As(err, &e) {
			kind = e.Kind.String()
		} else if err != nil {
			t.Errorf("op %d: a real error: %v", i, err)
			return out
		}
		out = append(out, fmt.Sprintf("%d:%s n=%d data=%x", i, kind, n, bytesSum(buf)))
	}
	return out
}

func bytesSum(b []byte) uint32 {
	var s uint32
	for i, c := range b {
		s = s*31 + uint32(c) + uint32(i)
	}
	return s
}

var mixed = errorfs.Plan{ReadEIO: 0.1, WriteEIO: 0.1, ShortRead: 0.1, TornWrite: 0.1, BitFlip: 0.1, ENOSPC: 0.05}

func TestReproducible(t *testing.T) {
	const ops = 300
	run := func(seed uint64, path string) []string {
		p := mixed
		p.Seed = seed
		return trace(t, newFS(t, newMem(t, "/a", "/b"), errorfs.Options{Plan: p}), path, ops)
	}
	base := run(7, "/a/slots")
	faults := 0
	for _, s := range base {
		if !strings.Contains(s, ":ok ") {
			faults++
		}
	}
	if faults < ops/10 {
		t.Fatalf("only %d faults in %d operations: the plan is not applied", faults, ops)
	}
	if again := run(7, "/a/slots"); !slices.Equal(again, base) {
		t.Error("same seed, same file: different faults")
	}
	if other := run(7, "/b/slots"); !slices.Equal(other, base) {
		t.Error("same seed, same file name in another directory: different faults")
	}
	if other := run(8, "/a/slots"); slices.Equal(other, base) {
		t.Error("another seed gave the same faults")
	}
	if other := run(7, "/a/slots2"); slices.Equal(other, base) {
		t.Error("another file name gave the same faults")
	}
}

// Files driven concurrently see the faults they see when driven alone.
func TestReproducibleConcurrent(t *testing.T) {
	const ops, files = 200, 4
	plan := mixed
	plan.Seed = 11
	alone := make([][]string, files)
	for i := range files {
		alone[i] = trace(t, newFS(t, newMem(t, "/d"), errorfs.Options{Plan: plan}), fmt.Sprintf("/d/f%d", i), ops)
	}
	fs := newFS(t, newMem(t, "/d"), errorfs.Options{Plan: plan})
	together := make([][]string, files)
	var wg sync.WaitGroup
	for i := range files {
		wg.Go(func() { together[i] = trace(t, fs, fmt.Sprintf("/d/f%d", i), ops) })
	}
	wg.Wait()
	for i := range files {
		if !slices.Equal(together[i], alone[i]) {
			t.Errorf("file %d: faults differ when other files run concurrently", i)
		}
	}
}

// Kinds are decided independently: raising one rate does not move the
// faults of another kind, and a kind checked after another still fires on
// operations the first one spared.
func TestKindsIndependent(t *testing.T) {
	faults := func(p errorfs.Plan, kind errorfs.Kind) []int {
		var at []int
		for i, s := range trace(t, newFS(t, newMem(t, "/d"), errorfs.Options{Plan: p}), "/d/slots", 400) {
			if strings.Contains(s, ":"+kind.String()+" ") {
				at = append(at, i)
			}
		}
		return at
	}
	alone := faults(errorfs.Plan{ReadEIO: 0.5, Seed: 3}, errorfs.ReadEIO)
	if len(alone) == 0 {
		t.Fatal("no read-eio at rate 0.5")
	}
	all := errorfs.Plan{ReadEIO: 0.5, ShortRead: 0.5, BitFlip: 0.5, TornWrite: 0.5, Latency: time.Nanosecond, LatencyRate: 0.5, Seed: 3}
	if with := faults(all, errorfs.ReadEIO); !slices.Equal(alone, with) {
		t.Errorf("read-eio at %v alone, at %v with other kinds on", alone, with)
	}
	// 200 reads, half spared by read-eio, half of those cut short.
	if short := faults(all, errorfs.ShortRead); len(short) < 20 {
		t.Errorf("%d short reads where about 50 were due: short-read is tied to read-eio", len(short))
	}
}

// sweepWorkload is what a sweep drives: it stops at the first error and
// returns it.
func sweepWorkload(fs vfs.FS) error {
	f, err := fs.OpenFile("/d/slots", fileSize, false)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := pattern(vfs.Alignment, 9)
	for i := range 5 {
		if _, err := f.WriteAt(buf, int64(i)*vfs.Alignment); err != nil {
			return err
		}
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := fs.Rename("/d/slots", "/d/slots.renamed"); err != nil {
		return err
	}
	if err := fs.SyncDir("/d"); err != nil {
		return err
	}
	for i := range 5 {
		if _, err := f.ReadAt(buf, int64(i)*vfs.Alignment); err != nil {
			return err
		}
	}
	return fs.Remove("/d/slots.renamed")
}

func TestFailAtIndexSweep(t *testing.T) {
	clean := newFS(t, newMem(t, "/d"), errorfs.Options{})
	if err := sweepWorkload(clean); err != nil {
		t.Fatal(err)
	}
	total := clean.Ops()
	// open, preallocate, 5 writes, sync, rename, syncdir, 5 reads, remove
	if total != 16 {
		t.Fatalf("workload counted %d operations, want 16", total)
	}
	ops := map[errorfs.Op]bool{}
	for n := int64(0); n <= total; n++ {
		var events []errorfs.Event
		inner := newMem(t, "/d")
		fs := newFS(t, inner, errorfs.Options{OnInject: func(e errorfs.Event) { events = append(events, e) }})
		fs.FailAtIndex(n)
		err := sweepWorkload(fs)
		if n == total {
			if err != nil || len(events) != 0 {
				t.Errorf("index %d is past the workload: %v, %v", n, err, events)
			}
			continue
		}
		if !isInjected(err, errorfs.Index, syscall.EIO) {
			t.Fatalf("index %d: workload returned %v; want injected EIO", n, err)
		}
		if fs.Ops() != n+1 || len(events) != 1 || fs.Counts()[errorfs.Index] != 1 {
			t.Errorf("index %d: failed after %d operations with %d events", n, fs.Ops(), len(events))
		}
		ops[events[0].Op] = true
		if events[0].Op == errorfs.OpRename {
			if _, err := inner.Stat("/d/slots"); err != nil {
				t.Errorf("a failed rename moved the file: %v", err)
			}
		}
	}
	for _, op := range []errorfs.Op{errorfs.OpOpen, errorfs.OpPreallocate, errorfs.OpWrite, errorfs.OpSync, errorfs.OpRename, errorfs.OpSyncDir, errorfs.OpRead, errorfs.OpRemove} {
		if !ops[op] {
			t.Errorf("the sweep never failed a %s", op)
		}
	}
}

func TestMatch(t *testing.T) {
	inner := newMem(t, "/fast", "/slow")
	fs := newFS(t, inner, errorfs.Options{
		Plan:  errorfs.Plan{ReadEIO: 1, WriteEIO: 1},
		Match: func(p string) bool { return filepath.Dir(p) == "/slow" },
	})
	for _, c := range []struct {
		path   string
		faulty bool
	}{{"/fast/slots", false}, {"/slow/slots", true}} {
		f, err := fs.OpenFile(c.path, fileSize, false)
		if err != nil {
			t.Fatal(err)
		}
		_, werr := f.WriteAt(make([]byte, 512), 0)
		_, rerr := f.ReadAt(make([]byte, 512), 0)
		f.Close()
		if got := werr != nil && rerr != nil; got != c.faulty {
			t.Errorf("%s: write %v, read %v; faulty=%v", c.path, werr, rerr, c.faulty)
		}
	}
	if got := fs.Ops(); got != 4 { // open, preallocate, write, read on /slow only
		t.Errorf("Ops() = %d, want 4: unmatched paths must not be counted", got)
	}
}

func TestZeroPlanPassesThrough(t *testing.T) {
	plain := trace(t, newMem(t, "/d"), "/d/slots", 100)
	wrapped := trace(t, newFS(t, newMem(t, "/d"), errorfs.Options{}), "/d/slots", 100)
	if !slices.Equal(plain, wrapped) {
		t.Error("the zero plan changed what operations return")
	}
}

func TestNewRefusesInvalidPlan(t *testing.T) {
	if _, err := errorfs.New(vfs.NewMem(), errorfs.Options{Plan: errorfs.Plan{BitFlip: 2}}); !errors.Is(err, errorfs.ErrSpec) {
		t.Errorf("New with rate 2 = %v; want ErrSpec", err)
	}
}
