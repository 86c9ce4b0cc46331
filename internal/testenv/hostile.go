package testenv

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// A Remote is a client of the daemon in a process of its own, running as
// another user: the hostile peer of the adversarial tests. The test binary
// itself is the helper (RunHelperIfAsked in TestMain); the test drives it
// one Cmd at a time over its stdin and stdout.
type Remote struct {
	t    testing.TB
	cmd  *exec.Cmd
	in   *json.Encoder
	out  *bufio.Scanner
	errs *lockedBuffer
	PID  int
	done chan struct{}
}

// Cred is a user the helper runs as.
type Cred struct {
	UID, GID uint32
	Groups   []uint32
}

// SocketGroup is the group a test daemon's socket is shared with
// (Options.SocketGroup), as --socket-mode 0660 shares it with the daemon
// user's group.
const SocketGroup = 4242

// Nobody is a user with nothing of its own but membership in SocketGroup.
var Nobody = Cred{UID: 65534, GID: 65534, Groups: []uint32{SocketGroup}}

// Cmd is one thing the helper does; Reply is what came of it.
type Cmd struct {
	Op          string // see serveCommands
	Path        string
	Size        int64
	Mode        uint32
	Fingerprint string
	Model       Model
	Reg         uint64
	NS          []uint32
	Hashes      [][]byte
	Blocks      []uint32
	JobID       uint64
	Wait        bool
	N           int // repetitions, or parallel calls
	Bytes       int // size of a raw request
	LeaseMs     uint32
}

// Reply is the outcome of a Cmd.
type Reply struct {
	Code     codes.Code
	Msg      string
	Reg      uint64
	NS       uint32
	OK       bool
	Statuses []pb.BlockStatus // of a waited transfer's failed blocks
	Results  int              // Completions results
	Ready    uint32
	Count    int            // repetitions that succeeded
	Codes    map[string]int // code name -> calls, for parallel calls
	Err      string         // the helper itself failed
}

const helperEnv = "KVOFFLOAD_TESTENV_HELPER"

// RunHelperIfAsked turns the test binary into the helper when the test
// started it as one; call it first in TestMain.
func RunHelperIfAsked() {
	if os.Getenv(helperEnv) != "client" {
		return
	}
	os.Exit(serveCommands(os.Getenv(helperEnv+"_SOCKET"), os.Stdin, os.Stdout))
}

var helperBin struct {
	once sync.Once
	dir  string
	path string
	err  error
}

// helperBinary is the test binary at a path another user may execute (go
// test keeps it in a directory only its user may enter).
func helperBinary() (string, error) {
	h := &helperBin
	h.once.Do(func() {
		exe, err := os.Executable()
		if err != nil {
			h.err = err
			return
		}
		if h.dir, h.err = os.MkdirTemp("", "kvo-helper"); h.err != nil {
			return
		}
		if h.err = os.Chmod(h.dir, 0o755); h.err != nil {
			return
		}
		h.path = filepath.Join(h.dir, "helper")
		if os.Link(exe, h.path) == nil {
			return
		}
		h.err = copyFile(exe, h.path)
	})
	return h.path, h.err
}

// RemoveHelperBinary removes the helper's copy of the test binary; call it
// at the end of TestMain.
func RemoveHelperBinary() {
	if helperBin.dir != "" {
		os.RemoveAll(helperBin.dir)
	}
}

func copyFile(from, to string) error {
	src, err := os.Open(from)
	if err != nil {
		return err
	}
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		return err
	}
	return dst.Close()
}

// NeedRoot skips a test that must run a process as another user.
func NeedRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a client as another uid (CI runs as root)")
	}
}

// StartAs runs a helper as cred, connected to socket. It is killed when the
// test ends.
func StartAs(t testing.TB, socket string, cred Cred) *Remote {
	t.Helper()
	NeedRoot(t)
	bin, err := helperBinary()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), helperEnv+"=client", helperEnv+"_SOCKET="+socket)
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: cred.UID, Gid: cred.GID, Groups: cred.Groups}}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	errs := &lockedBuffer{}
	cmd.Stderr = errs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r := &Remote{t: t, cmd: cmd, in: json.NewEncoder(stdin), out: bufio.NewScanner(stdout), errs: errs, PID: cmd.Process.Pid, done: make(chan struct{})}
	r.out.Buffer(make([]byte, 1<<20), 1<<20)
	go func() { cmd.Wait(); close(r.done) }()
	t.Cleanup(func() {
		r.Kill()
		if t.Failed() {
			t.Logf("helper (uid %d) stderr:\n%s", cred.UID, errs.String())
		}
	})
	return r
}

