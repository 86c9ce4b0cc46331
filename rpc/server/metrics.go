package server

import (
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// registerMetrics exports what the server bounds: connections, refusals,
// request bytes in flight.
func (s *Server) registerMetrics(reg prometheus.Registerer) {
	if reg == nil {
		return
	}
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_connections", Help: "Client connections open."},
			func() float64 { return float64(s.conns.count()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvoffload_connections_refused_total", Help: "Connections closed at accept: past --max-connections or --max-connections-per-uid, or during shutdown."},
			func() float64 { return float64(s.conns.refused.n.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_inflight_request_bytes", Help: "Request bytes booked by calls being received or handled (--max-inflight-request-bytes)."},
			func() float64 { return float64(s.InflightRequestBytes()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvoffload_foreign_registration_calls_total", Help: "Calls refused (NOT_FOUND) for naming a registration of another connection."},
			func() float64 { return float64(s.foreign.n.Load()) }),
	)
}

// rateLog counts events and logs at most one a second: a client that
// repeats a refused call must not flood the log with it.
type rateLog struct {
	n    atomic.Uint64
	last atomic.Int64 // unix nanos of the last line logged
}

// warn counts the event and logs it unless a line went out in the last
// second; the line carries the count so far.
func (r *rateLog) warn(log *slog.Logger, msg string, args ...any) {
	n := r.n.Add(1)
	now := time.Now().UnixNano()
	last := r.last.Load()
	if now-last < int64(time.Second) || !r.last.CompareAndSwap(last, now) {
		return
	}
	log.Warn(msg, append(args, "total", n)...)
}
