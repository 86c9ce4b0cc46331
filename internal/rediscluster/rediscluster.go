// Package rediscluster starts a real Redis Cluster for tests and kvbench:
// three (or more) masters from Debian's redis-server on free loopback
// ports in a private directory, joined by `redis-cli --cluster create`, and
// torn down again. It can kill a master and bring it back, hang one (DEBUG
// SLEEP), and reach each node directly, so tests can break the cluster the
// ways a real one breaks.
//
// The nodes run with cluster-require-full-coverage no (a dead master costs
// only its own slots, as docs/remote.md recommends), no persistence, and
// DEBUG allowed from loopback.
package rediscluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// Options shape a cluster.
type Options struct {
	Masters int // default 3
	// Dir is a private directory for the nodes' files; default a new
	// temporary directory, removed by Close.
	Dir string
	// Password, when set, is every node's requirepass and masterauth.
	Password string
	// TLS serves clients and the cluster bus over TLS only, with a
	// certificate for 127.0.0.1 from a CA made for the cluster
	// (Cluster.CAFile, Cluster.TLSConfig).
	TLS bool
	// MaxMemory, when set, is every node's maxmemory (bytes), with
	// maxmemory-policy allkeys-lru.
	MaxMemory uint64
	// Replicas is the replicas of each master (default none): Replicas()
	// lists them, master by master.
	Replicas int
	// Server and CLI are the binaries; default redis-server and redis-cli
	// from PATH.
	Server, CLI string
	// Log receives progress lines (nil: none).
	Log func(format string, a ...any)
}

// Cluster is a running cluster.
type Cluster struct {
	opt      Options
	tls      *tlsFiles
	dir      string
	ownDir   bool
	nodes    []*Node
	replicas []*Node
	closeMu  sync.Mutex
	closed   bool
}

// Node is one master.
type Node struct {
	Port, BusPort int
	dir           string
	c             *Cluster
	mu            sync.Mutex
	cmd           *exec.Cmd
	exited        chan struct{}
}

// ErrNoRedis means redis-server or redis-cli is not installed.
var ErrNoRedis = errors.New("redis-server and redis-cli are not installed (Debian: apt-get install redis-server)")

// Available reports whether the binaries are on PATH.
func Available() error {
	for _, b := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(b); err != nil {
			return fmt.Errorf("%w: %v", ErrNoRedis, err)
		}
	}
	return nil
}

// Start starts the nodes, creates the cluster and waits until every node
// reports cluster_state:ok with all 16384 slots served. On error nothing is
// left running.
func Start(ctx context.Context, opt Options) (*Cluster, error) {
	if opt.Masters == 0 {
		opt.Masters = 3
	}
	if opt.Masters < 3 {
		return nil, errors.New("redis cluster create needs at least 3 masters")
	}
	if opt.Server == "" {
		opt.Server = "redis-server"
	}
	if opt.CLI == "" {
		opt.CLI = "redis-cli"
	}
	if opt.Log == nil {
		opt.Log = func(string, ...any) {}
	}
	for _, b := range []string{opt.Server, opt.CLI} {
		if _, err := exec.LookPath(b); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrNoRedis, err)
		}
	}
	c := &Cluster{opt: opt, dir: opt.Dir}
	if c.dir == "" {
		d, err := os.MkdirTemp("", "kvo-redis-")
		if err != nil {
			return nil, err
		}
		c.dir, c.ownDir = d, true
	}
	acquireSpawner() // released by Close
	ok := false
	defer func() {
		if !ok {
			c.Close()
		}
	}()
	if opt.TLS {
		f, err := makeTLS(c.dir)
		if err != nil {
			return nil, fmt.Errorf("tls: %w", err)
		}
		c.tls = f
	}
	ports, err := freePorts(2 * opt.Masters)
	if err != nil {
		return nil, err
	}
	for i := 0; i < opt.Masters; i++ {
		n := &Node{Port: ports[2*i], BusPort: ports[2*i+1], dir: filepath.Join(c.dir, fmt.Sprintf("node%d", i)), c: c}
		if err := os.MkdirAll(n.dir, 0o700); err != nil {
			return nil, err
		}
		if err := n.writeConfig(); err != nil {
			return nil, err
		}
		c.nodes = append(c.nodes, n)
	}
	for _, n := range c.nodes {
		if err := n.start(); err != nil {
			return nil, err
		}
	}
	for _, n := range c.nodes {
		if err := n.waitPing(ctx); err != nil {
			return nil, err
		}
	}
	args := []string{"--cluster", "create"}
	args = append(args, c.Addrs()...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if c.tls != nil {
		args = append(args, "--tls", "--cacert", c.tls.CA)
	}
	cmd := exec.CommandContext(ctx, opt.CLI, args...)
	if opt.Password != "" {
		cmd.Env = append(os.Environ(), "REDISCLI_AUTH="+opt.Password)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("redis-cli --cluster create: %w: %s", err, out)
	}
	if err := c.WaitOK(ctx); err != nil {
		return nil, err
	}
	if err := c.addReplicas(ctx); err != nil {
		return nil, err
	}
	opt.Log("redis cluster up: %s in %s", strings.Join(c.Addrs(), ","), c.dir)
	ok = true
	return c, nil
}

