// Package report owns what kvbench tells its user: the JSON document (a
// stable schema, "kvbench/v1"), the table on the terminal, the plot of
// throughput and p99 latency against the fault rate, and the description
// of the machine the numbers came from.
package report

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
)

// Schema names this document's layout. Fields are only ever added to it.
const Schema = "kvbench/v1"

// Report is the whole run.
type Report struct {
	Schema    string    `json:"schema"`
	Command   string    `json:"command"`
	Seed      uint64    `json:"seed"`
	Quick     bool      `json:"quick"`
	Machine   Machine   `json:"machine"`
	Model     Model     `json:"model"`
	Daemon    string    `json:"daemon"`
	Results   []Result  `json:"results"`
	Baselines Baselines `json:"baselines"`
	Ratios    Ratios    `json:"ratios"`
	Faults    *Faults   `json:"faults"`
	// Sweep holds the fault scenario at each fault rate (--plot).
	Sweep []SweepPoint `json:"sweep,omitempty"`
	// Recovery is the restart scenario, when it ran.
	Recovery *Recovery `json:"recovery,omitempty"`
	// Hybrid is the hybrid scenario: one entry per hybrid model shape.
	Hybrid []Hybrid `json:"hybrid,omitempty"`
	// Scale is the scale scenario: one row per number of blocks.
	Scale []Scale `json:"scale,omitempty"`
	// Mirror is the mirror scenario: one row per workload.
	Mirror  []Mirror `json:"mirror,omitempty"`
	Skipped []Skip   `json:"skipped"`
	Goals   []Goal   `json:"goals"`
	// Interference is what other processes did to the machine during
	// each phase of the run; a flagged phase's figures are suspect.
	Interference *Interference `json:"interference,omitempty"`
}

// Interference is the run's phases, each with the CPU share other
// processes took while it ran.
type Interference struct {
	// Threshold is the share of the machine's CPU time above which a
	// phase is flagged.
	Threshold float64 `json:"threshold"`
	Phases    []Phase `json:"phases"`
}

// Phase is one measured phase of the run (a scenario's steps, its
// disk-only loads, a baseline).
type Phase struct {
	Name          string  `json:"name"`
	Seconds       float64 `json:"seconds"`
	OtherCPUShare float64 `json:"other_cpu_share"`
	OwnCPUShare   float64 `json:"own_cpu_share"`
	StealShare    float64 `json:"steal_share"`
	Load1         float64 `json:"load1"`
	Flagged       bool    `json:"flagged"`
}

// Model is the engine shape the run registered.
type Model struct {
	Name             string `json:"name"`
	Layers           int    `json:"layers"`
	BlockTokens      int    `json:"block_tokens"`
	KVHeads          int    `json:"kv_heads"`
	HeadDim          int    `json:"head_dim"`
	DTypeBytes       int    `json:"dtype_bytes"`
	Segments         int    `json:"segments"`
	SegmentBytes     int    `json:"segment_bytes"`
	BlockBytes       int    `json:"block_bytes"`
	EngineBlocks     int    `json:"engine_blocks"`
	StepsPerScenario int    `json:"steps_per_scenario"`
	// WorkingSetBlocks is the distinct blocks the steps' requests name.
	WorkingSetBlocks int `json:"working_set_blocks"`
}

// Result is one op of one scenario.
type Result struct {
	Scenario string  `json:"scenario"`
	Op       string  `json:"op"` // lookup, load, store
	GBps     float64 `json:"gbps"`
	Blocks   int     `json:"blocks"`
	Bytes    uint64  `json:"bytes"`
	Calls    int     `json:"calls"`
	// CompletionsCalls is how many Completions round trips the load or
	// store calls needed until every job was reported.
	CompletionsCalls int     `json:"completions_calls,omitempty"`
	P50us            float64 `json:"p50_us"`
	P99us            float64 `json:"p99_us"`
	// HitRate is, for lookups, the share of looked-up blocks that were
	// ready, by tier ("cpu", "disk", "remote") and in all ("all"), plus by
	// request kind ("chat", "rag", "scan").
	HitRate map[string]float64 `json:"hit_rate,omitempty"`
	// DiskBytes is what the daemon's disk tier read (load row) or wrote
	// (store row: demotions and write-through) in the scenario, headers
	// included, from its metrics.
	DiskBytes uint64 `json:"disk_bytes,omitempty"`
	// Failed counts failed blocks by status (load, store).
	Failed                 map[string]int `json:"failed,omitempty"`
	CorruptBlocksDelivered int            `json:"corrupt_blocks_delivered"`
	FailedBlocksReoffered  int            `json:"failed_blocks_reoffered"`
	// Daemon is the scenario's daemon setup: CPU and disk tier sizes.
	Daemon string `json:"daemon"`
	// On lookup rows: the same request trace replayed against an LRU
	// cache and Belady's offline optimum of CapacityBlocks blocks (both
	// tiers' slots), as hit rates of every looked-up block.
	HitRateLRU     *float64 `json:"hit_rate_lru,omitempty"`
	HitRateBelady  *float64 `json:"hit_rate_belady,omitempty"`
	CapacityBlocks int      `json:"capacity_blocks,omitempty"`
	// NoSpaceWithCleanCopies, on store rows of a daemon with a disk
	// tier: blocks refused NO_SPACE while the CPU tier held clean copies
	// (all pinned, or of another block size), from the daemon's metrics;
	// the rest of Failed["NO_SPACE"] found none.
	NoSpaceWithCleanCopies *int `json:"no_space_with_clean_copies,omitempty"`
	// Interference is the largest share of the machine's CPU that other
	// processes took in a phase this row was measured in; Flagged when it
	// was above the threshold.
	Interference float64 `json:"interference"`
	Flagged      bool    `json:"flagged"`
}

