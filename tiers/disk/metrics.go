package disk

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the tier's Prometheus collectors, created whether or not a
// Registerer was given so the I/O path never checks.
type metrics struct {
	reg        prometheus.Registerer
	registered []prometheus.Collector

	readBytes, writeBytes   prometheus.Counter
	readBlocks, writeBlocks prometheus.Counter
	readSeconds             prometheus.Observer
	writeSeconds            prometheus.Observer
	errIO, errShort         prometheus.Counter
	errCorrupt              prometheus.Counter
	checksum                prometheus.Counter
	recovered               prometheus.Counter
	recoveryBytes           prometheus.Counter
}

// newMetrics creates the collectors and registers them with reg (nil:
// none). A name already registered with other labels or help is an error.
func newMetrics(reg prometheus.Registerer, t *Tier) (*metrics, error) {
	bytes := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvoffload_disk_bytes_total",
		Help: "Bytes transferred by disk-tier block reads and writes, headers included.",
	}, []string{"op"})
	blocks := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvoffload_disk_blocks_total",
		Help: "Blocks read or written by the disk tier, successful or not.",
	}, []string{"op"})
	seconds := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kvoffload_disk_io_seconds",
		Help: "Time a successful disk-tier block read or write took on its I/O worker, header and payload together.",
		// 50µs (a 4 KiB NVMe read) to 1.6s (a stalled device).
		Buckets: prometheus.ExponentialBuckets(50e-6, 2, 16),
	}, []string{"op"})
	errs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvoffload_disk_errors_total",
		Help: "Disk-tier block reads and writes that failed, by kind: io (the device failed), short (a read came back short), corrupt (a read failed verification).",
	}, []string{"kind"})
	m := &metrics{
		reg:          reg,
		readBytes:    bytes.WithLabelValues("read"),
		writeBytes:   bytes.WithLabelValues("write"),
		readBlocks:   blocks.WithLabelValues("read"),
		writeBlocks:  blocks.WithLabelValues("write"),
		readSeconds:  seconds.WithLabelValues("read"),
		writeSeconds: seconds.WithLabelValues("write"),
		errIO:        errs.WithLabelValues("io"),
		errShort:     errs.WithLabelValues("short"),
		errCorrupt:   errs.WithLabelValues("corrupt"),
		checksum: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvoffload_disk_checksum_failures_total",
			Help: "Disk-tier slots whose header or payload checksum did not match, at reads and at recovery.",
		}),
		recovered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvoffload_disk_recovered_blocks_total",
			Help: "Blocks the disk tier's recovery found intact in its files and brought online (it runs in the background after a start).",
		}),
		recoveryBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvoffload_disk_recovery_read_bytes_total",
			Help: "Bytes of the slot files the disk tier's recovery has read and verified; its rate is recovery's throughput.",
		}),
	}
	if reg == nil {
		return m, nil
	}
	tier := prometheus.Labels{"tier": "disk"}
	all := []prometheus.Collector{
		bytes, blocks, seconds, errs, m.checksum, m.recovered, m.recoveryBytes,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvoffload_disk_recovery_slots",
			Help: "Slots the disk tier's recovery reads after a start: those of every chunk its chunk maps name.",
		}, func() float64 { return float64(t.Recovery().SlotsTotal) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvoffload_disk_recovery_scanned_slots",
			Help: "Slots the disk tier's recovery has read and verified so far; equal to kvoffload_disk_recovery_slots once it is done.",
		}, func() float64 { return float64(t.Recovery().SlotsScanned) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvoffload_disk_recovering",
			Help: "1 while the disk tier's recovery runs in the background, else 0.",
		}, func() float64 {
			if t.Recovery().State == RecoveryRunning {
				return 1
			}
			return 0
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvoffload_disk_recovery_seconds",
			Help: "Time the disk tier's recovery has run, or took once it ended.",
		}, func() float64 { return t.Recovery().Elapsed.Seconds() }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvoffload_disk_quarantined_slots",
			Help: "Disk-tier slots taken out of use after an I/O error.",
		}, func() float64 { return float64(t.Quarantined()) }),
		// Same names and help as the CPU tier's, told apart by the label.
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_tier_capacity_bytes", Help: "Bytes a tier can hold.", ConstLabels: tier},
			func() float64 { return float64(t.Capacity()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_tier_used_bytes", Help: "Bytes of a tier's slots in use.", ConstLabels: tier},
			func() float64 { u, _ := t.Usage(); return float64(u) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_tier_blocks", Help: "Blocks held in a tier's slots.", ConstLabels: tier},
			func() float64 { _, b := t.Usage(); return float64(b) }),
	}
	for _, c := range all {
		if err := reg.Register(c); err != nil {
			m.unregister()
			return nil, err
		}
		m.registered = append(m.registered, c)
	}
	return m, nil
}

// unregister removes what newMetrics registered, so a tier can be opened
// again against the same registry.
func (m *metrics) unregister() {
	for _, c := range m.registered {
		m.reg.Unregister(c)
	}
	m.registered = nil
}

// readFailed counts a failed read by its kind.
func (m *metrics) readFailed(err error, short bool) {
	switch {
	case short:
		m.errShort.Inc()
	case errors.Is(err, ErrCorrupt):
		m.errCorrupt.Inc()
	case errors.Is(err, ErrIO):
		m.errIO.Inc()
	}
}
