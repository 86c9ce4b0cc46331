package model

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// Kind is what a KV cache group's blocks hold, and so which of them a
// prefix hit needs.
type Kind int

// The group kinds kvbench models.
const (
	// FullAttention: every block from 0 of a hit's prefix.
	FullAttention Kind = iota
	// SlidingWindow: the blocks inside the window ending at the hit.
	SlidingWindow
	// MambaState: vLLM's mamba_cache_mode="align": a block holds the
	// state at its end; a hit needs the one state block at its end.
	MambaState
)

func (k Kind) String() string {
	return [...]string{"full-attention", "sliding-window", "mamba-align"}[k]
}

// Group is one KV cache group as vLLM's hybrid allocator makes them: layers
// of one kind, each block one page of every layer of the group.
type Group struct {
	Kind        Kind
	Layers      int
	BlockTokens int
	// WindowTokens is a sliding window's size in tokens (SlidingWindow).
	WindowTokens int
	// Segments are the bytes of one block in each region of the group, in
	// layout order (K and V of each attention layer; conv and SSM state
	// of each Mamba layer).
	Segments []int
}

// WindowBlocks is W of /work/notes/windows.md's rule: the blocks a hit
// ending at a block boundary needs from this group, counted back from the
// hit's end; 0 for full attention (every block from 0). A sliding window of
// S tokens needs ceil((S-1)/block) blocks (vLLM's
// sliding_window_contiguous_blocks: the token at the hit's end attends to
// the S-1 before it); a Mamba group in align mode the one state block.
func (g Group) WindowBlocks() int {
	switch g.Kind {
	case SlidingWindow:
		return (g.WindowTokens - 1 + g.BlockTokens - 1) / g.BlockTokens
	case MambaState:
		return 1
	}
	return 0
}

// BlockBytes is one block of the group over all its regions.
func (g Group) BlockBytes() int {
	n := 0
	for _, s := range g.Segments {
		n += s
	}
	return n
}

// Hybrid is a model whose KV cache has several groups of different kinds.
type Hybrid struct {
	Name string
	// About says what real model it is shaped like.
	About  string
	Groups []Group
}

// Units: every group in kvbench's presets has the same block size, so a
// unit (lcm of the block sizes) is one block of every group and the
// workload's block keys are every group's.

// UnitBytes is one block of every group: what the all-full-attention
// treatment moves per hit block.
func (h Hybrid) UnitBytes() int {
	n := 0
	for _, g := range h.Groups {
		n += g.BlockBytes()
	}
	return n
}

// FullBytes is one block of the full-attention groups.
func (h Hybrid) FullBytes() int {
	n := 0
	for _, g := range h.Groups {
		if g.Kind == FullAttention {
			n += g.BlockBytes()
		}
	}
	return n
}

// BlockTokens is the (common) block size.
func (h Hybrid) BlockTokens() int { return h.Groups[0].BlockTokens }

// Validate refuses hybrids the daemon or this package cannot handle.
func (h Hybrid) Validate() error {
	if len(h.Groups) == 0 || len(h.Groups) > 64 {
		return fmt.Errorf("hybrid %s: %d groups, want 1..64", h.Name, len(h.Groups))
	}
	for i, g := range h.Groups {
		if g.BlockTokens != h.Groups[0].BlockTokens {
			return fmt.Errorf("hybrid %s: group %d has %d-token blocks, group 0 %d: kvbench's hybrids have one block size", h.Name, i, g.BlockTokens, h.Groups[0].BlockTokens)
		}
		if g.Kind == SlidingWindow && g.WindowTokens < 2 {
			return fmt.Errorf("hybrid %s: group %d: sliding window of %d tokens", h.Name, i, g.WindowTokens)
		}
		if len(g.Segments) == 0 {
			return fmt.Errorf("hybrid %s: group %d has no segments", h.Name, i)
		}
		for _, s := range g.Segments {
			if s <= 0 || s%8 != 0 || s > 1<<30 {
				return fmt.Errorf("hybrid %s: group %d: a segment of %d bytes (want a positive multiple of 8, at most 1 GiB)", h.Name, i, s)
			}
		}
	}
	return nil
}