// addReplicas starts opt.Replicas replicas of every master, has each meet
// the cluster and replicate its master, and waits until every master has
// its replicas' links up and the cluster is ok again.
func (c *Cluster) addReplicas(ctx context.Context) error {
	r := c.opt.Replicas
	if r <= 0 {
		return nil
	}
	ports, err := freePorts(2 * r * len(c.nodes))
	if err != nil {
		return err
	}
	for i, m := range c.nodes {
		mc := m.Client()
		id, err := mc.Do(ctx, "cluster", "myid").Text()
		mc.Close()
		if err != nil {
			return fmt.Errorf("node %s: CLUSTER MYID: %w", m.Addr(), err)
		}
		for j := 0; j < r; j++ {
			k := 2 * (i*r + j)
			n := &Node{Port: ports[k], BusPort: ports[k+1], dir: filepath.Join(c.dir, fmt.Sprintf("replica%d-%d", i, j)), c: c}
			if err := os.MkdirAll(n.dir, 0o700); err != nil {
				return err
			}
			if err := n.writeConfig(); err != nil {
				return err
			}
			if err := n.start(); err != nil {
				return err
			}
			c.replicas = append(c.replicas, n)
			if err := n.waitPing(ctx); err != nil {
				return err
			}
			nc := n.Client()
			// The bus port is not port+10000 here: named.
			err := nc.Do(ctx, "cluster", "meet", "127.0.0.1", m.Port, m.BusPort).Err()
			if err == nil {
				// Refused ("Unknown node") until the meeting has gossiped
				// the master's id to the replica.
				err = poll(ctx, 60*time.Second, func() error { return nc.Do(ctx, "cluster", "replicate", id).Err() })
			}
			nc.Close()
			if err != nil {
				return fmt.Errorf("replica %s of %s: %w", n.Addr(), m.Addr(), err)
			}
		}
		want := fmt.Sprintf("connected_slaves:%d", r)
		if err := poll(ctx, 60*time.Second, func() error {
			mc := m.Client()
			defer mc.Close()
			info, err := mc.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			if !strings.Contains(info, want) || strings.Contains(info, "state=wait_bgsave") || strings.Contains(info, "state=send_bulk") {
				return fmt.Errorf("node %s: replicas not in sync yet", m.Addr())
			}
			return nil
		}); err != nil {
			return err
		}
	}
	return c.WaitOK(ctx)
}

// Replicas are the replicas Options.Replicas asked for, master by master.
func (c *Cluster) Replicas() []*Node { return c.replicas }

