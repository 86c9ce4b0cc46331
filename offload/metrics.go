package offload

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are created against the registry the daemon passes in.
type metrics struct {
	lookups      prometheus.Counter
	lookupBlocks *prometheus.CounterVec // result=hit|miss
	blocks       *prometheus.CounterVec // op, status
	bytes        *prometheus.CounterVec // op
	jobSeconds   *prometheus.HistogramVec
	evictions    *prometheus.CounterVec // tier, reason
	pendingJobs  prometheus.Gauge
	regs         prometheus.Gauge
	leases       prometheus.Gauge
	namespaces   prometheus.Gauge
	refused      *prometheus.CounterVec // reason
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		lookups: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvoffload_lookups_total", Help: "Lookup calls served.",
		}),
		lookupBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_lookup_blocks_total", Help: "Keys looked up, by result: hit (ready in every namespace, part of the leading prefix) or miss (the first key that was not).",
		}, []string{"result"}),
		blocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_blocks_total", Help: "Blocks of finished jobs, by op and per-block status.",
		}, []string{"op", "status"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_bytes_total", Help: "Block bytes copied by finished jobs, by op.",
		}, []string{"op"}),
		jobSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvoffload_job_duration_seconds",
			Help:    "Time from a job's acceptance to its completion, by op.",
			Buckets: prometheus.ExponentialBuckets(20e-6, 2, 18),
		}, []string{"op"}),
		evictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_evictions_total", Help: "Blocks dropped from a tier, by tier and reason (policy, rebalance, invalidate).",
		}, []string{"tier", "reason"}),
		pendingJobs: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvoffload_pending_jobs", Help: "Jobs accepted and not yet finished.",
		}),
		regs: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvoffload_registrations", Help: "Live registrations.",
		}),
		leases: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvoffload_leases", Help: "Live Lookup leases.",
		}),
		namespaces: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvoffload_namespaces", Help: "Namespaces kept: with a registration or a cached block, or lately so.",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_requests_refused_total", Help: "Requests refused before any work, by reason (invalid, backlog, shutting_down, lease_limit), and loads that named another connection's lease (lease_not_owned).",
		}, []string{"reason"}),
	}
	if reg != nil {
		reg.MustRegister(m.lookups, m.lookupBlocks, m.blocks, m.bytes, m.jobSeconds, m.evictions, m.pendingJobs, m.regs, m.leases, m.namespaces, m.refused)
	}
	return m
}