func (h Hybrid) String() string {
	var parts []string
	for i, g := range h.Groups {
		w := ""
		switch g.Kind {
		case SlidingWindow:
			w = fmt.Sprintf(", %d-token window = %d blocks", g.WindowTokens, g.WindowBlocks())
		case MambaState:
			w = ", 1 state block"
		}
		parts = append(parts, fmt.Sprintf("group %d %s: %d layers, %s per block%s", i, g.Kind, g.Layers, FormatBytes(uint64(g.BlockBytes())), w))
	}
	return fmt.Sprintf("%s (%s; %d-token blocks; %s)", h.Name, h.About, h.BlockTokens(), strings.Join(parts, "; "))
}

// Layout is the hybrid on the wire: every group's segments, group by group.
func (h Hybrid) Layout() *pb.Layout {
	l := &pb.Layout{HashBytes: HashBytes}
	for g, gr := range h.Groups {
		for _, s := range gr.Segments {
			l.Segments = append(l.Segments, &pb.Segment{Group: uint32(g), Bytes: uint64(s)})
		}
	}
	return l
}

// AllFull is the same model with every group treated as full attention:
// the same bytes, every group's blocks needed from 0.
func (h Hybrid) AllFull() Hybrid {
	out := Hybrid{Name: h.Name + " as all full attention", About: h.About}
	for _, g := range h.Groups {
		g.Kind, g.WindowTokens = FullAttention, 0
		out.Groups = append(out.Groups, g)
	}
	return out
}

// Kinds lists each group's kind (model.Kind), for fingerprints.
func (h Hybrid) Kinds() string {
	var s []string
	for _, g := range h.Groups {
		s = append(s, fmt.Sprintf("%s/%d/%d", g.Kind, g.WindowTokens, g.BlockTokens))
	}
	return strings.Join(s, ",")
}

// vllmGroups splits layers of each kind into KV cache groups of equal
// layer count the way vLLM's hybrid allocator does
// (vllm/v1/core/kv_cache_utils.py, _get_kv_cache_groups_uniform_page_size):
// the group size is the fewest layers of a kind (the most when that is
// under 1.5 times the fewest), and a kind of n layers becomes
// ceil(n/size) groups (padding layers hold no bytes and are left out here).
func vllmGroups(kinds []Group, layers []int) []Group {
	lo, hi := layers[0], layers[0]
	for _, n := range layers {
		lo, hi = min(lo, n), max(hi, n)
	}
	size := lo
	if float64(hi) < 1.5*float64(lo) {
		size = hi
	}
	var out []Group
	for i, k := range kinds {
		n := layers[i]
		groups := (n + size - 1) / size
		for j := range groups {
			// layers[j::groups]
			in := (n - j + groups - 1) / groups
			g := k
			g.Layers = in
			g.Segments = nil
			for range in {
				g.Segments = append(g.Segments, k.Segments...)
			}
			out = append(out, g)
		}
	}
	return out
}

// attentionLayer is one attention layer's K and V pages of a block.
func attentionLayer(blockTokens, kvHeads, headDim, dtype int) []int {
	seg := blockTokens * kvHeads * headDim * dtype
	return []int{seg, seg}
}

// Mamba2 is one Mamba2 layer's state dimensions (per GPU).
type Mamba2 struct {
	Heads, HeadDim, DState, NGroups, ConvKernel, DTypeBytes int
}

// ConvBytes is the conv state: (conv_kernel-1) x (heads*head_dim +
// 2*n_groups*d_state), as vLLM's MambaStateShapeCalculator.mamba2_state_shape.
func (m Mamba2) ConvBytes() int {
	return (m.ConvKernel - 1) * (m.Heads*m.HeadDim + 2*m.NGroups*m.DState) * m.DTypeBytes
}

