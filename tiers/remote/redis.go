package remote

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
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
	// PoolSize is the connections kept per node (0: 8).
	PoolSize int
}

// Redis is a Store on Redis Cluster through go-redis's cluster client. A
// batch is one pipeline: the client splits it by hash slot and sends each
// node its commands in one write, all nodes in parallel, then reads the
// replies, so a batch costs one round trip to the slowest node it touches.
type Redis struct {
	cc *redis.ClusterClient
}

var _ Store = (*Redis)(nil)

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
		cfg.PoolSize = 8
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
		// batch that meets it; the client reloads the slot map and the
		// next batch finds it.
		MaxRedirects: -1,
		MaxRetries:   -1,
		PoolSize:     cfg.PoolSize,
		PoolTimeout:  cfg.Timeout,
		// Blocks are large: reads of a 2 MiB value bypass the buffer
		// once it is empty, so a bigger one would only add a copy.
		ReadBufferSize:  64 << 10,
		WriteBufferSize: 64 << 10,
	})
	return &Redis{cc: cc}, nil
}

// Exists implements Store.
func (r *Redis) Exists(ctx context.Context, keys []string, out []Presence) error {
	cmds := make([]*redis.IntCmd, len(keys))
	_, err := r.cc.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			cmds[i] = p.Exists(ctx, k)
		}
		return nil
	})
	var first error
	for i, c := range cmds {
		n, cerr := c.Result()
		switch {
		case cerr != nil:
			out[i] = Failed
			first = cmp(first, cerr)
		case n > 0:
			out[i] = Present
		default:
			out[i] = Absent
		}
	}
	return unavailable(cmp(first, pipelineErr(err)))
}

// Get implements Store. Each key costs three commands in the node's
// pipeline: STRLEN (absent is 0), then GETRANGE of the header and GETRANGE
// of the payload, each read by go-redis straight into the caller's buffer
// (ZeroCopyStringCmd): past the reply's first read-buffer's worth, the
// socket's bytes land in Body with no copy in user space.
func (r *Redis) Get(ctx context.Context, fs []Fetch) error {
	type cmds struct {
		size       *redis.IntCmd
		head, body *redis.ZeroCopyStringCmd
	}
	cs := make([]cmds, len(fs))
	_, err := r.cc.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range fs {
			f := &fs[i]
			c := &cs[i]
			c.size = p.StrLen(ctx, f.Key)
			if len(f.Head) > 0 {
				c.head = redis.NewZeroCopyStringCmd(ctx, f.Head, "getrange", f.Key, 0, len(f.Head)-1)
				p.Process(ctx, c.head)
			}
			if len(f.Body) > 0 {
				c.body = redis.NewZeroCopyStringCmd(ctx, f.Body, "getrange", f.Key, len(f.Head), len(f.Head)+len(f.Body)-1)
				p.Process(ctx, c.body)
			}
		}
		return nil
	})
	var first error
	for i := range fs {
		f, c := &fs[i], &cs[i]
		f.Size, f.HeadN, f.BodyN, f.Err = 0, 0, 0, nil
		size, err := c.size.Result()
		if err == nil && c.head != nil {
			f.HeadN, err = c.head.Result()
		}
		if err == nil && c.body != nil {
			f.BodyN, err = c.body.Result()
		}
		if err != nil {
			f.Err = unavailable(err)
			first = cmp(first, err)
			continue
		}
		f.Size = size
	}
	return unavailable(cmp(first, pipelineErr(err)))
}

// Set implements Store.
func (r *Redis) Set(ctx context.Context, items []Item) []error {
	cmds := make([]*redis.StatusCmd, len(items))
	r.cc.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, it := range items {
			cmds[i] = p.Set(ctx, it.Key, it.Value, 0)
		}
		return nil
	})
	errs := make([]error, len(items))
	for i, c := range cmds {
		if err := c.Err(); err != nil {
			errs[i] = unavailable(err)
		}
	}
	return errs
}

// Delete implements Store with UNLINK: Redis frees a large value off its
// main thread.
func (r *Redis) Delete(ctx context.Context, keys []string) error {
	cmds := make([]*redis.IntCmd, len(keys))
	_, err := r.cc.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			cmds[i] = p.Unlink(ctx, k)
		}
		return nil
	})
	var first error
	for _, c := range cmds {
		first = cmp(first, c.Err())
	}
	return unavailable(cmp(first, pipelineErr(err)))
}

// Ping asks every master of the cluster.
func (r *Redis) Ping(ctx context.Context) error {
	err := r.cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		if err := c.Ping(ctx).Err(); err != nil {
			return fmt.Errorf("%s: %w", c.Options().Addr, err)
		}
		return nil
	})
	return unavailable(err)
}

// Close implements Store.
func (r *Redis) Close() error { return r.cc.Close() }

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