// Addrs are the nodes' host:port, in node order.
func (c *Cluster) Addrs() []string {
	out := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		out[i] = n.Addr()
	}
	return out
}

// Nodes are the masters.
func (c *Cluster) Nodes() []*Node { return c.nodes }

// Node returns master i.
func (c *Cluster) Node(i int) *Node { return c.nodes[i] }

// Addr is the node's host:port.
func (n *Node) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(n.Port)) }

// Client is a plain client of this one node (not cluster-aware), for
// commands a test sends to a node on purpose. Close it after use.
func (n *Node) Client() *redis.Client {
	return redis.NewClient(&redis.Options{Addr: n.Addr(), Password: n.c.opt.Password, TLSConfig: n.c.TLSConfig(), Protocol: 2, DisableIdentity: true,
		DialTimeout: 2 * time.Second, ReadTimeout: 10 * time.Second, MaxRetries: -1, ContextTimeoutEnabled: true, DialerRetries: 1})
}

// ClusterClient is a cluster-aware client for tests to read, write and
// corrupt values from outside the daemon. Close it after use.
func (c *Cluster) ClusterClient() *redis.ClusterClient {
	return redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), Password: c.opt.Password, TLSConfig: c.TLSConfig(), Protocol: 2, DisableIdentity: true,
		DialTimeout: 2 * time.Second, ReadTimeout: 10 * time.Second, ContextTimeoutEnabled: true, DialerRetries: 1})
}

// NodeFor returns the master serving key's hash slot.
func (c *Cluster) NodeFor(ctx context.Context, key string) (*Node, error) {
	cl := c.nodes[0].Client()
	defer cl.Close()
	slot, err := cl.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return nil, err
	}
	slots, err := cl.ClusterSlots(ctx).Result()
	if err != nil {
		return nil, err
	}
	for _, s := range slots {
		if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 {
			for _, n := range c.nodes {
				if n.Addr() == s.Nodes[0].Addr {
					return n, nil
				}
			}
		}
	}
	return nil, fmt.Errorf("no master serves slot %d", slot)
}

// Index is the node's position in the cluster's node list.
func (n *Node) Index() int {
	for i, m := range n.c.nodes {
		if m == n {
			return i
		}
	}
	return -1
}

func (n *Node) writeConfig() error {
	o := n.c.opt
	lines := []string{
		"port " + strconv.Itoa(n.Port),
		"tls-port 0",
		"bind 127.0.0.1",
		"cluster-enabled yes",
		"cluster-port " + strconv.Itoa(n.BusPort),
		"cluster-config-file nodes.conf",
		// Redis's default. A node starved of CPU for seconds (a loaded
		// test machine, a 2 MiB value's page faults) must not be voted
		// failed: the survivors would answer CLUSTERDOWN to everyone.
		"cluster-node-timeout 15000",
		// A dead master costs its own slots only; the others keep serving.
		"cluster-require-full-coverage no",
		"save \"\"",
		"appendonly no",
		"dir " + n.dir,
		"logfile " + filepath.Join(n.dir, "redis.log"),
		"daemonize no",
		"enable-debug-command local",
		"protected-mode no",
	}
	if o.Password != "" {
		lines = append(lines, "requirepass "+o.Password, "masterauth "+o.Password)
	}
	if t := n.c.tls; t != nil {
		lines[0], lines[1] = "port 0", "tls-port "+strconv.Itoa(n.Port)
		lines = append(lines, "tls-cluster yes", "tls-replication yes", "tls-auth-clients no",
			"tls-cert-file "+t.Cert, "tls-key-file "+t.Key, "tls-ca-cert-file "+t.CA)
	}
	if o.MaxMemory > 0 {
		lines = append(lines, "maxmemory "+strconv.FormatUint(o.MaxMemory, 10), "maxmemory-policy allkeys-lru")
	}
	return os.WriteFile(filepath.Join(n.dir, "redis.conf"), []byte(strings.Join(lines, "\n")+"\n"), 0o600)
}