// Baselines are the limits measured in the same run. A nil field was
// skipped (see Skipped).
type Baselines struct {
	MemcpyGBps *float64 `json:"memcpy_gbps"`
	// MemcpySegmentGBps is the same copy in the layout's segments,
	// scattered as in the engine's regions: what the daemon's copy loop
	// could reach.
	MemcpySegmentGBps *float64 `json:"memcpy_segment_gbps"`
	ODirectReadGBps   *float64 `json:"odirect_read_gbps"`
	ODirectWriteGBps  *float64 `json:"odirect_write_gbps"`
	GRPCEmptyP50us    *float64 `json:"grpc_empty_p50_us"`
	GRPCEmptyP99us    *float64 `json:"grpc_empty_p99_us"`
	RedisGetGBps      *float64 `json:"redis_get_gbps"`
	RedisSetGBps      *float64 `json:"redis_set_gbps"`
	Workers           int      `json:"workers"`
	QueueDepth        int      `json:"queue_depth"`
	IOBytes           int      `json:"io_bytes"`
	SegmentBytes      int      `json:"segment_bytes"`
	// ODirectIOBytes is one disk-tier slot: a 4 KiB header and the block.
	ODirectIOBytes int    `json:"odirect_io_bytes"`
	DiskDir        string `json:"disk_dir,omitempty"`
	RedisVersion   string `json:"redis_version,omitempty"`

	// SegmentCopyLoadGBps and SegmentCopyStoreGBps are a copy of the same
	// segments as the cpu scenario's Loads and Stores by a helper process
	// kvbench starts (another process, as the daemon is), timed around
	// its request and reply in the same steps right before or after each
	// (interleaved), with the same workers.
	SegmentCopyLoadGBps  *float64 `json:"segment_copy_load_gbps"`
	SegmentCopyStoreGBps *float64 `json:"segment_copy_store_gbps"`
	// SegmentCopyOwnLoadGBps and SegmentCopyOwnStoreGBps are the same
	// copies done in kvbench's own process, the one that fills the region:
	// no process boundary at all.
	SegmentCopyOwnLoadGBps  *float64 `json:"segment_copy_own_load_gbps"`
	SegmentCopyOwnStoreGBps *float64 `json:"segment_copy_own_store_gbps"`
	// TierRead is raw O_DIRECT reads of the disk scenario's own slot
	// file with the disk tier's pattern, right before and right after its
	// disk-only loads.
	TierRead *TierRead `json:"tier_read"`
	// GRPCEmptyBusyP50us and GRPCEmptyBusyP99us are the empty call issued
	// from a second connection while the cpu scenario's transfers ran,
	// alternating with the busy Lookups.
	GRPCEmptyBusyP50us *float64 `json:"grpc_empty_busy_p50_us"`
	GRPCEmptyBusyP99us *float64 `json:"grpc_empty_busy_p99_us"`
	// RedisClusterGetGBps is raw GETs (go-redis, pipelined) of the remote
	// scenario's values from its cluster, grouped as its Loads are; P99
	// is per pipeline. Nil when the remote scenario did not run.
	RedisClusterGetGBps  *float64 `json:"redis_cluster_get_gbps"`
	RedisClusterGetP99us *float64 `json:"redis_cluster_get_p99_us"`
	RedisClusterBlocks   int      `json:"redis_cluster_blocks,omitempty"`
}

// TierRead is the tier-pattern O_DIRECT baseline: the same slots the
// disk-only loads read, in the same file, header then payload per slot,
// QueueDepth in flight, in bursts of Burst slots (one Load's reads).
type TierRead struct {
	Blocks     int     `json:"blocks"`
	Burst      int     `json:"burst"`
	QueueDepth int     `json:"queue_depth"`
	IOBytes    int     `json:"io_bytes"`
	FileBytes  uint64  `json:"file_bytes"`
	BeforeGBps float64 `json:"before_gbps"`
	AfterGBps  float64 `json:"after_gbps"`
	BurstP50us float64 `json:"burst_p50_us"`
	BurstP99us float64 `json:"burst_p99_us"`
}

// Min and Max of the two measurements.
func (t *TierRead) Min() float64 { return min(t.BeforeGBps, t.AfterGBps) }
func (t *TierRead) Max() float64 { return max(t.BeforeGBps, t.AfterGBps) }

// Ratios compare the daemon with its limits; nil when a side is missing.
type Ratios struct {
	CPULoadVsMemcpy         *float64 `json:"cpu_load_vs_memcpy"`
	CPUStoreVsMemcpy        *float64 `json:"cpu_store_vs_memcpy"`
	DiskLoadVsODirectRead   *float64 `json:"disk_load_vs_odirect_read"`
	DiskStoreVsODirectWrite *float64 `json:"disk_store_vs_odirect_write"`
	CPULoadVsRedisGet       *float64 `json:"cpu_load_vs_redis_get"`
	LookupP99VsGRPCEmptyP99 *float64 `json:"lookup_p99_vs_grpc_empty_p99"`

	// Against the same-window baselines (issue 11).
	CPULoadVsSegmentCopy  *float64 `json:"cpu_load_vs_segment_copy"`
	CPUStoreVsSegmentCopy *float64 `json:"cpu_store_vs_segment_copy"`
	// Against the in-process copies: the daemon's cost plus the process
	// boundary's. No goal; SegmentCopyVsOwn* say how much of it is the
	// boundary's on the machine (the helper's copy over kvbench's own).
	CPULoadVsOwnSegmentCopy  *float64 `json:"cpu_load_vs_own_segment_copy"`
	CPUStoreVsOwnSegmentCopy *float64 `json:"cpu_store_vs_own_segment_copy"`
	SegmentCopyVsOwnLoad     *float64 `json:"segment_copy_vs_own_load"`
	SegmentCopyVsOwnStore    *float64 `json:"segment_copy_vs_own_store"`
	// DiskLoadVsTierRead is the disk scenario's load-disk against the
	// mean of the tier-pattern reads before and after it; the range is
	// against the faster and the slower of the two.
	DiskLoadVsTierRead          *float64  `json:"disk_load_vs_tier_read"`
	DiskLoadVsTierReadRange     []float64 `json:"disk_load_vs_tier_read_range,omitempty"`
	DiskLoadP99VsRawStepP99     *float64  `json:"disk_load_p99_vs_raw_step_p99"`
	LookupBusyP99VsGRPCEmptyP99 *float64  `json:"lookup_busy_p99_vs_grpc_empty_p99"`
	LookupBusyP99VsEmptyBusyP99 *float64  `json:"lookup_busy_p99_vs_empty_busy_p99"`
	LookupIdleP99VsGRPCEmptyP99 *float64  `json:"lookup_idle_p99_vs_grpc_empty_p99"`
	// RemoteLoadVsClusterGet is node B's load of remote blocks through
	// the daemon over raw GETs of the same values (remote scenario).
	RemoteLoadVsClusterGet *float64 `json:"remote_load_vs_cluster_get"`
}

