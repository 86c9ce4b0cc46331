package remote

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// RedisConfig reaches a Redis Cluster (or Valkey, which speaks the same
// protocol).
type RedisConfig struct {
	// Addrs are seed nodes, host:port; the client learns the rest of the
	// cluster from them and follows it as it changes.
	Addrs    []string
	Password string
	// TLS, when set, is used for every connection.
	TLS *tls.Config
	// Timeout bounds one operation on one node: dial, write, read. The
	// caller's context bounds a whole batch.
	Timeout time.Duration
	// PoolSize is the connections kept per node (0: 16): a batch holds
	// one per node it touches for its round trip, and Lookups, loads and
	// publishes run side by side.
	PoolSize int
	// WaitReplicas, when positive, makes each generation record write
	// (SetGens) wait until that many replicas of its master acknowledged
	// it (WAIT, on the write's own connection, within the call's
	// deadline): fewer is a failed write (ErrReplicas), tried again like
	// one that timed out. Without it a master that dies before
	// replicating a record leaves its promoted replica with the old one.
	WaitReplicas int
}

// Redis is a Store on Redis Cluster through go-redis's cluster client. A
// batch is one pipeline: the client splits it by hash slot and sends each
// node its commands in one write, all nodes in parallel, then reads the
// replies, so a batch costs one round trip to the slowest node it touches.
// A node that just timed out or refused is left out of the next batches
// for a while (breaker.go): its keys are unavailable at once.
type Redis struct {
	cc           *redis.ClusterClient
	br           *breaker
	waitReplicas int

	// nodes are clients of single masters, by address, for the record
	// writes a resharding redirects (node); nodeOpt is their template.
	nodeOpt *redis.Options
	nodesMu sync.Mutex
	nodes   map[string]*redis.Client
	closed  bool
}

var _ Store = (*Redis)(nil)

// ErrNodeBackoff is wrapped (with ErrUnavailable) for a key whose node
// failed moments ago and is not asked again until its back-off ends.
var ErrNodeBackoff = errors.New("node failed recently; not asked until its back-off ends")

// NewRedis returns a client; it does not connect until the first call, so a
// cluster that is down at start is not an error here (Ping tells).
func NewRedis(cfg RedisConfig) (*Redis, error) {
	if len(cfg.Addrs) == 0 {
		return nil, errors.New("no seed nodes")
	}
	if cfg.Timeout <= 0 {
		return nil, errors.New("timeout must be positive")
	}
	if cfg.PoolSize == 0 {
		cfg.PoolSize = 16
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:     cfg.Addrs,
		Password:  cfg.Password,
		TLSConfig: cfg.TLS,
		// RESP2: values come back as plain bulk strings and no push
		// notifications are negotiated.
		Protocol:                 2,
		DisableIdentity:          true,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
		DialTimeout:              cfg.Timeout,
		ReadTimeout:              cfg.Timeout,
		WriteTimeout:             cfg.Timeout,
		// The caller's deadline also bounds every read and write: a
		// node hung mid-reply costs the deadline, not the socket timeout
		// times the retries.
		ContextTimeoutEnabled: true,
		// One dial attempt per call: a node that refuses is unavailable
		// for this batch; the next batch dials again.
		DialerRetries: 1,
		// One attempt per batch. go-redis retries a pipeline's failed
		// commands after a backoff, and when the deadline has passed by
		// then it marks every command of the batch failed, the ones
		// other nodes had answered too (v9.23, processPipeline): one
		// slow node would cost the whole batch. A key moved by a
		// resharding or failover (MOVED, ASK) is unavailable for the
		// batch that meets it (a reader refuses what it could not
		// check); the client reloads the slot map and the next batch
		// finds it. An invalidation's record writes are the exception:
		// SetGens follows their redirects itself.
		MaxRedirects: -1,
		MaxRetries:   -1,
		PoolSize:     cfg.PoolSize,
		PoolTimeout:  cfg.Timeout,
		// Blocks are large: reads of a 2 MiB value bypass the buffer
		// once it is empty, so a bigger one would only add a copy.
		ReadBufferSize:  64 << 10,
		WriteBufferSize: 64 << 10,
	})
	nodeOpt := &redis.Options{
		Password: cfg.Password, TLSConfig: cfg.TLS, Protocol: 2, DisableIdentity: true,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
		DialTimeout:              cfg.Timeout, ReadTimeout: cfg.Timeout, WriteTimeout: cfg.Timeout,
		ContextTimeoutEnabled: true, DialerRetries: 1, MaxRetries: -1,
		PoolSize: cfg.PoolSize, PoolTimeout: cfg.Timeout,
	}
	return &Redis{cc: cc, br: newBreaker(), waitReplicas: cfg.WaitReplicas, nodeOpt: nodeOpt, nodes: map[string]*redis.Client{}}, nil
}