func (n *Node) start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	cmd := exec.Command(n.c.opt.Server, filepath.Join(n.dir, "redis.conf"))
	cmd.Dir = n.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := start(cmd); err != nil {
		return fmt.Errorf("start %s: %w", n.c.opt.Server, err)
	}
	n.cmd = cmd
	n.exited = make(chan struct{})
	exited := n.exited
	go func() {
		cmd.Wait()
		close(exited)
	}()
	return nil
}

func (n *Node) waitPing(ctx context.Context) error {
	cl := n.Client()
	defer cl.Close()
	return poll(ctx, 20*time.Second, func() error {
		select {
		case <-n.exitedChan():
			return fmt.Errorf("redis-server on port %d exited; see %s: %w", n.Port, filepath.Join(n.dir, "redis.log"), errStop)
		default:
		}
		return cl.Ping(ctx).Err()
	})
}

func (n *Node) exitedChan() chan struct{} {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.exited
}

// Kill kills the node with SIGKILL, as a crash would, and waits for it to
// be gone. Its slots are unserved until Restart.
func (n *Node) Kill() {
	n.mu.Lock()
	cmd, exited := n.cmd, n.exited
	n.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Kill()
	<-exited
}

// Restart starts a killed node again on its port with its nodes.conf, so
// it rejoins the cluster as itself (empty: there is no persistence), and
// waits for every node to report the cluster ok again.
func (n *Node) Restart(ctx context.Context) error {
	if err := n.Start(ctx); err != nil {
		return err
	}
	return n.c.WaitOK(ctx)
}

// Start starts a killed node again and waits until it answers, not for
// the cluster (the other nodes may be down too). A running node is left
// alone.
func (n *Node) Start(ctx context.Context) error {
	select {
	case <-n.exitedChan():
	default:
		return nil
	}
	if err := n.start(); err != nil {
		return err
	}
	return n.waitPing(ctx)
}

// Snapshot has the node write what it holds to its directory (SAVE), so
// that the next Restart brings it back: a master that was down and kept
// its data, rather than one that comes back empty. DropSnapshot removes it
// again; call it (t.Cleanup) so later restarts start empty as usual.
func (n *Node) Snapshot(ctx context.Context) error {
	cl := n.Client()
	defer cl.Close()
	return cl.Save(ctx).Err()
}

// DropSnapshot removes the node's snapshot, if any.
func (n *Node) DropSnapshot() error {
	err := os.Remove(filepath.Join(n.dir, "dump.rdb"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// Pause stops the node's process (SIGSTOP) until Resume, as a stalled or
// partitioned host would: it answers nothing, its connections stay open,
// and what was sent to it runs when it resumes (so a test of what a node
// that was down refuses wants Kill, not Pause). It lasts until the test
// resumes it, not for a time that a loaded machine may outrun; resume it
// on cleanup too, and well under cluster-node-timeout (15 s), or the other
// masters vote it failed. It returns once every thread of the process is
// stopped: a stop is not synchronous (on a loaded VM a stopped process
// answered commands for up to 18 ms after the signal).
func (n *Node) Pause() error {
	if err := n.signal(syscall.SIGSTOP); err != nil {
		return err
	}
	n.mu.Lock()
	pid := n.cmd.Process.Pid
	n.mu.Unlock()
	return waitStopped(pid, 10*time.Second)
}

// waitStopped waits until every thread of process pid is stopped (state T
// or t in /proc/pid/task/*/stat).
func waitStopped(pid int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		stopped, err := allStopped(pid)
		if err != nil || stopped {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("rediscluster: process %d not stopped %v after SIGSTOP", pid, timeout)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

func allStopped(pid int) (bool, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return false, err
	}
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, t.Name()))
		if err != nil {
			continue // the thread exited
		}
		// pid (comm) state ...: comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 || i+2 >= len(b) {
			return false, fmt.Errorf("rediscluster: unreadable /proc/%d/task/%s/stat", pid, t.Name())
		}
		if st := b[i+2]; st != 'T' && st != 't' {
			return false, nil
		}
	}
	return true, nil
}

