package remote

import (
	"context"
	"sync"

	"github.com/redis/go-redis/v9"
)

// roundTrips counts, per node, the pipelines and the single commands a
// Redis store sends: what "one round trip per node" is checked against.
type roundTrips struct {
	mu        sync.Mutex
	pipelines map[string]int
	single    map[string]int
}

// countRoundTrips installs the counter on every node client r creates; call
// it before r's first command.
func countRoundTrips(r *Redis) *roundTrips {
	rt := &roundTrips{pipelines: map[string]int{}, single: map[string]int{}}
	r.cc.OnNewNode(func(c *redis.Client) { c.AddHook(nodeHook{rt, c.Options().Addr}) })
	return rt
}

func (rt *roundTrips) reset() {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	clear(rt.pipelines)
	clear(rt.single)
}

func (rt *roundTrips) snapshot() (pipelines, single map[string]int) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	p, s := map[string]int{}, map[string]int{}
	for k, v := range rt.pipelines {
		p[k] = v
	}
	for k, v := range rt.single {
		s[k] = v
	}
	return p, s
}

type nodeHook struct {
	rt   *roundTrips
	addr string
}

func (h nodeHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h nodeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		switch cmd.Name() {
		case "get", "exists", "set", "unlink":
			// Data commands sent one by one; cluster state reloads
			// (CLUSTER SLOTS) are the client's own business.
			h.rt.mu.Lock()
			h.rt.single[h.addr]++
			h.rt.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (h nodeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.rt.mu.Lock()
		h.rt.pipelines[h.addr]++
		h.rt.mu.Unlock()
		return next(ctx, cmds)
	}
}