// route finds the master of each key from the client's slot map, and
// whether that node is in its back-off. A key it cannot place (no slot map
// yet, the cluster down) gets "": it goes into the pipeline, which fails
// or succeeds on its own.
func (r *Redis) route(ctx context.Context, keys []string) (addrs []string, skip []bool) {
	addrs = make([]string, len(keys))
	skip = make([]bool, len(keys))
	if r.br.open(anyNode) {
		// No node answered moments ago, not even for the slot map.
		for i := range keys {
			addrs[i], skip[i] = anyNode, true
		}
		return addrs, skip
	}
	for i, k := range keys {
		c, err := r.cc.MasterForKey(ctx, k)
		if err != nil {
			break // no slot map: placing the others would only retry
		}
		addrs[i] = c.Options().Addr
		skip[i] = r.br.open(addrs[i])
	}
	return addrs, skip
}

// anyNode stands in the breaker for the whole cluster when the client
// could not even learn which node serves a key (every seed unreachable):
// a network that drops packets must not cost every batch the timeout.
const anyNode = "cluster"

// settle trips the breaker of every node that timed out or refused, and
// resets it for every node that answered.
func (r *Redis) settle(addrs []string, skip []bool, errs func(i int) error) {
	failed := map[string]bool{}
	answered := map[string]bool{}
	for i, a := range addrs {
		if skip[i] {
			continue
		}
		if a == "" {
			a = anyNode // unplaced: what happened says something of the cluster
		}
		err := errs(i)
		switch k := ErrorKind(err); {
		case err == nil:
			answered[a] = true
		case k == "timeout" || k == "connection":
			failed[a] = true
		}
	}
	for a := range failed {
		r.br.trip(a)
	}
	for a := range answered {
		if !failed[a] {
			r.br.reset(a)
		}
	}
	if len(answered) > 0 {
		r.br.reset(anyNode)
	}
}

func backoffErr(addr string) error {
	return fmt.Errorf("%w: %s: %w", ErrUnavailable, addr, ErrNodeBackoff)
}

// genText is how a generation is kept in the store: 16 hex digits.
func genText(g Gen) string { return fmt.Sprintf("%016x", uint64(g)) }

// readGen parses a generation record's GET: absent is 0; a record that is
// not one of ours reads as a generation no value carries.
func readGen(c *redis.StringCmd) (Gen, error) {
	v, err := c.Result()
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	g, perr := strconv.ParseUint(v, 16, 64)
	if perr != nil || len(v) != 16 {
		return 0, nil
	}
	return Gen(g), nil
}