// Resume continues a paused node (SIGCONT); a running node is unaffected.
func (n *Node) Resume() error { return n.signal(syscall.SIGCONT) }

func (n *Node) signal(sig syscall.Signal) error {
	n.mu.Lock()
	cmd := n.cmd
	n.mu.Unlock()
	if cmd == nil {
		return errors.New("rediscluster: node not started")
	}
	return cmd.Process.Signal(sig)
}

// WaitOK waits until every running node reports cluster_state:ok, knows
// every node, and sees all 16384 slots served.
func (c *Cluster) WaitOK(ctx context.Context) error {
	return poll(ctx, 60*time.Second, func() error {
		all := append(append([]*Node(nil), c.nodes...), c.replicas...)
		for _, n := range all {
			cl := n.Client()
			info, err := cl.ClusterInfo(ctx).Result()
			cl.Close()
			if err != nil {
				return fmt.Errorf("node %s: %w", n.Addr(), err)
			}
			for _, want := range []string{"cluster_state:ok", "cluster_slots_ok:16384", fmt.Sprintf("cluster_known_nodes:%d", len(all))} {
				if !strings.Contains(info, want) {
					return fmt.Errorf("node %s: no %s yet", n.Addr(), want)
				}
			}
		}
		return nil
	})
}

// ConfigSet runs CONFIG SET on every node.
func (c *Cluster) ConfigSet(ctx context.Context, param, value string) error {
	for _, n := range c.nodes {
		cl := n.Client()
		err := cl.ConfigSet(ctx, param, value).Err()
		cl.Close()
		if err != nil {
			return fmt.Errorf("node %s: CONFIG SET %s %s: %w", n.Addr(), param, value, err)
		}
	}
	return nil
}

// FlushAll empties every node.
func (c *Cluster) FlushAll(ctx context.Context) error {
	for _, n := range c.nodes {
		cl := n.Client()
		err := cl.FlushAll(ctx).Err()
		cl.Close()
		if err != nil {
			return fmt.Errorf("node %s: FLUSHALL: %w", n.Addr(), err)
		}
	}
	return nil
}

// Close stops every node (SIGTERM, then SIGKILL after 10 s) and removes
// the directory Start made. It may be called more than once.
func (c *Cluster) Close() error {
	c.closeMu.Lock()
	defer c.closeMu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	defer releaseSpawner()
	for _, n := range append(append([]*Node(nil), c.nodes...), c.replicas...) {
		n.mu.Lock()
		cmd, exited := n.cmd, n.exited
		n.mu.Unlock()
		if cmd == nil {
			continue
		}
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
	}
	if c.ownDir {
		return os.RemoveAll(c.dir)
	}
	return nil
}

var errStop = errors.New("stop polling")

// poll calls f until it succeeds, fails with errStop, ctx ends or limit
// passes; it returns f's last error.
func poll(ctx context.Context, limit time.Duration, f func() error) error {
	deadline := time.Now().Add(limit)
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		err := f()
		if err == nil || errors.Is(err, errStop) {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after %s: %w", limit, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-t.C:
		}
	}
}

// freePorts returns n distinct loopback ports that were free a moment ago.
// Another process may take one before redis-server binds it; Start then
// fails and the caller may try again.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var out []int
	for len(out) < n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	return out, nil
}

// MoveSlot reshards one hash slot to master to, as `redis-cli --cluster
// reshard` does: the target imports it, the source migrates it, its keys
// go over with MIGRATE (a page of 100 at a time; between pages some of
// them are on each master), then every master is told the slot's new
// owner. It returns once every master agrees. Clients that still route by
// the old map get MOVED (or ASK mid-move) and follow.
func (c *Cluster) MoveSlot(ctx context.Context, slot int, to *Node) error {
	return c.MoveSlotPaged(ctx, slot, to, nil)
}