// SSMBytes is the SSM state: heads x head_dim x d_state.
func (m Mamba2) SSMBytes() int { return m.Heads * m.HeadDim * m.DState * m.DTypeBytes }

// alignedBlockTokens is the attention block size vLLM picks for a hybrid
// attention + Mamba model so one attention page holds a Mamba state
// (vllm/platforms/interface.py, _align_hybrid_block_size without prefix
// caching of every token: kernel alignment x ceil(mamba page /
// (alignment x attention bytes per token))); in align mode the Mamba block
// size is the same.
func alignedBlockTokens(mambaPage, attnBytesPerToken, kernelAlign int) int {
	return kernelAlign * ((mambaPage + kernelAlign*attnBytesPerToken - 1) / (kernelAlign * attnBytesPerToken))
}

// HybridSWA is a full-attention + sliding-window model: a Llama-3-8B-sized
// attention layer (8 KV heads of 128, bf16, 16-token blocks) in 32 layers,
// every 4th full attention and the rest a 128-token sliding window (a 3:1
// local:global pattern as in Llama 4 or gpt-oss's alternation). vLLM's
// allocator makes it one full-attention group of 8 layers and three
// sliding-window groups of 8.
func HybridSWA(kvHeads int) Hybrid {
	const tokens, layers, window = 16, 32, 128
	att := attentionLayer(tokens, kvHeads, 128, 2)
	full := Group{Kind: FullAttention, BlockTokens: tokens, Segments: att}
	swa := Group{Kind: SlidingWindow, BlockTokens: tokens, WindowTokens: window, Segments: att}
	return Hybrid{
		Name:   "hybrid-swa",
		About:  fmt.Sprintf("%d layers, every 4th full attention, the rest a %d-token window; %d KV heads of 128, bf16", layers, window, kvHeads),
		Groups: vllmGroups([]Group{full, swa}, []int{layers / 4, layers - layers/4}),
	}
}

// HybridMamba is a Mamba2 + full-attention model shaped like NVIDIA
// Nemotron-H's 1:6 pattern, with fewer layers so its working set fits a
// small machine: 1 attention layer (8 KV heads of 128, bf16) and 6 Mamba2
// layers of 64 heads x 64, d_state 128, 1 group, conv kernel 4, bf16 state
// (per layer: a 26 KiB conv state and a 1 MiB SSM state). The block size
// is vLLM's for it (attention page >= Mamba page: 272 tokens), and vLLM's
// allocator makes one attention group and six Mamba groups of 1 layer.
// heads scales the Mamba heads (64 for the real size).
func HybridMamba(heads int) Hybrid {
	m := Mamba2{Heads: heads, HeadDim: 64, DState: 128, NGroups: 1, ConvKernel: 4, DTypeBytes: 2}
	const kvHeads, headDim, dtype, kernelAlign = 8, 128, 2, 16
	tokens := alignedBlockTokens(m.ConvBytes()+m.SSMBytes(), 2*kvHeads*headDim*dtype, kernelAlign)
	full := Group{Kind: FullAttention, BlockTokens: tokens, Segments: attentionLayer(tokens, kvHeads, headDim, dtype)}
	state := Group{Kind: MambaState, BlockTokens: tokens, Segments: []int{m.ConvBytes(), m.SSMBytes()}}
	return Hybrid{
		Name: "hybrid-mamba",
		About: fmt.Sprintf("1 attention layer (8 KV heads of 128, bf16) and 6 Mamba2 layers (%d heads x 64, d_state 128, conv 4, bf16: %s conv + %s SSM state each)",
			heads, FormatBytes(uint64(m.ConvBytes())), FormatBytes(uint64(m.SSMBytes()))),
		Groups: vllmGroups([]Group{full, state}, []int{1, 6}),
	}
}

// HybridPresets are kvbench's hybrid model shapes at full size.
var HybridPresets = map[string]func() Hybrid{
	"hybrid-swa":   func() Hybrid { return HybridSWA(8) },
	"hybrid-mamba": func() Hybrid { return HybridMamba(64) },
}