// Do runs c in the helper and returns its reply; the test fails if the
// helper does not answer. Call it from the test's goroutine.
func (r *Remote) Do(c Cmd) Reply {
	r.t.Helper()
	rep, err := r.TryDo(c)
	if err != nil {
		r.t.Fatal(err)
	}
	return rep
}

// TryDo is Do for any goroutine, and for a helper that may be killed.
func (r *Remote) TryDo(c Cmd) (Reply, error) {
	if err := r.in.Encode(c); err != nil {
		return Reply{}, fmt.Errorf("helper %s: %v\n%s", c.Op, err, r.errs.String())
	}
	if !r.out.Scan() {
		return Reply{}, fmt.Errorf("helper %s: no reply (%v)\n%s", c.Op, r.out.Err(), r.errs.String())
	}
	var rep Reply
	if err := json.Unmarshal(r.out.Bytes(), &rep); err != nil {
		return Reply{}, fmt.Errorf("helper %s: %v", c.Op, err)
	}
	if rep.Err != "" {
		return rep, fmt.Errorf("helper %s: %s", c.Op, rep.Err)
	}
	return rep, nil
}

// Kill kills the helper (its connections drop mid-call) and waits for it.
func (r *Remote) Kill() {
	r.cmd.Process.Kill()
	<-r.done
}

type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// serveCommands is the helper's main loop.
func serveCommands(socket string, in io.Reader, out io.Writer) int {
	h := &helper{socket: socket, regions: map[string]*Region{}}
	dec := json.NewDecoder(in)
	enc := json.NewEncoder(out)
	for {
		var c Cmd
		if err := dec.Decode(&c); err != nil {
			if errors.Is(err, io.EOF) {
				return 0
			}
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		if c.Op == "exit" {
			return 0
		}
		rep := h.do(c)
		if err := enc.Encode(rep); err != nil {
			return 1
		}
	}
}

type helper struct {
	socket  string
	c       *client.Client
	extra   []*client.Client
	stalled []context.CancelFunc
	regions map[string]*Region // mapped by this process, by path
}

func (h *helper) dial() error {
	c, err := client.Dial(h.socket, grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(1<<30)))
	if err != nil {
		return err
	}
	h.c = c
	return nil
}

func replyOf(err error) Reply {
	st, _ := status.FromError(err)
	return Reply{Code: st.Code(), Msg: st.Message()}
}