// MoveSlotPaged is MoveSlot calling between(page) after each page of keys
// has moved (nil: nothing), so a test can act while the slot's keys are
// split between the two masters.
func (c *Cluster) MoveSlotPaged(ctx context.Context, slot int, to *Node, between func(page int)) error {
	from, err := c.slotOwner(ctx, slot)
	if err != nil {
		return err
	}
	if from == to {
		return nil
	}
	ids := map[*Node]string{}
	for _, n := range []*Node{from, to} {
		cl := n.Client()
		id, err := cl.Do(ctx, "cluster", "myid").Text()
		cl.Close()
		if err != nil {
			return fmt.Errorf("node %s: CLUSTER MYID: %w", n.Addr(), err)
		}
		ids[n] = id
	}
	src, dst := from.Client(), to.Client()
	defer src.Close()
	defer dst.Close()
	if err := dst.Do(ctx, "cluster", "setslot", slot, "importing", ids[from]).Err(); err != nil {
		return fmt.Errorf("node %s: SETSLOT IMPORTING: %w", to.Addr(), err)
	}
	if err := src.Do(ctx, "cluster", "setslot", slot, "migrating", ids[to]).Err(); err != nil {
		return fmt.Errorf("node %s: SETSLOT MIGRATING: %w", from.Addr(), err)
	}
	for page := 0; ; page++ {
		keys, err := src.ClusterGetKeysInSlot(ctx, slot, 100).Result()
		if err != nil {
			return fmt.Errorf("node %s: GETKEYSINSLOT: %w", from.Addr(), err)
		}
		if len(keys) == 0 {
			break
		}
		if err := c.migrate(ctx, from, to, keys); err != nil {
			return err
		}
		if between != nil {
			between(page)
		}
	}
	m := &Migration{c: c, slots: map[int]*slotMove{slot: {from: from, to: to, fromID: ids[from], toID: ids[to]}}}
	return m.give(ctx)
}

// Migration is a resharding under way, as `redis-cli --cluster reshard`
// leaves it between its steps: each of its slots importing on its new
// master and migrating on its old one. The old master answers for the
// keys it still holds and redirects (ASK) the others; Migrate moves keys
// over, Finish moves the rest and gives every slot to its new master.
type Migration struct {
	c     *Cluster
	slots map[int]*slotMove
}

type slotMove struct {
	from, to     *Node
	fromID, toID string
}

// StartMigration marks each slot importing on to(its owner) and migrating
// on its owner; a slot whose new master is its owner is left alone.
func (c *Cluster) StartMigration(ctx context.Context, slots []int, to func(from *Node) *Node) (*Migration, error) {
	ids := map[*Node]string{}
	for _, n := range c.nodes {
		cl := n.Client()
		id, err := cl.Do(ctx, "cluster", "myid").Text()
		cl.Close()
		if err != nil {
			return nil, fmt.Errorf("node %s: CLUSTER MYID: %w", n.Addr(), err)
		}
		ids[n] = id
	}
	m := &Migration{c: c, slots: map[int]*slotMove{}}
	for _, slot := range slots {
		if m.slots[slot] != nil {
			continue
		}
		from, err := c.slotOwner(ctx, slot)
		if err != nil {
			return nil, err
		}
		dst := to(from)
		if dst == from {
			continue
		}
		if err := dst.do(ctx, "cluster", "setslot", slot, "importing", ids[from]); err != nil {
			return nil, fmt.Errorf("SETSLOT IMPORTING: %w", err)
		}
		if err := from.do(ctx, "cluster", "setslot", slot, "migrating", ids[dst]); err != nil {
			return nil, fmt.Errorf("SETSLOT MIGRATING: %w", err)
		}
		m.slots[slot] = &slotMove{from: from, to: dst, fromID: ids[from], toID: ids[dst]}
	}
	return m, nil
}