// Get implements Store. Each key costs, in its node's pipeline and in this
// order: SET of its generation records NX (CreateGen), STRLEN (absent is
// 0), GETRANGE of the header, and with a body GETRANGE of the payload and
// GETRANGE of the header again, then GET of the block's and of the
// namespace's generation records. The ranges are read by go-redis
// straight into the caller's buffers (ZeroCopyStringCmd): past the reply's
// first read-buffer's worth, the socket's bytes land in Body with no copy
// in user space. The records are read last, on the same node (hash tag)
// and connection: if they still say the generations the value is stamped
// with, no invalidation of the key or namespace had reached the node when
// the value was read. A header that differs between its two reads means
// another write came in between: Torn.
func (r *Redis) Get(ctx context.Context, fs []Fetch) error {
	type cmds struct {
		size              *redis.IntCmd
		head, body, again *redis.ZeroCopyStringCmd
		gen, nsGen        *redis.StringCmd
		again2            []byte
	}
	keys := make([]string, len(fs))
	for i := range fs {
		keys[i] = fs[i].Key
	}
	addrs, skip := r.route(ctx, keys)
	cs := make([]cmds, len(fs))
	_, err := r.cc.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range fs {
			if skip[i] {
				continue
			}
			f := &fs[i]
			c := &cs[i]
			gk, nk := GenKey(f.Key), NamespaceGenKeyOf(f.Key)
			if f.CreateGen {
				p.SetNX(ctx, gk, genText(NewGen()), 0)
				p.SetNX(ctx, nk, genText(NewGen()), 0)
			}
			c.size = p.StrLen(ctx, f.Key)
			if len(f.Head) > 0 {
				c.head = redis.NewZeroCopyStringCmd(ctx, f.Head, "getrange", f.Key, 0, len(f.Head)-1)
				p.Process(ctx, c.head)
			}
			if len(f.Body) > 0 {
				c.body = redis.NewZeroCopyStringCmd(ctx, f.Body, "getrange", f.Key, len(f.Head), len(f.Head)+len(f.Body)-1)
				p.Process(ctx, c.body)
				if len(f.Head) > 0 {
					c.again2 = make([]byte, len(f.Head))
					c.again = redis.NewZeroCopyStringCmd(ctx, c.again2, "getrange", f.Key, 0, len(f.Head)-1)
					p.Process(ctx, c.again)
				}
			}
			c.gen = p.Get(ctx, gk)
			c.nsGen = p.Get(ctx, nk)
		}
		return nil
	})
	var first error
	for i := range fs {
		f, c := &fs[i], &cs[i]
		f.Size, f.HeadN, f.BodyN, f.Gen, f.NSGen, f.Torn, f.Err = 0, 0, 0, 0, 0, false, nil
		if skip[i] {
			f.Err = backoffErr(addrs[i])
			first = cmp(first, f.Err)
			continue
		}
		size, err := c.size.Result()
		if err == nil && c.head != nil {
			f.HeadN, err = c.head.Result()
		}
		if err == nil && c.body != nil {
			f.BodyN, err = c.body.Result()
		}
		againN := 0
		if err == nil && c.again != nil {
			againN, err = c.again.Result()
		}
		var g, ng Gen
		if err == nil {
			g, err = readGen(c.gen)
		}
		if err == nil {
			ng, err = readGen(c.nsGen)
		}
		if err != nil {
			f.Err = unavailable(err)
			first = cmp(first, err)
			continue
		}
		f.Size, f.Gen, f.NSGen = size, g, ng
		if c.again != nil && (againN != f.HeadN || !bytes.Equal(c.again2[:againN], f.Head[:f.HeadN])) {
			f.Torn = true
		}
	}
	r.settle(addrs, skip, func(i int) error {
		if skip[i] {
			return nil
		}
		return fs[i].Err
	})
	return unavailable(cmp(first, pipelineErr(err)))
}

// Set implements Store: SET NX, after an UNLINK for an item to Replace.
func (r *Redis) Set(ctx context.Context, items []Item) []error {
	keys := make([]string, len(items))
	for i := range items {
		keys[i] = items[i].Key
	}
	addrs, skip := r.route(ctx, keys)
	cmds := make([]*redis.BoolCmd, len(items))
	r.cc.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, it := range items {
			if !skip[i] {
				if it.Replace {
					p.Unlink(ctx, it.Key)
				}
				cmds[i] = p.SetNX(ctx, it.Key, it.Value, 0)
			}
		}
		return nil
	})
	errs := make([]error, len(items))
	for i, c := range cmds {
		items[i].Kept = false
		if skip[i] {
			errs[i] = backoffErr(addrs[i])
			continue
		}
		set, err := c.Result()
		if err != nil {
			errs[i] = unavailable(err)
			continue
		}
		items[i].Kept = !set
	}
	r.settle(addrs, skip, func(i int) error { return errs[i] })
	return errs
}

