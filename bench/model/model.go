// Package model owns the synthetic engine KV cache that kvbench registers
// with the daemon: the shape of a model's KV blocks (layers, K and V, block
// tokens, heads, dtype), the /dev/shm region that stands in for GPU memory,
// and the bytes of a block, which are a pure function of its key so that
// every load can be checked byte for byte.
package model

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"

	"golang.org/x/sys/unix"

	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// HashBytes is the length of a block key: vLLM's sha256 block hashes.
const HashBytes = 32

// Shape is the KV cache geometry of one model, for one GPU.
type Shape struct {
	Name        string
	Layers      int
	BlockTokens int
	KVHeads     int
	HeadDim     int
	DTypeBytes  int
}

// Presets are shaped like real models served by vLLM (one GPU's share).
var Presets = map[string]Shape{
	"llama-8b":  {Name: "llama-8b", Layers: 32, BlockTokens: 16, KVHeads: 8, HeadDim: 128, DTypeBytes: 2},
	"llama-70b": {Name: "llama-70b", Layers: 80, BlockTokens: 16, KVHeads: 8, HeadDim: 128, DTypeBytes: 2},
}

// Segments is the number of regions: K and V of every layer are separate,
// as in vLLM's per-layer [2, blocks, tokens, heads, dim] tensors.
func (s Shape) Segments() int { return 2 * s.Layers }

// SegmentBytes is one block's bytes in one region.
func (s Shape) SegmentBytes() int { return s.BlockTokens * s.KVHeads * s.HeadDim * s.DTypeBytes }

// BlockBytes is one engine block over all regions: what the daemon stores.
func (s Shape) BlockBytes() int { return s.Segments() * s.SegmentBytes() }

// Validate refuses shapes the daemon or this package cannot handle.
func (s Shape) Validate() error {
	if s.Layers < 1 || s.Layers > 1024 || s.BlockTokens < 1 || s.BlockTokens > 4096 ||
		s.KVHeads < 1 || s.KVHeads > 1024 || s.HeadDim < 1 || s.HeadDim > 4096 ||
		s.DTypeBytes < 1 || s.DTypeBytes > 8 {
		return fmt.Errorf("model shape %+v: every dimension must be positive (layers ≤ 1024, tokens ≤ 4096, heads ≤ 1024, dim ≤ 4096, dtype ≤ 8 bytes)", s)
	}
	if s.SegmentBytes()%8 != 0 {
		return fmt.Errorf("model shape %+v: segment of %d bytes is not a multiple of 8", s, s.SegmentBytes())
	}
	if s.BlockBytes() > 1<<30 {
		return fmt.Errorf("model shape %+v: block of %d bytes is larger than 1 GiB", s, s.BlockBytes())
	}
	return nil
}

func (s Shape) String() string {
	return fmt.Sprintf("%s (%d layers, K+V separate, %d-token blocks, %d KV heads, head dim %d, %d-byte dtype: %d segments of %d KiB, %s per block)",
		s.Name, s.Layers, s.BlockTokens, s.KVHeads, s.HeadDim, s.DTypeBytes, s.Segments(), s.SegmentBytes()>>10, FormatBytes(uint64(s.BlockBytes())))
}

// Layout is the shape on the wire: one segment per region, all in group 0.
func (s Shape) Layout() *pb.Layout {
	l := &pb.Layout{HashBytes: HashBytes}
	for range s.Segments() {
		l.Segments = append(l.Segments, &pb.Segment{Group: 0, Bytes: uint64(s.SegmentBytes())})
	}
	return l
}

var regionSeq atomic.Uint64

// Region is the engine's KV memory: one /dev/shm file mapped shared,
// region-major (all blocks of segment 0, then of segment 1, ...), as
// vLLM's per-layer tensors are laid out.
type Region struct {
	Shape  Shape
	Blocks int
	Path   string
	Mem    []byte
}

// NewRegion creates a region of blocks engine blocks in dir (normally
// /dev/shm). Close removes it.
func NewRegion(dir string, s Shape, blocks int) (*Region, error) {
	if blocks < 1 {
		return nil, fmt.Errorf("region of %d blocks", blocks)
	}
	size := s.Segments() * blocks * s.SegmentBytes()
	path := filepath.Join(dir, fmt.Sprintf("kvbench-%d-%d", os.Getpid(), regionSeq.Add(1)))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("engine region: %w", err)
	}
	defer f.Close()
	if err := f.Truncate(int64(size)); err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("engine region %s of %s: %w", path, FormatBytes(uint64(size)), err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("engine region: mmap %s: %w", path, err)
	}
	// Touch every page now, so tmpfs allocation is not timed in a load.
	for i := 0; i < len(mem); i += 4096 {
		mem[i] = 0
	}
	return &Region{Shape: s, Blocks: blocks, Path: path, Mem: mem}, nil
}