// To is the new master of slot (nil: not migrating).
func (m *Migration) To(slot int) *Node {
	if sm := m.slots[slot]; sm != nil {
		return sm.to
	}
	return nil
}

// Migrate moves keys (each of a slot of m, on its old master) to their
// slot's new master.
func (m *Migration) Migrate(ctx context.Context, keys ...string) error {
	for _, k := range keys {
		slot, err := m.c.KeySlot(ctx, k)
		if err != nil {
			return err
		}
		sm := m.slots[slot]
		if sm == nil {
			return fmt.Errorf("key %s: slot %d is not migrating", k, slot)
		}
		if err := m.c.migrate(ctx, sm.from, sm.to, []string{k}); err != nil {
			return err
		}
	}
	return nil
}

// Finish moves every key left and gives each slot to its new master on
// every node; it returns once every master agrees.
func (m *Migration) Finish(ctx context.Context) error {
	for slot, sm := range m.slots {
		src := sm.from.Client()
		for {
			keys, err := src.ClusterGetKeysInSlot(ctx, slot, 100).Result()
			if err != nil {
				src.Close()
				return fmt.Errorf("node %s: GETKEYSINSLOT: %w", sm.from.Addr(), err)
			}
			if len(keys) == 0 {
				break
			}
			if err := m.c.migrate(ctx, sm.from, sm.to, keys); err != nil {
				src.Close()
				return err
			}
		}
		src.Close()
	}
	return m.give(ctx)
}

// give hands each slot of m, its keys moved, to its new master on every
// node, and returns once every master agrees.
//
// A node told CLUSTER SETSLOT NODE changes its own slot table and nothing
// else: only the new master, importing the slot, bumps its config epoch,
// and only if it is not already the greatest it knows of. Gossip then
// settles a conflicting claim by config epoch, the higher winning. So if
// the old master's epoch is the higher (say it was the new master of a
// slot moved just before), a ping it sent while it still owned the slot,
// or an UPDATE about it from a node not yet told, gives the slot back to
// it on whichever node reads that last, and as the old master no longer
// claims the slot nothing ever corrects it: one node keeps redirecting to
// the other (redis/redis#3776). Hence, before any node is told, the new
// master's config epoch is made greater than the old master's as every
// master sees them (CLUSTER BUMPEPOCH on the new master, then waiting for
// gossip); a stale claim of the old master then loses everywhere. The
// slots go by pair of masters, so that a pair waits on gossip once.
func (m *Migration) give(ctx context.Context) error {
	var order []int
	for slot := range m.slots {
		order = append(order, slot)
	}
	key := func(slot int) []int {
		sm := m.slots[slot]
		return []int{sm.from.Index(), sm.to.Index(), slot}
	}
	slices.SortFunc(order, func(a, b int) int { return slices.Compare(key(a), key(b)) })
	for _, slot := range order {
		sm := m.slots[slot]
		if err := m.c.outrank(ctx, sm); err != nil {
			return fmt.Errorf("slot %d: %w", slot, err)
		}
		for _, n := range append([]*Node{sm.to, sm.from}, m.c.nodes...) {
			if err := n.do(ctx, "cluster", "setslot", slot, "node", sm.toID); err != nil {
				return fmt.Errorf("SETSLOT NODE: %w", err)
			}
		}
	}
	return poll(ctx, 30*time.Second, func() error {
		for slot, sm := range m.slots {
			for _, n := range m.c.nodes {
				owner, err := n.slotOwnerSeen(ctx, slot)
				if err != nil {
					return err
				}
				if owner != sm.to.Addr() {
					return fmt.Errorf("node %s still sees slot %d on %s", n.Addr(), slot, owner)
				}
			}
		}
		return nil
	})
}

