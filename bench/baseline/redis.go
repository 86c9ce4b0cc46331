package baseline

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// Redis is Redis SET and GET throughput of whole blocks, in GB/s.
type Redis struct {
	SetGBps, GetGBps float64
	Conns, Blocks    int
	Version          string
}

// MeasureRedis starts binary (a redis-server) on 127.0.0.1 at port with no
// persistence, SETs every value under its key (twice: the first pass warms
// Redis's memory up and is not timed) and GETs them all back,
// conns connections in parallel, each one request at a time (the way a
// connector's worker threads would), checks the values read back, and
// stops the server. dir is a private directory for the server's files.
// started, if not nil, is told the server's pid once it runs.
func MeasureRedis(ctx context.Context, binary, dir string, port int, keys, values [][]byte, conns int, started func(pid int)) (Redis, error) {
	res := Redis{Conns: conns, Blocks: len(keys)}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	cmd := exec.Command(binary, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--protected-mode", "yes",
		"--save", "", "--appendonly", "no", "--dir", dir, "--daemonize", "no", "--loglevel", "warning")
	logf, err := os.Create(dir + "/redis.log")
	if err != nil {
		return res, err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return res, fmt.Errorf("start %s: %w", binary, err)
	}
	if started != nil {
		started(cmd.Process.Pid)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() error {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			if err != nil {
				return fmt.Errorf("redis-server exit: %w", err)
			}
			return nil
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-exited
			return errors.New("redis-server did not exit within 30s of SIGTERM; killed")
		}
	}
	res, err = redisRun(ctx, addr, keys, values, conns, exited)
	return res, errors.Join(err, stop())
}

func redisRun(ctx context.Context, addr string, keys, values [][]byte, conns int, exited chan error) (Redis, error) {
	res := Redis{Conns: conns, Blocks: len(keys)}
	cs := make([]*resp, conns)
	defer func() {
		for _, c := range cs {
			if c != nil {
				c.conn.Close()
			}
		}
	}()
	deadline := time.Now().Add(20 * time.Second)
	for i := range cs {
		for {
			c, err := net.DialTimeout("tcp", addr, time.Second)
			if err == nil {
				cs[i] = newResp(c)
				if _, err = cs[i].call(nil, []byte("PING")); err == nil {
					break
				}
				c.Close()
				cs[i] = nil
			}
			select {
			case err := <-exited:
				exited <- err
				return res, fmt.Errorf("redis-server exited at start: %v", err)
			default:
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return res, fmt.Errorf("redis-server on %s not answering: %w", addr, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	info, err := cs[0].call(nil, []byte("INFO"), []byte("server"))
	if err == nil {
		for _, l := range bytes.Split(info, []byte("\r\n")) {
			if v, ok := bytes.CutPrefix(l, []byte("redis_version:")); ok {
				res.Version = string(v)
			}
		}
	}
	var total int
	for _, v := range values {
		total += len(v)
	}
	got := make([][]byte, len(values))
	for i, v := range values {
		got[i] = make([]byte, len(v))
		copy(got[i], v) // fault the pages in before timing
	}
	run := func(get bool) (float64, error) {
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			errs []error
		)
		t0 := time.Now()
		for q, c := range cs {
			wg.Go(func() {
				for i := q; i < len(keys); i += len(cs) {
					var err error
					if get {
						var v []byte
						v, err = c.call(got[i], []byte("GET"), keys[i])
						if err == nil && len(v) != len(values[i]) {
							err = fmt.Errorf("GET returned %d bytes, want %d", len(v), len(values[i]))
						}
					} else {
						_, err = c.call(nil, []byte("SET"), keys[i], values[i])
					}
					if err != nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
						return
					}
				}
			})
		}
		wg.Wait()
		return float64(total) / time.Since(t0).Seconds() / 1e9, errors.Join(errs...)
	}
	// An untimed first pass: a new value costs Redis fresh pages (page
	// faults), which a cache that runs for hours has long since paid for;
	// the timed SETs overwrite, as a full cache recycles memory.
	if _, err = run(false); err != nil {
		return res, fmt.Errorf("redis SET: %w", err)
	}
	if res.SetGBps, err = run(false); err != nil {
		return res, fmt.Errorf("redis SET: %w", err)
	}
	if res.GetGBps, err = run(true); err != nil {
		return res, fmt.Errorf("redis GET: %w", err)
	}
	for i := range values {
		if !bytes.Equal(got[i], values[i]) {
			return res, fmt.Errorf("redis GET of block %d returned other bytes than were SET", i)
		}
	}
	_, err = cs[0].call(nil, []byte("FLUSHALL"))
	return res, err
}

// resp is a minimal RESP2 client: commands as arrays of bulk strings, and
// the replies SET, GET, PING, INFO and FLUSHALL give.
type resp struct {
	conn net.Conn
	r    *bufio.Reader
	w    *bufio.Writer
}

func newResp(c net.Conn) *resp {
	return &resp{conn: c, r: bufio.NewReaderSize(c, 64<<10), w: bufio.NewWriterSize(c, 64<<10)}
}

// call sends a command and reads its reply. A bulk reply is read into dst
// when it fits (so a GET lands in the caller's memory with no extra copy).
func (c *resp) call(dst []byte, args ...[]byte) ([]byte, error) {
	c.conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(c.w, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(c.w, "$%d\r\n", len(a))
		c.w.Write(a)
		c.w.WriteString("\r\n")
	}
	if err := c.w.Flush(); err != nil {
		return nil, err
	}
	line, err := c.r.ReadSlice('\n')
	if err != nil {
		return nil, err
	}
	if len(line) < 3 {
		return nil, fmt.Errorf("redis: short reply %q", line)
	}
	body := string(line[1 : len(line)-2])
	switch line[0] {
	case '+':
		return []byte(body), nil
	case '-':
		return nil, fmt.Errorf("redis: %s", body)
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil || n < -1 || n > 1<<30 {
			return nil, fmt.Errorf("redis: bad bulk length %q", body)
		}
		if n < 0 {
			return nil, errors.New("redis: nil reply")
		}
		buf := dst
		if len(buf) < n {
			buf = make([]byte, n)
		}
		buf = buf[:n]
		if _, err := io.ReadFull(c.r, buf); err != nil {
			return nil, err
		}
		if _, err := c.r.Discard(2); err != nil {
			return nil, err
		}
		return buf, nil
	}
	return nil, fmt.Errorf("redis: unexpected reply %q", line)
}