// SetGens implements Store: SET of each record, then UNLINK of the value
// it makes stale, on the record's node (hash tag) in that order; with
// WaitReplicas, then WAIT on the same connection (writeRecords). A record
// whose slot is being resharded is followed where the cluster sends it,
// within the call (followRedirects): a write that meets a resharding is
// written, not failed.
func (r *Redis) SetGens(ctx context.Context, gs []GenWrite) []error {
	keys := make([]string, len(gs))
	for i := range gs {
		keys[i] = gs[i].Key
	}
	addrs, skip := r.route(ctx, keys)
	errs := make([]error, len(gs))
	// What the cluster said of each record's SET and UNLINK: written,
	// failed, or redirected.
	set, unlink := make([]error, len(gs)), make([]error, len(gs))
	if r.waitReplicas > 0 {
		byNode := map[string][]int{}
		for i := range gs {
			if !skip[i] {
				byNode[addrs[i]] = append(byNode[addrs[i]], i)
			}
		}
		var wg sync.WaitGroup
		for _, idx := range byNode {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c, err := r.cc.MasterForKey(ctx, gs[idx[0]].Key)
				if err != nil {
					for _, i := range idx {
						set[i] = err
					}
					return
				}
				ops := make([]recordOp, len(idx))
				for j, i := range idx {
					ops[j] = recordOp{i: i, set: true, unlink: gs[i].Unlink != ""}
				}
				r.writeRecords(ctx, c, gs, ops, set, unlink)
			}()
		}
		wg.Wait()
	} else {
		setCmds := make([]*redis.StatusCmd, len(gs))
		unlinkCmds := make([]*redis.IntCmd, len(gs))
		r.cc.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, g := range gs {
				if !skip[i] {
					setCmds[i] = p.Set(ctx, g.Key, genText(g.Gen), 0)
					if g.Unlink != "" {
						unlinkCmds[i] = p.Unlink(ctx, g.Unlink)
					}
				}
			}
			return nil
		})
		for i := range gs {
			if !skip[i] {
				set[i] = setCmds[i].Err()
				if unlinkCmds[i] != nil {
					unlink[i] = unlinkCmds[i].Err()
				}
			}
		}
	}
	for i := range gs {
		if skip[i] {
			errs[i] = backoffErr(addrs[i])
		} else if set[i] != nil {
			errs[i] = unavailable(set[i])
		}
	}
	r.settle(addrs, skip, func(i int) error { return errs[i] })
	r.followRedirects(ctx, gs, set, unlink, errs)
	return errs
}

// maxRedirects bounds the redirects one record write follows within a
// SetGens: a slot can move on while it is followed (ASK to a master that
// has since taken the slot answers it; a second resharding of it may
// redirect again).
const maxRedirects = 3

// recordOp is what writeRecords sends for record i: its SET, its value's
// UNLINK, each after ASKING when the cluster said ASK.
type recordOp struct {
	i           int
	set, unlink bool
	ask         bool
}

// followRedirects writes again the records (and the UNLINKs of their
// values) the cluster redirected: MOVED, to the slot's new master (the
// slot map reloads behind it); ASK (the slot is migrating and the key is
// not, or no longer, on its old master), ASKING then the write on the
// importing master, which takes it while the slot moves. A reader never
// needs to follow: the old master answers ASK for a record it no longer
// holds, never an absent one, so a reader refuses what it cannot check.
// set and unlink hold what the cluster said of each write; errs gets each
// record's outcome. An UNLINK is garbage collection only (the record makes
// the value stale); its failure is not the record's.
func (r *Redis) followRedirects(ctx context.Context, gs []GenWrite, set, unlink, errs []error) {
	for round := 0; round < maxRedirects; round++ {
		byAddr := map[string][]recordOp{}
		moved := false
		for i := range gs {
			op := recordOp{i: i}
			var to string
			if addr, ask, ok := redirectOf(set[i]); ok {
				op.set, op.unlink, op.ask, to = true, gs[i].Unlink != "", ask, addr
				moved = moved || !ask
			} else if addr, ask, ok := redirectOf(unlink[i]); ok && set[i] == nil {
				op.unlink, op.ask, to = true, ask, addr
			} else {
				continue
			}
			byAddr[to] = append(byAddr[to], op)
		}
		if len(byAddr) == 0 {
			return
		}
		if moved {
			r.cc.ReloadState(ctx) // in the background; the writes below need no map
		}
		var wg sync.WaitGroup
		for addr, ops := range byAddr {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c, err := r.node(addr)
				if err != nil {
					for _, op := range ops {
						if op.set {
							set[op.i] = err
						} else {
							unlink[op.i] = err
						}
					}
					return
				}
				r.writeRecords(ctx, c, gs, ops, set, unlink)
			}()
		}
		wg.Wait()
		var addrs []string
		var res []error
		for addr, ops := range byAddr {
			for _, op := range ops {
				if op.set {
					errs[op.i] = unavailable(set[op.i])
					addrs, res = append(addrs, addr), append(res, errs[op.i])
				}
			}
		}
		r.settle(addrs, make([]bool, len(addrs)), func(i int) error { return res[i] })
	}
}