// HybridRegion is a hybrid engine's KV memory: one /dev/shm file mapped
// shared, region-major over the layout's segments (group 0's first), each
// region Blocks blocks long (every group has its own tensors of as many
// blocks, as vLLM's block pool gives every group the same block ids).
type HybridRegion struct {
	Model  Hybrid
	Blocks int
	Path   string
	Mem    []byte
	// segs[g][s] is the byte offset of group g's segment s region, and
	// seq[g][s] its index in the layout (which seeds its bytes).
	segs, seq [][]int
}

// NewHybridRegion creates a region of blocks engine blocks per group in
// dir. Close removes it.
func NewHybridRegion(dir string, h Hybrid, blocks int) (*HybridRegion, error) {
	if err := h.Validate(); err != nil {
		return nil, err
	}
	if blocks < 1 {
		return nil, fmt.Errorf("region of %d blocks", blocks)
	}
	r := &HybridRegion{Model: h, Blocks: blocks}
	off, n := 0, 0
	for _, g := range h.Groups {
		var so, sq []int
		for _, s := range g.Segments {
			so, sq = append(so, off), append(sq, n)
			off += s * blocks
			n++
		}
		r.segs, r.seq = append(r.segs, so), append(r.seq, sq)
	}
	r.Path = filepath.Join(dir, fmt.Sprintf("kvbench-hybrid-%d-%d", os.Getpid(), regionSeq.Add(1)))
	f, err := os.OpenFile(r.Path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("engine region: %w", err)
	}
	defer f.Close()
	if err := f.Truncate(int64(off)); err != nil {
		os.Remove(r.Path)
		return nil, fmt.Errorf("engine region %s of %s: %w", r.Path, FormatBytes(uint64(off)), err)
	}
	r.Mem, err = unix.Mmap(int(f.Fd()), 0, off, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		os.Remove(r.Path)
		return nil, fmt.Errorf("engine region: mmap %s: %w", r.Path, err)
	}
	for i := 0; i < len(r.Mem); i += 4096 {
		r.Mem[i] = 0
	}
	return r, nil
}

// Close unmaps and removes the region file.
func (r *HybridRegion) Close() error {
	err := unmapRemove(r.Mem, r.Path)
	r.Mem = nil
	return err
}

// Wire describes the region to the daemon, one entry per layout segment.
func (r *HybridRegion) Wire() []*pb.Region {
	var out []*pb.Region
	for g, gr := range r.Model.Groups {
		for s, n := range gr.Segments {
			out = append(out, &pb.Region{
				Memory:      &pb.Region_ShmPath{ShmPath: r.Path},
				Offset:      uint64(r.segs[g][s]),
				BlockStride: uint64(n),
				NumBlocks:   uint32(r.Blocks),
			})
		}
	}
	return out
}

func (r *HybridRegion) segment(g, s, b int) []byte {
	n := r.Model.Groups[g].Segments[s]
	off := r.segs[g][s] + b*n
	return r.Mem[off : off+n]
}

// Fill writes key's bytes into engine block b of group g. A segment's
// bytes depend on its index in the layout, so another group's block under
// the same hash never passes for this one.
func (r *HybridRegion) Fill(g, b int, key []byte) {
	for s := range r.Model.Groups[g].Segments {
		FillSegment(r.segment(g, s, b), key, r.seq[g][s])
	}
}

// Poison zeroes engine block b of group g.
func (r *HybridRegion) Poison(g, b int) {
	for s := range r.Model.Groups[g].Segments {
		clear(r.segment(g, s, b))
	}
}

// Check reports whether engine block b of group g holds exactly key's
// bytes.
func (r *HybridRegion) Check(g, b int, key []byte) error {
	for s := range r.Model.Groups[g].Segments {
		if i := CheckSegment(r.segment(g, s, b), key, r.seq[g][s]); i >= 0 {
			return fmt.Errorf("group %d engine block %d, segment %d: first wrong byte at %d", g, b, s, i)
		}
	}
	return nil
}