// Recovery is what a restart on a full disk tier cost: the daemon serves
// from its start and recovers its files in the background.
type Recovery struct {
	DiskBytes  uint64 `json:"disk_bytes"`
	ChunkBytes uint64 `json:"chunk_bytes"`
	BlockBytes int    `json:"block_bytes"`
	Blocks     int    `json:"blocks"` // on disk before the restart
	// StartToServingMs: from the exec of the daemon to its health
	// service saying SERVING (kvbench polls every 5 ms).
	// EmptyStartToServingMs is the same for the first start, on an empty
	// disk tier with the same flags: what starting costs apart from what
	// the disk holds (mapping and locking the CPU tier, mostly).
	StartToServingMs      float64 `json:"start_to_serving_ms"`
	EmptyStartToServingMs float64 `json:"empty_start_to_serving_ms"`
	// DiskOpenToServingMs is, from the daemon's log, the time from the
	// start of the disk tier's open to SERVING: its share of the start.
	DiskOpenToServingMs float64 `json:"disk_open_to_serving_ms"`
	CPUBytes            uint64  `json:"cpu_bytes"`
	// RecoverySeconds is the daemon's own measure (Stats.disk_recovery);
	// StartToRecoveredSeconds runs from the exec (kvbench polls Stats
	// every 5 ms).
	RecoverySeconds         float64 `json:"recovery_seconds"`
	StartToRecoveredSeconds float64 `json:"start_to_recovered_seconds"`
	BytesScanned            uint64  `json:"bytes_scanned"`
	RecoveryGBps            float64 `json:"recovery_gbps"`
	BlocksRecovered         uint64  `json:"blocks_recovered"`
	BadSlots                uint64  `json:"bad_slots"`
	// RawSeqReadGBps reads the same slot file front to back with
	// O_DIRECT, RawReadBytes per read, RawReaders in flight: the faster
	// of a read just before the restart and one after the daemon stopped.
	RawSeqReadGBps       float64 `json:"raw_seq_read_gbps"`
	RawSeqReadBeforeGBps float64 `json:"raw_seq_read_before_gbps"`
	RawSeqReadAfterGBps  float64 `json:"raw_seq_read_after_gbps"`
	RawReadBytes         int     `json:"raw_read_bytes"`
	RawReaders           int     `json:"raw_readers"`
	RecoveryVsRawSeqRead float64 `json:"recovery_vs_raw_seq_read"`
	BlocksBack           int     `json:"blocks_back"`
	SampledByteExact     int     `json:"sampled_byte_exact"`
	// CPU is the same restart for the CPU tier alone with a persistent
	// arena (--cpu-arena-dir), killed with SIGKILL.
	CPU *CPURecovery `json:"cpu,omitempty"`
}

// CPURecovery is what a kill -9 and restart of a daemon whose CPU arena is
// a file that outlives it (--cpu-arena-dir) cost: SERVING at once, blocks
// back as they are verified.
type CPURecovery struct {
	ArenaBytes uint64 `json:"arena_bytes"`
	BlockBytes int    `json:"block_bytes"`
	Blocks     int    `json:"blocks"` // stored before the kill
	// From the exec of the restarted daemon: SERVING, the first Lookup
	// (of a sample of the keys, polled) that offers a block, and the end
	// of the recovery (kvoffload_cpu_recovery_state, polled).
	StartToServingMs        float64 `json:"start_to_serving_ms"`
	StartToFirstHitMs       float64 `json:"start_to_first_hit_ms"`
	StartToRecoveredSeconds float64 `json:"start_to_recovered_seconds"`
	RecoveryGBps            float64 `json:"recovery_gbps"` // payload bytes from SERVING to recovered
	BlocksRecovered         uint64  `json:"blocks_recovered"`
	// RawHash: xxh3 of the same payload bytes straight from the arena
	// file on one core, the least a verifying recovery must do.
	RawHashSeconds   float64 `json:"raw_hash_seconds"`
	RawHashGBps      float64 `json:"raw_hash_gbps"`
	BlocksBack       int     `json:"blocks_back"`
	SampledByteExact int     `json:"sampled_byte_exact"`
	Skipped          string  `json:"skipped,omitempty"`
}

// Faults is what the fault-injection scenario found.
type Faults struct {
	Spec     string `json:"spec"`
	Injected int    `json:"injected"`
	// InjectedByKind is the daemon's count of injected faults by kind.
	InjectedByKind map[string]int `json:"injected_by_kind"`
	// InjectedRead is read-eio + short-read + bitflip: the faults that
	// must each end as a failed block.
	InjectedRead         int `json:"injected_read"`
	BlocksFailedReported int `json:"blocks_failed_reported"`
	// ReadFailuresReported counts the load-job blocks reported IO_ERROR
	// or CORRUPT: at least one for every failed disk read.
	ReadFailuresReported int `json:"read_failures_reported"`
	// DaemonReadErrors is the daemon's own count of failed disk reads
	// (kvoffload_disk_errors_total), to tell a fault the daemon missed
	// from one it caught but did not report.
	DaemonReadErrors       int `json:"daemon_read_errors"`
	CorruptBlocksDelivered int `json:"corrupt_blocks_delivered"`
	FailedBlocksReoffered  int `json:"failed_blocks_reoffered"`
	// FailedButDelivered counts keys that failed in one job of a Load
	// and reached another job of the same Load intact (the daemon read
	// them twice); their later offers are not counted as re-offers.
	FailedButDelivered int `json:"failed_but_delivered_to_another_job"`
	// ExternalFlips is how many slots the corruption scenario damaged in
	// the disk file from outside the daemon.
	ExternalFlips int `json:"external_flips"`
	// ExternalCorruptReported is how many blocks that scenario saw
	// reported CORRUPT.
	ExternalCorruptReported int `json:"external_corrupt_reported"`
}

// SweepPoint is the fault scenario at one rate (rate 0: the disk
// scenario). Load is the steps' loads (CPU and disk hits mixed); DiskLoad
// the loads of blocks only on disk, where the faults are.
type SweepPoint struct {
	Rate          float64 `json:"rate"`
	Spec          string  `json:"spec"`
	LoadGBps      float64 `json:"load_gbps"`
	LoadP99us     float64 `json:"load_p99_us"`
	DiskLoadGBps  float64 `json:"disk_load_gbps"`
	DiskLoadP99us float64 `json:"disk_load_p99_us"`
	StoreGBps     float64 `json:"store_gbps"`
	Faults        Faults  `json:"faults"`
}