// redirectOf reads a MOVED or ASK reply: the node it names and whether it
// is ASK.
func redirectOf(err error) (addr string, ask, ok bool) {
	if err == nil {
		return "", false, false
	}
	if addr, ok := redis.IsAskError(err); ok {
		return addr, true, true
	}
	if addr, ok := redis.IsMovedError(err); ok {
		return addr, false, true
	}
	return "", false, false
}

// writeRecords sends ops to one master in one pipeline (one connection):
// each SET and UNLINK after ASKING where the op says so, and with
// WaitReplicas a WAIT at the end, which counts the replicas that
// acknowledged every write made on its connection before it (so it must
// share the writes' connection, which a cluster pipeline cannot promise
// for a command with no key). A master whose replicas fall short fails
// its records with ErrReplicas (not a node failure: its breaker is not
// tripped). It fills in set and unlink for each op.
func (r *Redis) writeRecords(ctx context.Context, c *redis.Client, gs []GenWrite, ops []recordOp, set, unlink []error) {
	// WAIT's own timeout leaves the deadline room for its reply: one
	// that ran out would read as the node's timeout.
	waitMs := int64(1000)
	if dl, ok := ctx.Deadline(); ok {
		waitMs = max(1, time.Until(dl).Milliseconds()/2)
	}
	setCmds := make([]*redis.StatusCmd, len(ops))
	unlinkCmds := make([]*redis.IntCmd, len(ops))
	var wait *redis.Cmd
	c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for j, op := range ops {
			g := &gs[op.i]
			if op.set {
				if op.ask {
					p.Do(ctx, "asking")
				}
				setCmds[j] = p.Set(ctx, g.Key, genText(g.Gen), 0)
			}
			if op.unlink {
				if op.ask {
					p.Do(ctx, "asking")
				}
				unlinkCmds[j] = p.Unlink(ctx, g.Unlink)
			}
		}
		if r.waitReplicas > 0 {
			wait = p.Do(ctx, "wait", r.waitReplicas, waitMs)
		}
		return nil
	})
	var acked int64
	var werr error
	if wait != nil {
		acked, werr = wait.Int64()
	}
	for j, op := range ops {
		if op.unlink {
			unlink[op.i] = unlinkCmds[j].Err()
		}
		if !op.set {
			continue
		}
		switch err := setCmds[j].Err(); {
		case err != nil:
			set[op.i] = err
		case werr != nil:
			set[op.i] = werr
		case wait != nil && acked < int64(r.waitReplicas):
			set[op.i] = fmt.Errorf("%w: %d of %d replicas acknowledged within %d ms", ErrReplicas, acked, r.waitReplicas, waitMs)
		default:
			set[op.i] = nil
		}
	}
}

// maxNodes bounds the node clients kept for redirects (a cluster's
// masters, and those a resharding brings in).
const maxNodes = 256

// node is a client of the master at addr, for the writes a redirect sends
// there: one per address, kept until Close. The cluster client keeps its
// own but does not lend them by address, and the master a slot migrates
// to may be one that serves no slot yet (a cluster growing).
func (r *Redis) node(addr string) (*redis.Client, error) {
	r.nodesMu.Lock()
	defer r.nodesMu.Unlock()
	if c := r.nodes[addr]; c != nil {
		return c, nil
	}
	if r.closed {
		return nil, redis.ErrClosed
	}
	if len(r.nodes) >= maxNodes {
		return nil, fmt.Errorf("redirected to %s: already %d nodes known, at most %d", addr, len(r.nodes), maxNodes)
	}
	opt := *r.nodeOpt
	opt.Addr = addr
	c := redis.NewClient(&opt)
	r.nodes[addr] = c
	return c, nil
}

// Delete implements Store with UNLINK: Redis frees a large value off its
// main thread. Keys of a node in its back-off are not deleted (their error
// says so).
func (r *Redis) Delete(ctx context.Context, keys []string) []error {
	addrs, skip := r.route(ctx, keys)
	cmds := make([]*redis.IntCmd, len(keys))
	r.cc.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			if !skip[i] {
				cmds[i] = p.Unlink(ctx, k)
			}
		}
		return nil
	})
	errs := make([]error, len(keys))
	for i, c := range cmds {
		if skip[i] {
			errs[i] = backoffErr(addrs[i])
		} else if err := c.Err(); err != nil {
			errs[i] = unavailable(err)
		}
	}
	r.settle(addrs, skip, func(i int) error { return errs[i] })
	return errs
}

