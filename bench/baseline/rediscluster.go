package baseline

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// ClusterGet is raw GETs of whole values from a Redis Cluster: go-redis's
// cluster client, the keys in groups of perLoad, each group fetched by
// perLoad/perJob goroutines at once, each pipelining perJob GETs (one round
// trip per node it touches) — the same grouping as the remote scenario's
// Loads. Each GET is read straight into a buffer of the goroutine's,
// allocated and touched before timing (GetToBuffer): like the Redis
// baseline, it is not slowed by a client's copies or by page faults on
// fresh memory (a VM may pay 12 µs per 4 KiB page), so it is the limit of
// the cluster and the network. Every value must be wantBytes long.
type ClusterGet struct {
	GBps   float64
	P99    time.Duration // per goroutine's pipeline
	Blocks int
}

// MeasureClusterGet fetches every key once and times it.
func MeasureClusterGet(ctx context.Context, addrs []string, keys []string, wantBytes, perLoad, perJob int) (ClusterGet, error) {
	res := ClusterGet{Blocks: len(keys)}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, Protocol: 2, DisableIdentity: true,
		ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second, PoolSize: perLoad/perJob + 1})
	defer cc.Close()
	if err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return c.Ping(ctx).Err() }); err != nil {
		return res, err
	}
	var (
		mu    sync.Mutex
		lats  []time.Duration
		total int64
		busy  time.Duration
		errs  []error
	)
	// One buffer per value a round holds at once, touched now.
	bufs := make([][]byte, perLoad)
	for i := range bufs {
		bufs[i] = make([]byte, wantBytes+2) // +2: the reply's CRLF lands there too
		for j := 0; j < len(bufs[i]); j += 4096 {
			bufs[i][j] = 1
		}
	}
	for len(keys) > 0 {
		n := min(len(keys), perLoad)
		group := keys[:n]
		keys = keys[n:]
		var wg sync.WaitGroup
		t0 := time.Now()
		for base := 0; base < n; base += perJob {
			part := group[base:min(base+perJob, n)]
			dst := bufs[base : base+len(part)]
			wg.Go(func() {
				s := time.Now()
				cmds := make([]*redis.ZeroCopyStringCmd, len(part))
				_, err := cc.Pipelined(ctx, func(p redis.Pipeliner) error {
					for i, k := range part {
						cmds[i] = p.GetToBuffer(ctx, k, dst[i])
					}
					return nil
				})
				el := time.Since(s)
				var got int64
				for _, c := range cmds {
					v, cerr := c.Result()
					if cerr == nil && v != wantBytes {
						cerr = fmt.Errorf("GET returned %d bytes, want %d", v, wantBytes)
					}
					err = errors.Join(err, cerr)
					got += int64(v)
				}
				mu.Lock()
				lats = append(lats, el)
				total += got
				if err != nil {
					errs = append(errs, err)
				}
				mu.Unlock()
			})
		}
		wg.Wait()
		busy += time.Since(t0)
	}
	if err := errors.Join(errs...); err != nil {
		return res, err
	}
	res.GBps = float64(total) / busy.Seconds() / 1e9
	res.P99 = percentile(lats, 99)
	return res, nil
}

func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(p/100*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}