func (h *helper) do(c Cmd) Reply {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if h.c == nil && c.Op != "mkfile" && c.Op != "truncate" && c.Op != "connections" {
		if err := h.dial(); err != nil {
			return Reply{Err: err.Error()}
		}
	}
	switch c.Op {
	case "dial": // a new connection, the old one closed
		if h.c != nil {
			h.c.Close()
		}
		if err := h.dial(); err != nil {
			return Reply{Err: err.Error()}
		}
		return Reply{}
	case "mkfile":
		f, err := os.OpenFile(c.Path, os.O_RDWR|os.O_CREATE|os.O_EXCL, os.FileMode(c.Mode))
		if err != nil {
			return Reply{Err: err.Error()}
		}
		defer f.Close()
		if err := f.Truncate(c.Size); err != nil {
			return Reply{Err: err.Error()}
		}
		return Reply{}
	case "truncate":
		if err := os.Truncate(c.Path, c.Size); err != nil {
			return Reply{Err: err.Error()}
		}
		return Reply{}
	case "register":
		reg, err := h.c.Register(ctx, []byte(c.Fingerprint), c.Model.Layout(), c.Model.Regions(&Region{Path: c.Path}), "hostile")
		if err != nil {
			return replyOf(err)
		}
		return Reply{Reg: reg.RegistrationId, NS: reg.NamespaceId}
	case "register_many": // N registrations of 1-page files of its own, each unlinked once mapped
		m := Model{Layers: 1, SegBytes: 4096, Blocks: 1}
		var rep Reply
		for i := 0; i < c.N; i++ {
			path := fmt.Sprintf("%s-%d", c.Path, i)
			if err := os.WriteFile(path, make([]byte, 4096), 0o600); err != nil {
				return Reply{Err: err.Error()}
			}
			_, err := h.c.Register(ctx, []byte(c.Fingerprint), m.Layout(), m.Regions(&Region{Path: path}), "flood")
			os.Remove(path)
			if err != nil {
				n := rep.Count
				rep = replyOf(err)
				rep.Count = n
				break
			}
			rep.Count++
		}
		return rep
	case "fill": // map the region and write each hash's bytes into its block
		r, err := h.region(c.Path)
		if err != nil {
			return Reply{Err: err.Error()}
		}
		for i, hash := range c.Hashes {
			c.Model.Fill(r, int(c.Blocks[i]), hash)
		}
		return Reply{}
	case "store", "load":
		job := Job(c.JobID, c.Hashes, c.Blocks)
		call := h.c.Store
		if c.Op == "load" {
			call = h.c.Load
		}
		res, err := call(ctx, c.Reg, []*pb.Job{job}, c.Wait)
		if err != nil {
			return replyOf(err)
		}
		rep := Reply{OK: true}
		if len(res) > 0 {
			rep.OK = res[0].Ok
			for _, f := range res[0].Failures {
				rep.Statuses = append(rep.Statuses, f.Status)
			}
		}
		return rep
	case "completions":
		r, err := h.c.Completions(ctx, c.Reg, 0)
		if err != nil {
			return replyOf(err)
		}
		return Reply{Results: len(r.Results)}
	case "unregister":
		_, err := h.c.API.Unregister(ctx, &pb.UnregisterRequest{RegistrationId: c.Reg})
		return replyOf(err)
	case "lookup":
		r, err := h.c.Lookup(ctx, c.NS, Keys(c.Hashes...), c.LeaseMs)
		if err != nil {
			return replyOf(err)
		}
		return Reply{Ready: r.Ready}
	case "big_lookups": // N Lookups of Bytes bytes of keys at once
		// Encoded once and sent as is: marshaling 16 MB per call is slow
		// under the race detector, and a client's speed is not the test.
		raw, err := proto.Marshal(&pb.LookupRequest{NamespaceIds: c.NS, Keys: &pb.KeyList{Hashes: make([]byte, c.Bytes)}})
		if err != nil {
			return Reply{Err: err.Error()}
		}
		var mu sync.Mutex
		rep := Reply{Codes: map[string]int{}}
		var wg sync.WaitGroup
		for i := 0; i < c.N; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := h.c.Conn().Invoke(ctx, pb.KVOffload_Lookup_FullMethodName, raw, &pb.LookupResponse{}, grpc.ForceCodecV2(rawCodec{}))
				mu.Lock()
				rep.Codes[status.Code(err).String()]++
				mu.Unlock()
			}()
		}
		wg.Wait()
		return rep
	case "stall": // N Lookups whose headers are sent and whose message never is
		for i := 0; i < c.N; i++ {
			sctx, cancel := context.WithCancel(context.Background())
			if _, err := h.c.Conn().NewStream(sctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, pb.KVOffload_Lookup_FullMethodName); err != nil {
				cancel()
				return Reply{Err: err.Error()}
			}
			h.stalled = append(h.stalled, cancel)
		}
		return Reply{}
	case "connections": // N more connections, each checked with a call; kept open
		rep := Reply{Codes: map[string]int{}}
		for i := 0; i < c.N; i++ {
			x, err := client.Dial(h.socket)
			if err != nil {
				return Reply{Err: err.Error()}
			}
			h.extra = append(h.extra, x)
			cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
			_, err = x.Healthy(cctx)
			ccancel()
			rep.Codes[status.Code(err).String()]++
			if err == nil {
				rep.Count++
			}
		}
		return rep
	case "close":
		for _, cancel := range h.stalled {
			cancel()
		}
		h.stalled = nil
		for _, x := range h.extra {
			x.Close()
		}
		h.extra = nil
		if h.c != nil {
			h.c.Close()
			h.c = nil
		}
		return Reply{}
	}
	return Reply{Err: "unknown op " + c.Op}
}

// rawCodec sends requests already encoded and decodes replies as protobuf.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(v.([]byte))}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	return proto.Unmarshal(data.Materialize(), v.(proto.Message))
}

func (rawCodec) Name() string { return "proto" }

func (h *helper) region(path string) (*Region, error) {
	if r, ok := h.regions[path]; ok {
		return r, nil
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	r := &Region{Path: path, Mem: mem}
	h.regions[path] = r
	return r, nil
}