// outrank returns once every master sees sm.to's config epoch above
// sm.from's, bumping sm.to's while it does not see it so itself.
func (c *Cluster) outrank(ctx context.Context, sm *slotMove) error {
	return poll(ctx, 30*time.Second, func() error {
		for _, n := range append([]*Node{sm.to}, c.nodes...) {
			e, err := n.configEpochs(ctx)
			if err != nil {
				return err
			}
			if e[sm.toID] > e[sm.fromID] {
				continue
			}
			if n == sm.to {
				// STILL where to's epoch equals the greatest it knows of
				// (from's too, a collision that gossip resolves).
				if err := n.do(ctx, "cluster", "bumpepoch"); err != nil {
					return err
				}
			}
			return fmt.Errorf("node %s sees config epoch %d on the new master %s, %d on the old one %s",
				n.Addr(), e[sm.toID], sm.to.Addr(), e[sm.fromID], sm.from.Addr())
		}
		return nil
	})
}

// configEpochs is the config epoch of every node n knows, by node ID
// (CLUSTER NODES).
func (n *Node) configEpochs(ctx context.Context) (map[string]int64, error) {
	cl := n.Client()
	defer cl.Close()
	s, err := cl.ClusterNodes(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("node %s: CLUSTER NODES: %w", n.Addr(), err)
	}
	out := map[string]int64{}
	for _, line := range strings.Split(s, "\n") {
		f := strings.Fields(line)
		if len(f) < 8 {
			continue
		}
		e, err := strconv.ParseInt(f[6], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("node %s: CLUSTER NODES: config epoch %q: %w", n.Addr(), f[6], err)
		}
		out[f[0]] = e
	}
	return out, nil
}

// migrate moves keys from one master to another (MIGRATE ... KEYS).
func (c *Cluster) migrate(ctx context.Context, from, to *Node, keys []string) error {
	args := []any{"migrate", "127.0.0.1", to.Port, "", 0, 10000}
	if c.opt.Password != "" {
		args = append(args, "auth", c.opt.Password)
	}
	args = append(args, "keys")
	for _, k := range keys {
		args = append(args, k)
	}
	if err := from.do(ctx, args...); err != nil {
		return fmt.Errorf("MIGRATE: %w", err)
	}
	return nil
}

// do runs one command on n.
func (n *Node) do(ctx context.Context, args ...any) error {
	cl := n.Client()
	defer cl.Close()
	if err := cl.Do(ctx, args...).Err(); err != nil {
		return fmt.Errorf("node %s: %w", n.Addr(), err)
	}
	return nil
}

// KeySlot is the hash slot of key.
func (c *Cluster) KeySlot(ctx context.Context, key string) (int, error) {
	cl := c.nodes[0].Client()
	defer cl.Close()
	s, err := cl.ClusterKeySlot(ctx, key).Result()
	return int(s), err
}

func (c *Cluster) slotOwner(ctx context.Context, slot int) (*Node, error) {
	addr, err := c.nodes[0].slotOwnerSeen(ctx, slot)
	if err != nil {
		return nil, err
	}
	for _, n := range c.nodes {
		if n.Addr() == addr {
			return n, nil
		}
	}
	return nil, fmt.Errorf("slot %d is served by %s, not a node of this cluster", slot, addr)
}

// slotOwnerSeen is the master node n says serves slot.
func (n *Node) slotOwnerSeen(ctx context.Context, slot int) (string, error) {
	cl := n.Client()
	defer cl.Close()
	slots, err := cl.ClusterSlots(ctx).Result()
	if err != nil {
		return "", fmt.Errorf("node %s: CLUSTER SLOTS: %w", n.Addr(), err)
	}
	for _, s := range slots {
		if s.Start <= slot && slot <= s.End && len(s.Nodes) > 0 {
			return s.Nodes[0].Addr, nil
		}
	}
	return "", fmt.Errorf("node %s: no master serves slot %d", n.Addr(), slot)
}