// Hybrid is one hybrid model (KV cache groups of different kinds) run
// through the daemon under two treatments of the same trace in the same
// run: windowed (each group as its kind needs) and all full attention.
type Hybrid struct {
	Model  string        `json:"model"`
	About  string        `json:"about"`
	Groups []HybridGroup `json:"groups"`
	// BlockTokens is every group's block size; UnitBytes one block of
	// every group, FullBytes of the full-attention groups.
	BlockTokens  int    `json:"block_tokens"`
	UnitBytes    int    `json:"unit_bytes"`
	FullBytes    int    `json:"full_bytes"`
	EngineBlocks int    `json:"engine_blocks"`
	Steps        int    `json:"steps"`
	Daemon       string `json:"daemon"`
	// Windowed and AllFull are the two treatments.
	Windowed HybridTreatment `json:"windowed"`
	AllFull  HybridTreatment `json:"all_full"`
	// Evicted is the blocks the daemon's policy dropped in the run, from
	// its metrics (nil: unknown).
	Evicted *float64 `json:"evicted"`
	// BytesPerHitTokenRatio is windowed over all-full bytes loaded per
	// hit token; BoundRatio the goal's ceiling (full layers' bytes +
	// window bytes per hit) over all-full's bytes, on the same hits.
	BytesPerHitTokenRatio *float64 `json:"bytes_per_hit_token_ratio"`
	BoundRatio            *float64 `json:"bound_ratio"`
	// LoadTimeRatio is windowed over all-full time spent in Loads, the
	// two measured step by step in the same run (a timing: noisy).
	LoadTimeRatio *float64 `json:"load_time_ratio"`
	// Interference and Flagged as on results, for the scenario's steps.
	Interference float64 `json:"interference"`
	Flagged      bool    `json:"flagged"`
}

// HybridGroup is one KV cache group of a hybrid.
type HybridGroup struct {
	Kind   string `json:"kind"`
	Layers int    `json:"layers"`
	// BlockBytes is one block over the group's regions; WindowBlocks the
	// blocks a hit needs at its end (0: every block from 0).
	BlockBytes   int `json:"block_bytes"`
	WindowBlocks int `json:"window_blocks"`
}

// HybridTreatment is one treatment's lookups, hits and transfers.
type HybridTreatment struct {
	Requests int     `json:"requests"`
	Hits     int     `json:"hits"`
	HitRate  float64 `json:"hit_rate"` // share of blocks (units) asked for that hit
	// HitTokens is the tokens of every hit.
	HitTokens int `json:"hit_tokens"`
	Lookups   int `json:"lookups"`
	// KeysLookedUp counts keys of every group; WindowKeys those of
	// windowed groups, OutsideWindow those not inside the window ending
	// at the request's hit (a miss has none); Retries the lookup rounds
	// after a request's first.
	KeysLookedUp  int `json:"keys_looked_up"`
	WindowKeys    int `json:"window_keys"`
	OutsideWindow int `json:"keys_outside_hit_window"`
	Retries       int `json:"retried_rounds"`
	// LoadBytes is what the daemon reported it moved; ExpectedBytes what
	// the hits need under the treatment; BoundBytes (full layers' bytes
	// + window bytes) per hit, summed.
	LoadBytes        uint64  `json:"load_bytes"`
	ExpectedBytes    uint64  `json:"expected_bytes"`
	BoundBytes       uint64  `json:"bound_bytes"`
	BytesPerHitToken float64 `json:"bytes_per_hit_token"`
	LoadBlocks       int     `json:"load_blocks"`
	LoadSeconds      float64 `json:"load_seconds"`
	LoadGBps         float64 `json:"load_gbps"`
	StoreBlocks      int     `json:"store_blocks"`
	StoreBytes       uint64  `json:"store_bytes"`
	// StoreSkipped counts windowed-group blocks no hit's window can
	// contain, not stored.
	StoreSkipped           int            `json:"store_skipped"`
	LoadFailed             map[string]int `json:"load_failed,omitempty"`
	StoreFailed            map[string]int `json:"store_failed,omitempty"`
	CorruptBlocksDelivered int            `json:"corrupt_blocks_delivered"`
	FailedBlocksReoffered  int            `json:"failed_blocks_reoffered"`
}

// Skip says what did not run, and why.
type Skip struct {
	What   string `json:"what"`
	Reason string `json:"reason"`
}

// Goal is one of issue 4's targets.
type Goal struct {
	Name   string   `json:"name"`
	Target string   `json:"target"`
	Value  *float64 `json:"value"`
	Met    *bool    `json:"met"` // nil: not measured
	// Note says what the value counts, where it needs saying.
	Note string `json:"note,omitempty"`
	// Flagged: a phase the value was measured in had other processes
	// above the interference threshold.
	Flagged bool `json:"flagged"`
}

// Mirror is one workload of the mirror scenario (issue 32): the same steps
// on a fresh daemon twice, each request's lookup a round trip to the
// daemon, then answered from a Go mirror of the daemon's WatchEvents
// stream (the Python connector's rules) with the daemon's Lookup still
// sent, and a plain Go map of the same keys, all timed per call.
type Mirror struct {
	Workload string `json:"workload"`
	Desc     string `json:"desc"`
	Requests int    `json:"requests"`
	// Answered in the step from the mirror; the others asked the daemon
	// (a step): not live, the hit stopped at a block stored < 1 s ago, or
	// short once the daemon had shown a remote tier.
	Answered      int     `json:"answered"`
	AnsweredShare float64 `json:"answered_share"`
	NotLive       int     `json:"not_live"`
	Recent        int     `json:"recent_store"`
	Remote        int     `json:"remote"`
	// Per lookup call, µs: the mirror, the plain map, the daemon's Lookup
	// in the same run.
	MirrorP50us float64 `json:"mirror_p50_us"`
	MirrorP99us float64 `json:"mirror_p99_us"`
	MapP50us    float64 `json:"map_p50_us"`
	MapP99us    float64 `json:"map_p99_us"`
	DaemonP50us float64 `json:"daemon_p50_us"`
	DaemonP99us float64 `json:"daemon_p99_us"`
	// Blocks the mirror offered; of them MISSING at their load (stale),
	// and the stale share (goal <= 0.001).
	Offered     int     `json:"offered"`
	OfferedDisk int     `json:"offered_disk"` // of them, in the disk tier only
	Stale       int     `json:"stale"`
	StaleRate   float64 `json:"stale_rate"`
	FailedOther int     `json:"failed_other"`
	// Against the daemon's answer right after: blocks offered past it,
	// blocks of it missed; offered blocks never stored (0); bytes wrong (0).
	Ahead        int `json:"ahead"`
	Behind       int `json:"behind"`
	RecentLonger int `json:"recent_longer"`
	Unknown      int `json:"unknown"`
	Corrupt      int `json:"corrupt_delivered"`
	// Hit rates (blocks offered / looked up): this run, and the run whose
	// every lookup was the daemon's; the daemon run's failed-load share.
	HitRate          float64 `json:"hit_rate"`
	DaemonHitRate    float64 `json:"daemon_hit_rate"`
	DaemonFailedRate float64 `json:"daemon_failed_rate"`
	MirrorBlocks     int     `json:"mirror_blocks"`
	MirrorStreams    int     `json:"mirror_streams"`
}