// DeletePrefix implements Store: every master is scanned (SCAN MATCH, a
// page of up to 1000 keys per round trip, each bounded by the timeout) and
// each page's keys are unlinked in one pipeline, the masters in parallel.
// A master that fails fails the sweep; what it holds remains until the
// caller tries again, and the masters swept through (done) are not
// scanned again.
func (r *Redis) DeletePrefix(ctx context.Context, prefix string, done *Swept) (int, error) {
	var n atomic.Int64
	match := globEscape(prefix) + "*"
	err := r.cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		addr := c.Options().Addr
		if done.Has(addr) {
			return nil
		}
		var cursor uint64
		for {
			keys, next, err := c.Scan(ctx, cursor, match, 1000).Result()
			if err != nil {
				return fmt.Errorf("%s: scan: %w", addr, err)
			}
			if len(keys) > 0 {
				cmds, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
					for _, k := range keys {
						p.Unlink(ctx, k)
					}
					return nil
				})
				if err != nil {
					return fmt.Errorf("%s: unlink: %w", addr, err)
				}
				for _, cmd := range cmds {
					n.Add(cmd.(*redis.IntCmd).Val())
				}
			}
			if next == 0 {
				done.Add(addr)
				return nil
			}
			cursor = next
		}
	})
	return int(n.Load()), unavailable(err)
}

// globEscape quotes the characters SCAN's MATCH pattern treats specially.
func globEscape(s string) string {
	var b strings.Builder
	for _, c := range []byte(s) {
		switch c {
		case '*', '?', '[', ']', '\\':
			b.WriteByte('\\')
		}
		b.WriteByte(c)
	}
	return b.String()
}

// Ping asks every master of the cluster, those in their back-off too: a
// node that answers is out of it at once.
func (r *Redis) Ping(ctx context.Context) error {
	err := r.cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		addr := c.Options().Addr
		if err := c.Ping(ctx).Err(); err != nil {
			return fmt.Errorf("%s: %w", addr, err)
		}
		r.br.reset(addr)
		return nil
	})
	if err == nil {
		r.br.reset(anyNode)
	}
	return unavailable(err)
}

// Close implements Store.
func (r *Redis) Close() error {
	r.nodesMu.Lock()
	r.closed = true
	nodes := r.nodes
	r.nodes = nil
	r.nodesMu.Unlock()
	errs := []error{r.cc.Close()}
	for _, c := range nodes {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}

func cmp(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

// pipelineErr drops redis.Nil: a GET of an absent key is an answer.
func pipelineErr(err error) error {
	if errors.Is(err, redis.Nil) {
		return nil
	}
	return err
}

func unavailable(err error) error {
	if err == nil || errors.Is(err, ErrUnavailable) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}

// ErrorKind names the kind of a store error for metrics and logs: timeout,
// connection (refused, reset, closed), cluster (CLUSTERDOWN, MOVED, ASK,
// TRYAGAIN, LOADING: the cluster is changing), oom (Redis refused a write
// over maxmemory with a noeviction policy), auth, or other.
func ErrorKind(err error) string {
	var ne net.Error
	switch {
	case err == nil:
		return ""
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE),
		errors.Is(err, net.ErrClosed), errors.Is(err, redis.ErrClosed), errors.As(err, new(*net.OpError)):
		return "connection"
	}
	if errors.Is(err, ErrReplicas) {
		return "replicas"
	}
	msg := err.Error()
	for _, p := range []struct{ sub, kind string }{
		{"CLUSTERDOWN", "cluster"}, {"MOVED", "cluster"}, {"ASK", "cluster"}, {"TRYAGAIN", "cluster"}, {"LOADING", "cluster"},
		{"OOM", "oom"}, {"NOAUTH", "auth"}, {"WRONGPASS", "auth"}, {"NOPERM", "auth"},
	} {
		if strings.Contains(msg, p.sub) {
			return p.kind
		}
	}
	if strings.Contains(msg, "connection refused") || strings.Contains(msg, "EOF") || strings.Contains(msg, "i/o timeout") {
		if strings.Contains(msg, "i/o timeout") {
			return "timeout"
		}
		return "connection"
	}
	return "other"
}