// Close unmaps and removes the region file.
func (r *Region) Close() error {
	err := unmapRemove(r.Mem, r.Path)
	r.Mem = nil
	return err
}

// unmapRemove unmaps a region file's mapping (none: nothing to do) and
// removes the file.
func unmapRemove(mem []byte, path string) error {
	if mem == nil {
		return nil
	}
	err := unix.Munmap(mem)
	if rerr := os.Remove(path); rerr != nil && err == nil {
		err = rerr
	}
	return err
}

// Wire describes the region to the daemon, one entry per segment.
func (r *Region) Wire() []*pb.Region {
	seg := uint64(r.Shape.SegmentBytes())
	out := make([]*pb.Region, r.Shape.Segments())
	for i := range out {
		out[i] = &pb.Region{
			Memory:      &pb.Region_ShmPath{ShmPath: r.Path},
			Offset:      uint64(i*r.Blocks) * seg,
			BlockStride: seg,
			NumBlocks:   uint32(r.Blocks),
		}
	}
	return out
}

// Segment is engine block b's bytes in region seg.
func (r *Region) Segment(seg, b int) []byte {
	n := r.Shape.SegmentBytes()
	off := (seg*r.Blocks + b) * n
	return r.Mem[off : off+n]
}

// Fill writes key's bytes into engine block b, as the engine's forward pass
// would have computed them.
func (r *Region) Fill(b int, key []byte) {
	for s := range r.Shape.Segments() {
		FillSegment(r.Segment(s, b), key, s)
	}
}

// Poison zeroes engine block b, so a load that copies nothing cannot pass
// as a load of the bytes left there by an earlier one.
func (r *Region) Poison(b int) {
	for s := range r.Shape.Segments() {
		clear(r.Segment(s, b))
	}
}

// Check reports whether engine block b holds exactly key's bytes.
func (r *Region) Check(b int, key []byte) error {
	for s := range r.Shape.Segments() {
		if i := CheckSegment(r.Segment(s, b), key, s); i >= 0 {
			return fmt.Errorf("engine block %d, segment %d: first wrong byte at %d", b, s, i)
		}
	}
	return nil
}

// segmentBase mixes a key and a segment index into the segment's seed
// (splitmix64 finaliser over every byte of the key).
func segmentBase(key []byte, seg int) uint64 {
	x := uint64(seg+1) * 0x9e3779b97f4a7c15
	for i := 0; i+8 <= len(key); i += 8 {
		x ^= binary.LittleEndian.Uint64(key[i:])
		x ^= x >> 30
		x *= 0xbf58476d1ce4e5b9
		x ^= x >> 27
		x *= 0x94d049bb133111eb
		x ^= x >> 31
	}
	return x
}

// word is the 8 bytes at word index i of a segment with seed base. An odd
// multiplier makes every position of a segment distinct.
func word(base uint64, i int) uint64 { return base ^ uint64(i+1)*0xd6e8feb86659fd93 }

// FillSegment writes the bytes of key's segment seg into dst (a multiple
// of 8 bytes long).
func FillSegment(dst []byte, key []byte, seg int) {
	base := segmentBase(key, seg)
	for i := 0; i+8 <= len(dst); i += 8 {
		binary.LittleEndian.PutUint64(dst[i:i+8], word(base, i>>3))
	}
}

// CheckSegment returns the index of the first byte of got that differs
// from key's segment seg, or -1 when all match.
func CheckSegment(got []byte, key []byte, seg int) int {
	base := segmentBase(key, seg)
	for i := 0; i+8 <= len(got); i += 8 {
		if w := binary.LittleEndian.Uint64(got[i : i+8]); w != word(base, i>>3) {
			for j := range 8 {
				if byte(w>>(8*j)) != byte(word(base, i>>3)>>(8*j)) {
					return i + j
				}
			}
		}
	}
	return -1
}

// FormatBytes prints n in binary units (1.5 GiB, 32 KiB).
func FormatBytes(n uint64) string {
	switch {
	case n >= 1<<30:
		return trim(float64(n)/(1<<30)) + " GiB"
	case n >= 1<<20:
		return trim(float64(n)/(1<<20)) + " MiB"
	case n >= 1<<10:
		return trim(float64(n)/(1<<10)) + " KiB"
	}
	return fmt.Sprintf("%d B", n)
}

func trim(f float64) string {
	s := fmt.Sprintf("%.2f", f)
	for s[len(s)-1] == '0' {
		s = s[:len(s)-1]
	}
	if s[len(s)-1] == '.' {
		s = s[:len(s)-1]
	}
	return s
}
