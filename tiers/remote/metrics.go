package remote

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the remote tier's, created against the registry the daemon
// passes in (nil: unregistered, for tests that do not look).
type Metrics struct {
	// Blocks counts blocks by op and result: lookup hit|miss|error (keys
	// past the local prefix the store was asked about), load
	// ok|missing|io_error|corrupt|no_space, publish
	// published|exists|gone|duplicate|dropped|error.
	Blocks *prometheus.CounterVec
	// Bytes counts payload bytes loaded from and published to the store.
	Bytes *prometheus.CounterVec
	// Errors counts failed store operations by op and kind (ErrorKind),
	// and values that failed verification (op=verify, kind=the check).
	Errors *prometheus.CounterVec
	// Seconds is the latency of one batch by op (exists, get, set, delete).
	Seconds *prometheus.HistogramVec
	// Up is 1 while the last health check reached every master.
	Up prometheus.Gauge
}

// NewMetrics creates and registers the metrics.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Blocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_remote_blocks_total",
			Help: "Blocks through the remote tier, by op and result: lookup hit|miss|error, load ok|missing|io_error|corrupt|no_space, publish published|exists|gone|duplicate|dropped|cancelled|error, invalidate deleted|error (keys of blocks invalidated on this node, deleted from the store), sweep deleted (keys of namespaces invalidated whole).",
		}, []string{"op", "result"}),
		Bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_remote_bytes_total", Help: "Block payload bytes loaded from (op=load) and published to (op=publish) the remote tier.",
		}, []string{"op"}),
		Errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_remote_errors_total",
			Help: "Remote store errors by op (exists, get, set, delete, sweep, ping) and kind (timeout, connection, cluster, oom, auth, other), and values that failed verification (op=verify, kind=magic|version|length|key|malformed|checksum|mac).",
		}, []string{"op", "kind"}),
		Seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvoffload_remote_op_duration_seconds",
			Help:    "Latency of one batch against the remote store (one round trip per node, in parallel), by op.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 16),
		}, []string{"op"}),
		Up: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvoffload_remote_up", Help: "1 while the last health check reached every master of the remote store, else 0.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.Blocks, m.Bytes, m.Errors, m.Seconds, m.Up)
	}
	return m
}

// VerifyKind names the check a value failed, for the errors metric.
func VerifyKind(err error) string {
	for _, k := range []struct {
		err  error
		kind string
	}{{ErrBadMagic, "magic"}, {ErrBadVersion, "version"}, {ErrLength, "length"}, {ErrKeyMismatch, "key"},
		{ErrMalformed, "malformed"}, {ErrChecksum, "checksum"}, {ErrMAC, "mac"}} {
		if errors.Is(err, k.err) {
			return k.kind
		}
	}
	return "other"
}

// Instrument wraps a store so every batch records its latency and every
// failure its kind.
func Instrument(s Store, m *Metrics) Store { return instrumented{s, m} }

type instrumented struct {
	s Store
	m *Metrics
}

func (i instrumented) observe(op string, start time.Time, errs ...error) {
	i.m.Seconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
	for _, err := range errs {
		if err != nil {
			i.m.Errors.WithLabelValues(op, ErrorKind(err)).Inc()
		}
	}
}

func (i instrumented) Get(ctx context.Context, fs []Fetch) error {
	start := time.Now()
	err := i.s.Get(ctx, fs)
	i.observe("get", start, err)
	return err
}

func (i instrumented) Set(ctx context.Context, items []Item) []error {
	start := time.Now()
	errs := i.s.Set(ctx, items)
	i.observe("set", start, errors.Join(errs...))
	return errs
}

func (i instrumented) SetGens(ctx context.Context, gs []GenWrite) []error {
	start := time.Now()
	errs := i.s.SetGens(ctx, gs)
	i.observe("invalidate", start, errors.Join(errs...))
	return errs
}

func (i instrumented) Delete(ctx context.Context, keys []string) []error {
	start := time.Now()
	errs := i.s.Delete(ctx, keys)
	i.observe("delete", start, errors.Join(errs...))
	return errs
}

func (i instrumented) DeletePrefix(ctx context.Context, prefix string, done *Swept) (int, error) {
	start := time.Now()
	n, err := i.s.DeletePrefix(ctx, prefix, done)
	i.observe("sweep", start, err)
	return n, err
}

func (i instrumented) Ping(ctx context.Context) error {
	start := time.Now()
	err := i.s.Ping(ctx)
	i.observe("ping", start, err)
	return err
}

func (i instrumented) Close() error { return i.s.Close() }