// Scale is one N of the scale scenario (issue 34): N small blocks stored by
// concurrent ranks into a CPU tier with room for 2N, then over a disk tier
// with room for N, which is killed (-9) and recovered.
type Scale struct {
	Blocks     int `json:"blocks"`
	BlockBytes int `json:"block_bytes"`
	Ranks      int `json:"ranks"`
	// CPU tier only; CPUFailed is the phase's error (its figures then say
	// nothing).
	CPUFailed         string  `json:"cpu_failed,omitempty"`
	CPUBytes          uint64  `json:"cpu_bytes"`
	CPUStoredOK       int     `json:"cpu_stored_ok"`
	CPUNoSpace        int     `json:"cpu_no_space"`
	CPUStoreSeconds   float64 `json:"cpu_store_seconds"`
	CPUHeld           int     `json:"cpu_held"`
	CPUEvictions      int     `json:"cpu_evictions"`
	CPULostWhileRoom  int     `json:"cpu_lost_while_room"`
	StatsP50Ms        float64 `json:"stats_p50_ms"`
	StatsMaxMs        float64 `json:"stats_max_ms"`
	HeapBytesPerBlock float64 `json:"heap_bytes_per_block"`
	RSSBytesPerBlock  float64 `json:"rss_bytes_per_block"`
	// Lookups of 16 blocks idle and while a WatchEvents snapshot of every
	// block is read (issue 34, item 3), pooled over the snapshots.
	SnapshotBlocks           int       `json:"snapshot_blocks,omitempty"`
	SnapshotSeconds          []float64 `json:"snapshot_seconds,omitempty"`
	LookupsIdle              int       `json:"lookups_idle,omitempty"`
	LookupsDuring            int       `json:"lookups_during,omitempty"`
	LookupIdleP50Ms          float64   `json:"lookup_idle_p50_ms,omitempty"`
	LookupIdleP99Ms          float64   `json:"lookup_idle_p99_ms,omitempty"`
	LookupSnapP50Ms          float64   `json:"lookup_snapshot_p50_ms,omitempty"`
	LookupSnapP99Ms          float64   `json:"lookup_snapshot_p99_ms,omitempty"`
	LookupSnapP99Ratio       float64   `json:"lookup_snapshot_p99_ratio,omitempty"`
	SnapshotRSSBytesPerBlock float64   `json:"snapshot_rss_bytes_per_block"`
	SnapshotFailed           string    `json:"snapshot_failed,omitempty"`
	// Over a disk tier; DiskSkipped says why not, DiskFailed the phase's
	// error.
	DiskSkipped           string  `json:"disk_skipped,omitempty"`
	DiskFailed            string  `json:"disk_failed,omitempty"`
	DiskBytes             uint64  `json:"disk_bytes"`
	DiskStoredOK          int     `json:"disk_stored_ok"`
	DiskNoSpace           int     `json:"disk_no_space"`
	DiskStoreSeconds      float64 `json:"disk_store_seconds"`
	DiskHeld              int     `json:"disk_held"`
	DiskOnDisk            int     `json:"disk_on_disk"`
	DiskDropped           int     `json:"disk_dropped"`
	DiskLost              int     `json:"disk_lost"`
	DiskHeapBytesPerBlock float64 `json:"disk_heap_bytes_per_block"`
	RestartToServingMs    float64 `json:"restart_to_serving_ms"`
	RecoverySeconds       float64 `json:"recovery_seconds"`
	RecoveredBlocks       int     `json:"recovered_blocks"`
	BadSlots              int     `json:"bad_slots"`
	RecoveryGBps          float64 `json:"recovery_gbps"`
	RawSeqReadGBps        float64 `json:"raw_seq_read_gbps"`
	RecoveryVsRaw         float64 `json:"recovery_vs_raw"`
	RecoveryCPUusPerBlock float64 `json:"recovery_cpu_us_per_block"`
}

// fmtSeconds writes durations in seconds, slash-separated.
func fmtSeconds(s []float64) string {
	var b strings.Builder
	for i, v := range s {
		if i > 0 {
			b.WriteByte('/')
		}
		fmt.Fprintf(&b, "%.2f", v)
	}
	return b.String()
}

// F returns a pointer to v, for the optional fields.
func F(v float64) *float64 { return &v }

// Ratio is a/b, nil when either is missing or b is zero.
func Ratio(a, b *float64) *float64 {
	if a == nil || b == nil || *b == 0 {
		return nil
	}
	return F(*a / *b)
}

// Find returns the result of scenario and op.
func (r *Report) Find(scenario, op string) *Result {
	for i := range r.Results {
		if r.Results[i].Scenario == scenario && r.Results[i].Op == op {
			return &r.Results[i]
		}
	}
	return nil
}

// WriteJSON writes the report to path.
func (r *Report) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

func opt(v *float64, format string) string {
	if v == nil {
		return "skipped"
	}
	return fmt.Sprintf(format, *v)
}

