package events

import (
	"encoding/binary"
	"math"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// The vLLM KV event format, as vllm/distributed/kv_events.py (vLLM main,
// commit 7cfb97e33791, 2026-08-20) has msgspec encode it to msgpack: a
// KVEventBatch is the array [ts, events, data_parallel_rank]; each event
// is a map whose first key, "type", names its class, then its fields in
// declaration order, those left at their default omitted:
//
//	BlockStored:      block_hashes, parent_block_hash, token_ids, block_size,
//	                  lora_id, medium, lora_name, (extra_keys), group_idx,
//	                  (kv_cache_spec_kind, kv_cache_spec_sliding_window),
//	                  locality
//	BlockRemoved:     block_hashes, medium, group_idx, locality
//	AllBlocksCleared: (no field)
//
// medium is one of vLLM's MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE ("GPU",
// "CPU", "STORAGE"), locality "LOCAL" or "REMOTE" relative to the
// publisher. The daemon adds namespace_id, last: which engine identity the
// block belongs to (msgspec's decoders, vLLM's, skip a key a struct does
// not declare, and the extra trailing element of an array).
//
// vLLM up to 0.23 encoded each event as an array instead (msgspec
// array_like: the class name, then every field in order, trailing
// defaults omitted); FormatArray writes that. docs/events.md has the
// layout a router decodes.

// Format is how an event is laid out in a batch.
type Format uint8

const (
	// FormatMap: a map keyed by field name (vLLM main).
	FormatMap Format = iota
	// FormatArray: a positional array (vLLM up to 0.23).
	FormatArray
)

// VLLM turns events into vLLM KVEventBatch payloads.
type VLLM struct {
	Format Format
	// BlockSize is BlockStored's block_size: the engine's tokens per
	// block (the daemon does not know it).
	BlockSize int
	// BytesHashes sends each hash as the bytes the client sent, as vLLM
	// does with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0. By default a hash
	// is its last 8 bytes read big-endian, an unsigned int, as vLLM sends
	// it by default.
	BytesHashes bool
}

// vLLM's media and localities (vllm/distributed/kv_events.py,
// vllm/v1/kv_offload/base.py).
const (
	MediumCPU      = "CPU"
	MediumStorage  = "STORAGE"
	LocalityLocal  = "LOCAL"
	LocalityRemote = "REMOTE"
)

// Medium names a tier as vLLM's medium field does: the CPU tier is CPU,
// the disk tier STORAGE, both this node's (LOCAL); the shared remote tier
// is STORAGE, REMOTE.
func Medium(t index.Tiers) (medium, locality string) {
	switch t {
	case index.InDisk:
		return MediumStorage, LocalityLocal
	case Remote:
		return MediumStorage, LocalityRemote
	}
	return MediumCPU, LocalityLocal
}

// AppendBatch appends the msgpack KVEventBatch of evs taken at ts (Unix
// seconds) to dst, and reports how many vLLM events it holds (0: nothing
// to publish; markers other than Cleared have no vLLM form). A run of
// events of one kind, tier, namespace and group is one vLLM event with
// many block hashes.
func (v VLLM) AppendBatch(dst []byte, ts float64, evs []Event) ([]byte, int) {
	n := 0
	for i := range evs {
		if evs[i].Kind == Cleared || ((evs[i].Kind == Stored || evs[i].Kind == Removed) && (i == 0 || !sameRun(&evs[i-1], &evs[i]))) {
			n++
		}
	}
	if n == 0 {
		return dst, 0
	}
	dst = append(dst, 0x93) // [ts, events, data_parallel_rank]
	dst = append(dst, 0xcb)
	dst = binary.BigEndian.AppendUint64(dst, math.Float64bits(ts))
	dst = appendArray(dst, n)
	for i := 0; i < len(evs); {
		e := &evs[i]
		switch e.Kind {
		case Cleared:
			dst = v.header(dst, "AllBlocksCleared", 0)
			i++
			continue
		case Stored, Removed:
		default:
			i++
			continue
		}
		j := i + 1
		for j < len(evs) && sameRun(&evs[j-1], &evs[j]) {
			j++
		}
		run := evs[i:j]
		i = j
		medium, locality := Medium(e.Tier)
		if e.Kind == Stored {
			dst = v.header(dst, "BlockStored", 10)
			dst = v.field(dst, "block_hashes")
			dst = v.hashes(dst, run)
			dst = v.field(dst, "parent_block_hash")
			dst = append(dst, 0xc0)
			dst = v.field(dst, "token_ids")
			dst = append(dst, 0x90)
			dst = v.field(dst, "block_size")
			dst = appendUint(dst, uint64(v.BlockSize))
			dst = v.field(dst, "lora_id")
			dst = append(dst, 0xc0)
			dst = v.field(dst, "medium")
			dst = appendStr(dst, medium)
			dst = v.field(dst, "lora_name")
			dst = append(dst, 0xc0)
			if v.Format == FormatArray {
				dst = append(dst, 0xc0) // extra_keys, before group_idx
			}
			dst = v.field(dst, "group_idx")
			dst = appendUint(dst, uint64(e.Key.Group))
			if v.Format == FormatArray {
				// kv_cache_spec_kind, kv_cache_spec_sliding_window: the
				// daemon does not know a group's kind.
				dst = append(dst, 0xc0, 0xc0)
			}
			dst = v.field(dst, "locality")
			dst = appendStr(dst, locality)
			dst = v.field(dst, "namespace_id")
			dst = appendUint(dst, uint64(e.Key.NS))
			continue
		}
		dst = v.header(dst, "BlockRemoved", 5)
		dst = v.field(dst, "block_hashes")
		dst = v.hashes(dst, run)
		dst = v.field(dst, "medium")
		dst = appendStr(dst, medium)
		dst = v.field(dst, "group_idx")
		dst = appendUint(dst, uint64(e.Key.Group))
		dst = v.field(dst, "locality")
		dst = appendStr(dst, locality)
		dst = v.field(dst, "namespace_id")
		dst = appendUint(dst, uint64(e.Key.NS))
	}
	return append(dst, 0x00), n // data_parallel_rank 0
}

// sameRun reports whether b continues a's vLLM event.
func sameRun(a, b *Event) bool {
	return a.Kind == b.Kind && (a.Kind == Stored || a.Kind == Removed) && a.Tier == b.Tier && a.Key.NS == b.Key.NS && a.Key.Group == b.Key.Group
}

// header starts an event of class tag with fields fields (BlockStored's
// array form carries three more: extra_keys, kv_cache_spec_kind and
// kv_cache_spec_sliding_window, all nil).
func (v VLLM) header(dst []byte, tag string, fields int) []byte {
	if v.Format == FormatArray {
		if tag == "BlockStored" {
			fields += 3
		}
		dst = appendArray(dst, 1+fields)
		return appendStr(dst, tag)
	}
	dst = append(dst, 0x80|byte(1+fields)) // fixmap
	dst = appendStr(dst, "type")
	return appendStr(dst, tag)
}

// field names the next field (a map key; nothing in an array).
func (v VLLM) field(dst []byte, name string) []byte {
	if v.Format == FormatArray {
		return dst
	}
	return appendStr(dst, name)
}

func (v VLLM) hashes(dst []byte, run []Event) []byte {
	dst = appendArray(dst, len(run))
	for i := range run {
		h := run[i].Hash()
		if v.BytesHashes {
			dst = appendBin(dst, h)
			continue
		}
		// The last 8 bytes; fewer (a hash length the hub was never told)
		// are read as the low bytes, never past the start.
		var b [8]byte
		copy(b[8-min(8, len(h)):], h[max(0, len(h)-8):])
		dst = appendUint(dst, binary.BigEndian.Uint64(b[:]))
	}
	return dst
}

// msgpack, the few types a batch needs, each in its shortest form (as
// msgspec writes them).

func appendArray(dst []byte, n int) []byte {
	switch {
	case n < 16:
		return append(dst, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(dst, 0xdd), uint32(n))
}

func appendStr(dst []byte, s string) []byte {
	if len(s) < 32 {
		dst = append(dst, 0xa0|byte(len(s)))
	} else {
		dst = append(dst, 0xd9, byte(len(s))) // names here are short
	}
	return append(dst, s...)
}

func appendBin(dst []byte, b []byte) []byte {
	return append(append(dst, 0xc4, byte(len(b))), b...) // hashes are 16 or 32 bytes
}

func appendUint(dst []byte, u uint64) []byte {
	switch {
	case u < 128:
		return append(dst, byte(u))
	case u <= math.MaxUint8:
		return append(dst, 0xcc, byte(u))
	case u <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xcd), uint16(u))
	case u <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(dst, 0xce), uint32(u))
	}
	return binary.BigEndian.AppendUint64(append(dst, 0xcf), u)
}