// Print writes the readable report.
func (r *Report) Print(w io.Writer) {
	fmt.Fprintf(w, "kvbench %s\n", Schema)
	fmt.Fprintf(w, "reproduce: %s\n", r.Command)
	fmt.Fprintf(w, "machine:   %s\n", r.Machine)
	fmt.Fprintf(w, "model:     %s, %d blocks of %d KiB, %d engine blocks, %d steps per scenario\n",
		r.Model.Name, r.Model.Segments, r.Model.SegmentBytes>>10, r.Model.EngineBlocks, r.Model.StepsPerScenario)
	fmt.Fprintf(w, "daemon:    %s\n\n", r.Daemon)

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\top\tGB/s\tblocks\tp50 µs\tp99 µs\thit cpu\thit disk\thit remote\tlru\tbelady\tfailed\tcorrupt\treoffered\tother cpu\t")
	for _, x := range r.Results {
		hc, hd, hr, hl, hb := "", "", "", "", ""
		if x.HitRate != nil {
			hc, hd, hr = fmt.Sprintf("%.1f%%", 100*x.HitRate["cpu"]), fmt.Sprintf("%.1f%%", 100*x.HitRate["disk"]), fmt.Sprintf("%.1f%%", 100*x.HitRate["remote"])
		}
		if x.HitRateLRU != nil && x.HitRateBelady != nil {
			hl, hb = fmt.Sprintf("%.1f%%", 100**x.HitRateLRU), fmt.Sprintf("%.1f%%", 100**x.HitRateBelady)
		}
		gb := fmt.Sprintf("%.2f", x.GBps)
		if strings.HasPrefix(x.Op, "lookup") || strings.HasPrefix(x.Op, "empty") {
			gb = "-"
		}
		other := fmt.Sprintf("%.0f%%", 100*x.Interference)
		if x.Flagged {
			other += " !"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%.0f\t%.0f\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%s\t\n", x.Scenario, x.Op, gb, x.Blocks, x.P50us, x.P99us,
			hc, hd, hr, hl, hb, failedString(x.Failed), x.CorruptBlocksDelivered, x.FailedBlocksReoffered, other)
	}
	tw.Flush()

	b := r.Baselines
	fmt.Fprintf(w, "\nbaselines (same run, %s blocks):\n", sizeString(b.IOBytes))
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "  memcpy (Go copy, %d workers)\t%s GB/s\n", b.Workers, opt(b.MemcpyGBps, "%.2f"))
	fmt.Fprintf(tw, "  memcpy in %s segments, scattered\t%s GB/s\n", sizeString(b.SegmentBytes), opt(b.MemcpySegmentGBps, "%.2f"))
	fmt.Fprintf(tw, "  O_DIRECT read / write (%s I/Os, QD %d)\t%s / %s GB/s\n", sizeString(b.ODirectIOBytes), b.QueueDepth, opt(b.ODirectReadGBps, "%.2f"), opt(b.ODirectWriteGBps, "%.2f"))
	fmt.Fprintf(tw, "  empty gRPC round trip p50 / p99\t%s / %s µs\n", opt(b.GRPCEmptyP50us, "%.0f"), opt(b.GRPCEmptyP99us, "%.0f"))
	fmt.Fprintf(tw, "  Redis GET / SET (%d conns)\t%s / %s GB/s\n", b.Workers, opt(b.RedisGetGBps, "%.2f"), opt(b.RedisSetGBps, "%.2f"))
	fmt.Fprintf(tw, "  same segments as cpu loads / stores, same steps, another process\t%s / %s GB/s\n", opt(b.SegmentCopyLoadGBps, "%.2f"), opt(b.SegmentCopyStoreGBps, "%.2f"))
	fmt.Fprintf(tw, "  the same in kvbench's own process\t%s / %s GB/s\n", opt(b.SegmentCopyOwnLoadGBps, "%.2f"), opt(b.SegmentCopyOwnStoreGBps, "%.2f"))
	if t := b.TierRead; t != nil {
		fmt.Fprintf(tw, "  O_DIRECT, tier pattern, disk scenario's slots before / after its disk loads\t%.2f / %.2f GB/s (%d slots, bursts of %d, QD %d; burst p50 %.0f p99 %.0f µs)\n",
			t.BeforeGBps, t.AfterGBps, t.Blocks, t.Burst, t.QueueDepth, t.BurstP50us, t.BurstP99us)
	} else {
		fmt.Fprintf(tw, "  O_DIRECT, tier pattern\tskipped\n")
	}
	fmt.Fprintf(tw, "  empty gRPC during cpu transfers p50 / p99\t%s / %s µs\n", opt(b.GRPCEmptyBusyP50us, "%.0f"), opt(b.GRPCEmptyBusyP99us, "%.0f"))
	fmt.Fprintf(tw, "  Redis Cluster raw GET of the remote blocks (%d values), p99\t%s GB/s, %s µs\n", b.RedisClusterBlocks, opt(b.RedisClusterGetGBps, "%.2f"), opt(b.RedisClusterGetP99us, "%.0f"))
	tw.Flush()

	q := r.Ratios
	fmt.Fprintf(w, "\nratios:\n")
	for _, x := range []struct {
		name string
		v    *float64
	}{
		{"cpu_load_vs_memcpy", q.CPULoadVsMemcpy},
		{"cpu_store_vs_memcpy", q.CPUStoreVsMemcpy},
		{"disk_load_vs_odirect_read", q.DiskLoadVsODirectRead},
		{"disk_store_vs_odirect_write", q.DiskStoreVsODirectWrite},
		{"cpu_load_vs_redis_get", q.CPULoadVsRedisGet},
		{"lookup_p99_vs_grpc_empty_p99", q.LookupP99VsGRPCEmptyP99},
		{"cpu_load_vs_segment_copy", q.CPULoadVsSegmentCopy},
		{"cpu_store_vs_segment_copy", q.CPUStoreVsSegmentCopy},
		{"cpu_load_vs_own_segment_copy", q.CPULoadVsOwnSegmentCopy},
		{"cpu_store_vs_own_segment_copy", q.CPUStoreVsOwnSegmentCopy},
		{"segment_copy_vs_own_load", q.SegmentCopyVsOwnLoad},
		{"segment_copy_vs_own_store", q.SegmentCopyVsOwnStore},
		{"disk_load_vs_tier_read", q.DiskLoadVsTierRead},
		{"disk_load_p99_vs_raw_step_p99", q.DiskLoadP99VsRawStepP99},
		{"lookup_busy_p99_vs_grpc_empty_p99", q.LookupBusyP99VsGRPCEmptyP99},
		{"lookup_busy_p99_vs_empty_busy_p99", q.LookupBusyP99VsEmptyBusyP99},
		{"lookup_idle_p99_vs_grpc_empty_p99", q.LookupIdleP99VsGRPCEmptyP99},
		{"remote_load_vs_cluster_get", q.RemoteLoadVsClusterGet},
	} {
		fmt.Fprintf(w, "  %-34s %s\n", x.name, opt(x.v, "%.2f"))
	}
	if rg := q.DiskLoadVsTierReadRange; len(rg) == 2 {
		fmt.Fprintf(w, "  %-34s %.2f-%.2f\n", "disk_load_vs_tier_read (range)", rg[0], rg[1])
	}

	if f := r.Faults; f != nil {
		fmt.Fprintf(w, "\nfaults (%s):\n  injected %d (%s), read faults %d; blocks failed reported %d, of them IO_ERROR or CORRUPT %d (the daemon counted %d failed reads)\n  corrupt blocks delivered %d; failed blocks re-offered %d (%d failed in one job and reached another intact)\n",
			f.Spec, f.Injected, failedString(f.InjectedByKind), f.InjectedRead, f.BlocksFailedReported, f.ReadFailuresReported, f.DaemonReadErrors,
			f.CorruptBlocksDelivered, f.FailedBlocksReoffered, f.FailedButDelivered)
		if f.ExternalFlips > 0 {
			fmt.Fprintf(w, "external corruption: %d slots damaged, %d loads reported CORRUPT\n", f.ExternalFlips, f.ExternalCorruptReported)
		}
	}
	if len(r.Sweep) > 0 {
		fmt.Fprintf(w, "\nfault sweep:\n")
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "read fault rate\tload GB/s\tload p99 µs\tdisk load GB/s\tdisk load p99 µs\tstore GB/s\tread faults\tread failures\tcorrupt\treoffered\t")
		for _, p := range r.Sweep {
			fmt.Fprintf(tw, "%g\t%.2f\t%.0f\t%.2f\t%.0f\t%.2f\t%d\t%d\t%d\t%d\t\n", p.Rate, p.LoadGBps, p.LoadP99us, p.DiskLoadGBps, p.DiskLoadP99us, p.StoreGBps,
				p.Faults.InjectedRead, p.Faults.ReadFailuresReported, p.Faults.CorruptBlocksDelivered, p.Faults.FailedBlocksReoffered)
		}
		tw.Flush()
	}
	if len(r.Mirror) > 0 {
		fmt.Fprintf(w, "\nmirror (each workload twice on a fresh daemon: lookups to the daemon, then from a Go mirror of its WatchEvents stream with the daemon's Lookup still sent; per call µs p50/p99):\n")
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "workload\trequests\tin the step\tnot live\trecent (longer)\tremote\tmirror us\tmap us\tdaemon us\toffered (disk)\tstale (<=0.1%)\tahead/behind\tunknown (0)\tcorrupt (0)\thit rate\tdaemon run: hit rate\tfailed at load\t")
		for _, m := range r.Mirror {
			fmt.Fprintf(tw, "%s\t%d\t%.1f%%\t%d\t%d (%d)\t%d\t%.2f/%.2f\t%.2f/%.2f\t%.0f/%.0f\t%d (%d)\t%d (%.3f%%)\t%d/%d\t%d\t%d\t%.3f\t%.3f\t%.3f%%\t\n",
				m.Workload, m.Requests, 100*m.AnsweredShare, m.NotLive, m.Recent, m.RecentLonger, m.Remote, m.MirrorP50us, m.MirrorP99us, m.MapP50us, m.MapP99us,
				m.DaemonP50us, m.DaemonP99us, m.Offered, m.OfferedDisk, m.Stale, 100*m.StaleRate, m.Ahead, m.Behind, m.Unknown, m.Corrupt, m.HitRate, m.DaemonHitRate, 100*m.DaemonFailedRate)
		}
		tw.Flush()
	}
	if len(r.Scale) > 0 {
		fmt.Fprintf(w, "\nscale (%d-byte blocks, %d ranks storing at once; CPU tier with room for 2N (what memory allows, at least 9N/8), then a CPU tier of N/8 blocks (16-64 MiB) over a disk tier with room for N, kill -9, recovery):\n", r.Scale[0].BlockBytes, r.Scale[0].Ranks)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "N\tstored\tlost with room (0)\tStats p50/max ms\theap B/block (<=150)\tanon RSS B/block\tdisk: stored\tNO_SPACE\tdropped (0)\tlost (0)\ton disk\theap B/block (<=150)\tSERVING ms\trecovered\tbad\trecovery s\tGB/s\traw GB/s\t/raw (>=0.5)\tCPU us/block\t")
		for _, sc := range r.Scale {
			if sc.CPUFailed != "" {
				fmt.Fprintf(tw, "%d\tfailed\t\t\t\t\t", sc.Blocks)
			} else {
				fmt.Fprintf(tw, "%d\t%d\t%d\t%.2f/%.2f\t%.0f\t%.0f\t", sc.Blocks, sc.CPUStoredOK, sc.CPULostWhileRoom, sc.StatsP50Ms, sc.StatsMaxMs, sc.HeapBytesPerBlock, sc.RSSBytesPerBlock)
			}
			if sc.DiskSkipped != "" {
				fmt.Fprintf(tw, "skipped: %s\t\n", sc.DiskSkipped)
				continue
			}
			if sc.DiskFailed != "" {
				fmt.Fprintf(tw, "failed\t\n")
				continue
			}
			fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d\t%.0f\t%.0f\t%d\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.1f\t\n", sc.DiskStoredOK, sc.DiskNoSpace, sc.DiskDropped, sc.DiskLost, sc.DiskOnDisk,
				sc.DiskHeapBytesPerBlock, sc.RestartToServingMs, sc.RecoveredBlocks, sc.BadSlots, sc.RecoverySeconds, sc.RecoveryGBps, sc.RawSeqReadGBps, sc.RecoveryVsRaw, sc.RecoveryCPUusPerBlock)
		}
		tw.Flush()
		if len(r.Scale[0].SnapshotSeconds) > 0 {
			fmt.Fprintf(w, "\nscale: an engine's Lookups of 16 blocks, idle and while a router reads a WatchEvents snapshot of every block (CPU tier):\n")
			tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "N\tsnapshot blocks\tsnapshot s\tLookups idle/during\tidle p50/p99 ms\tduring p50/p99 ms\tp99 during/idle (<=3)\tRSS growth B/block\t")
			for _, sc := range r.Scale {
				fmt.Fprintf(tw, "%d\t%d\t%s\t%d/%d\t%.2f/%.2f\t%.2f/%.2f\t%.2f\t%.0f\t\n", sc.Blocks, sc.SnapshotBlocks, fmtSeconds(sc.SnapshotSeconds), sc.LookupsIdle, sc.LookupsDuring,
					sc.LookupIdleP50Ms, sc.LookupIdleP99Ms, sc.LookupSnapP50Ms, sc.LookupSnapP99Ms, sc.LookupSnapP99Ratio, sc.SnapshotRSSBytesPerBlock)
			}
			tw.Flush()
		}
	}
	if rc := r.Recovery; rc != nil {
		fmt.Fprintf(w, "\nrestart (disk tier %s, %d blocks of %s on it):\n", sizeString(int(rc.DiskBytes)), rc.Blocks, sizeString(rc.BlockBytes))
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintf(tw, "  start to SERVING\t%.0f ms (%.0f ms on the empty tier: same flags, %s CPU tier)\n", rc.StartToServingMs, rc.EmptyStartToServingMs, sizeString(int(rc.CPUBytes)))
		fmt.Fprintf(tw, "  of it, the disk tier's open to SERVING\t%.0f ms (daemon log)\n", rc.DiskOpenToServingMs)
		fmt.Fprintf(tw, "  background recovery\t%.2f s (%.2f s from the start), %s read at %.2f GB/s, %d blocks back, %d bad slots\n",
			rc.RecoverySeconds, rc.StartToRecoveredSeconds, sizeString(int(rc.BytesScanned)), rc.RecoveryGBps, rc.BlocksRecovered, rc.BadSlots)
		fmt.Fprintf(tw, "  raw sequential read of the slot file\t%.2f GB/s (O_DIRECT, %s reads, %d in flight; %.2f before the restart, %.2f after)\n",
			rc.RawSeqReadGBps, sizeString(rc.RawReadBytes), rc.RawReaders, rc.RawSeqReadBeforeGBps, rc.RawSeqReadAfterGBps)
		fmt.Fprintf(tw, "  recovery / raw read\t%.2f\n", rc.RecoveryVsRawSeqRead)
		if rc.RecoveryGBps > 0 {
			fmt.Fprintf(tw, "  at this rate, one device full\t1 TB in %.1f min, 4 TB in %.1f min (each --disk-dir device recovers in parallel)\n",
				1e12/rc.RecoveryGBps/1e9/60, 4e12/rc.RecoveryGBps/1e9/60)
		}
		fmt.Fprintf(tw, "  after recovery\t%d of %d blocks offered, %d sampled loaded byte-exact\n", rc.BlocksBack, rc.Blocks, rc.SampledByteExact)
		tw.Flush()
		if c := rc.CPU; c != nil && c.Skipped != "" {
			fmt.Fprintf(w, "restart of the CPU tier with a persistent arena: skipped (%s)\n", c.Skipped)
		} else if c != nil {
			fmt.Fprintf(w, "restart of the CPU tier alone, arena %s in --cpu-arena-dir, %d blocks of %s, kill -9:\n", sizeString(int(c.ArenaBytes)), c.Blocks, sizeString(c.BlockBytes))
			tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
			fmt.Fprintf(tw, "  start to SERVING\t%.0f ms\n", c.StartToServingMs)
			fmt.Fprintf(tw, "  start to the first hit\t%.0f ms\n", c.StartToFirstHitMs)
			fmt.Fprintf(tw, "  start to every block recovered\t%.2f s (%.2f GB/s after SERVING), %d blocks back\n", c.StartToRecoveredSeconds, c.RecoveryGBps, c.BlocksRecovered)
			fmt.Fprintf(tw, "  raw hash of the payloads from the file\t%.2f s (%.2f GB/s, one core)\n", c.RawHashSeconds, c.RawHashGBps)
			fmt.Fprintf(tw, "  after recovery\t%d of %d blocks offered, %d sampled loaded byte-exact\n", c.BlocksBack, c.Blocks, c.SampledByteExact)
			tw.Flush()
		}
	}
	for _, h := range r.Hybrid {
		fmt.Fprintf(w, "\nhybrid %s: %s; %d steps, %s\n", h.Model, h.About, h.Steps, h.Daemon)
		for i, g := range h.Groups {
			win := "every block from 0"
			if g.WindowBlocks > 0 {
				win = fmt.Sprintf("%d blocks at a hit's end", g.WindowBlocks)
			}
			fmt.Fprintf(w, "  group %d: %s, %d layers, %s per %d-token block, needs %s\n", i, g.Kind, g.Layers, sizeString(g.BlockBytes), h.BlockTokens, win)
		}
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "treatment\thit rate\thits\tlookups\tkeys\twindow keys\toutside window\tretries\tloaded\tbytes/hit token\tload GB/s\tstored blocks\tskipped\tfailed\tcorrupt\treoffered\t")
		for _, x := range []struct {
			name string
			t    HybridTreatment
		}{{"windowed", h.Windowed}, {"all-full", h.AllFull}} {
			t := x.t
			fmt.Fprintf(tw, "%s\t%.1f%%\t%d/%d\t%d\t%d\t%d\t%d\t%d\t%s\t%.0f\t%.2f\t%d\t%d\t%s\t%d\t%d\t\n", x.name, 100*t.HitRate, t.Hits, t.Requests,
				t.Lookups, t.KeysLookedUp, t.WindowKeys, t.OutsideWindow, t.Retries, sizeString64(t.LoadBytes), t.BytesPerHitToken, t.LoadGBps,
				t.StoreBlocks, t.StoreSkipped, failedString(merged(t.LoadFailed, t.StoreFailed)), t.CorruptBlocksDelivered, t.FailedBlocksReoffered)
		}
		tw.Flush()
		mark := ""
		if h.Flagged {
			mark = fmt.Sprintf(" (other processes took %.0f%% of the CPU: timing suspect)", 100*h.Interference)
		}
		fmt.Fprintf(w, "  windowed / all-full bytes per hit token %s (ceiling: full layers' + window bytes per hit, %s); load time %s%s\n",
			opt(h.BytesPerHitTokenRatio, "%.3f"), opt(h.BoundRatio, "%.3f"), opt(h.LoadTimeRatio, "%.3f"), mark)
	}
	if len(r.Goals) > 0 {
		fmt.Fprintf(w, "\ngoals:\n")
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, g := range r.Goals {
			state := "not measured"
			if g.Met != nil {
				state = map[bool]string{true: "met", false: "NOT met"}[*g.Met]
			}
			if g.Flagged {
				state += " (interference)"
			}
			fmt.Fprintf(tw, "  %s %s\t%s\t%s\t%s\n", g.Name, g.Target, opt(g.Value, "%.2f"), state, g.Note)
		}
		tw.Flush()
	}
	if in := r.Interference; in != nil && len(in.Phases) > 0 {
		fmt.Fprintf(w, "\ninterference (other processes' share of the machine's CPU time; ! above %.0f%%):\n", 100*in.Threshold)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "phase\tseconds\tother\tsteal\tkvbench+daemon\tload1\t\t")
		for _, p := range in.Phases {
			mark := ""
			if p.Flagged {
				mark = "!"
			}
			fmt.Fprintf(tw, "%s\t%.1f\t%.0f%%\t%.0f%%\t%.0f%%\t%.1f\t%s\t\n", p.Name, p.Seconds, 100*p.OtherCPUShare, 100*p.StealShare, 100*p.OwnCPUShare, p.Load1, mark)
		}
		tw.Flush()
	}
	for _, s := range r.Skipped {
		fmt.Fprintf(w, "skipped: %s: %s\n", s.What, s.Reason)
	}
}

func failedString(m map[string]int) string {
	var parts []string
	for _, k := range sortedKeys(m) {
		if m[k] > 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", strings.ToLower(k), m[k]))
		}
	}
	if len(parts) == 0 {
		return "0"
	}
	return strings.Join(parts, ",")
}

// merged adds two counts by status.
func merged(a, b map[string]int) map[string]int {
	out := map[string]int{}
	for k, v := range a {
		out[k] += v
	}
	for k, v := range b {
		out[k] += v
	}
	return out
}

// sizeString64 prints a byte count in binary units, two decimals.
func sizeString64(n uint64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.2f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func sizeString(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}
