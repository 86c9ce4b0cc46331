// Package workload owns kvbench's request stream: prompts that share
// prefixes the way an LLM service's do (multi-turn chats over a few
// Zipf-popular system prompts, RAG queries over a Zipf-popular document
// set, and one-off long scans), cut into blocks whose keys are chained like
// vLLM's prefix-cache hashes. One seed fixes the whole stream.
package workload

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math/rand/v2"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
)

// Kind is the kind of a request.
type Kind int

// The request kinds.
const (
	Chat Kind = iota
	RAG
	Scan
	NumKinds
)

var kindNames = [NumKinds]string{"chat", "rag", "scan"}

func (k Kind) String() string { return kindNames[k] }

// Request is one prompt: its block keys in order, each covering its whole
// prefix.
type Request struct {
	ID   string
	Kind Kind
	Keys [][]byte
}

// Config shapes the stream. Sizes are in blocks.
type Config struct {
	Seed uint64

	SystemPrompts int // chat system prompts, chosen by Zipf
	SystemBlocks  int
	ActiveChats   int // conversations in flight; a new one replaces a finished one
	MaxTurns      int // turns of a conversation, each adding a user and a reply block

	RAGPrompts   int // RAG instruction prompts, chosen uniformly
	RAGBlocks    int
	Docs         int // document set, chosen by Zipf
	DocBlocks    int
	DocsPerQuery int

	ScanBlocks int // a one-off long prompt, never seen again

	// Shares of the request mix (normalised).
	ChatShare, RAGShare, ScanShare float64
	// ZipfS is the Zipf exponent (> 1) for system prompts and documents.
	ZipfS float64
}

// Default is a mix with a hot set (system prompts, popular documents, live
// conversations) that a one-off scan must not flush.
func Default(seed uint64) Config {
	return Config{
		Seed:          seed,
		SystemPrompts: 12, SystemBlocks: 6, ActiveChats: 16, MaxTurns: 6,
		RAGPrompts: 2, RAGBlocks: 3, Docs: 48, DocBlocks: 5, DocsPerQuery: 2,
		ScanBlocks: 40,
		ChatShare:  0.6, RAGShare: 0.32, ScanShare: 0.08,
		ZipfS: 1.2,
	}
}

// MaxBlocks is the longest request the config can produce.
func (c Config) MaxBlocks() int {
	return max(c.SystemBlocks+2*c.MaxTurns+1, c.RAGBlocks+c.DocsPerQuery*c.DocBlocks+1, c.ScanBlocks)
}

// Validate refuses configs that cannot produce a stream.
func (c Config) Validate() error {
	if c.SystemPrompts < 1 || c.SystemBlocks < 0 || c.ActiveChats < 1 || c.MaxTurns < 1 ||
		c.RAGPrompts < 1 || c.RAGBlocks < 0 || c.Docs < 1 || c.DocBlocks < 1 ||
		c.DocsPerQuery < 1 || c.ScanBlocks < 1 || c.ZipfS <= 1 ||
		c.ChatShare < 0 || c.RAGShare < 0 || c.ScanShare < 0 || c.ChatShare+c.RAGShare+c.ScanShare <= 0 {
		return fmt.Errorf("workload config %+v: counts must be positive, shares non-negative, Zipf exponent > 1", c)
	}
	return nil
}

type chat struct {
	id, system, turn int
}

// Generator produces the stream. It is not safe for concurrent use.
type Generator struct {
	cfg    Config
	rng    *rand.Rand
	sysZ   *rand.Zipf
	docZ   *rand.Zipf
	chats  []chat
	nextID int
	seq    int
}

// New returns a generator; the same config gives the same stream.
func New(cfg Config) (*Generator, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x6b766265_6e636821))
	return &Generator{
		cfg:  cfg,
		rng:  rng,
		sysZ: rand.NewZipf(rng, cfg.ZipfS, 1, uint64(cfg.SystemPrompts-1)),
		docZ: rand.NewZipf(rng, cfg.ZipfS, 1, uint64(cfg.Docs-1)),
	}, nil
}

// Next returns the next request.
func (g *Generator) Next() Request {
	c := g.cfg
	g.seq++
	total := c.ChatShare + c.RAGShare + c.ScanShare
	u := g.rng.Float64() * total
	var r Request
	switch {
	case u < c.ChatShare:
		r = g.chat()
	case u < c.ChatShare+c.RAGShare:
		r = g.rag()
	default:
		r = g.scan()
	}
	return r
}

// A prompt is built from named pieces; a block's key hashes the previous
// key and the block's piece, so equal keys mean equal prefixes.
type chain struct {
	keys [][]byte
	prev [sha256.Size]byte
}

func (ch *chain) add(piece string, blocks int) {
	var buf [sha256.Size + 64]byte
	for i := range blocks {
		b := append(buf[:0], ch.prev[:]...)
		b = append(b, piece...)
		b = binary.LittleEndian.AppendUint32(b, uint32(i))
		ch.prev = sha256.Sum256(b)
		k := make([]byte, model.HashBytes)
		copy(k, ch.prev[:])
		ch.keys = append(ch.keys, k)
	}
}

func (g *Generator) chat() Request {
	c := g.cfg
	// Continue a live conversation, or start one while there is room.
	var cv *chat
	if len(g.chats) > 0 && (len(g.chats) >= c.ActiveChats || g.rng.IntN(c.ActiveChats) < len(g.chats)) {
		cv = &g.chats[g.rng.IntN(len(g.chats))]
	} else {
		g.nextID++
		g.chats = append(g.chats, chat{id: g.nextID, system: int(g.sysZ.Uint64())})
		cv = &g.chats[len(g.chats)-1]
	}
	var ch chain
	ch.add(fmt.Sprintf("system/%d", cv.system), c.SystemBlocks)
	for t := range cv.turn {
		ch.add(fmt.Sprintf("chat/%d/user/%d", cv.id, t), 1)
		ch.add(fmt.Sprintf("chat/%d/reply/%d", cv.id, t), 1)
	}
	ch.add(fmt.Sprintf("chat/%d/user/%d", cv.id, cv.turn), 1)
	r := Request{ID: fmt.Sprintf("chat-%d-turn-%d", cv.id, cv.turn), Kind: Chat, Keys: ch.keys}
	cv.turn++
	if cv.turn >= c.MaxTurns {
		*cv = g.chats[len(g.chats)-1]
		g.chats = g.chats[:len(g.chats)-1]
	}
	return r
}

func (g *Generator) rag() Request {
	c := g.cfg
	var ch chain
	ch.add(fmt.Sprintf("rag-prompt/%d", g.rng.IntN(c.RAGPrompts)), c.RAGBlocks)
	var picked []int
	for len(picked) < min(c.DocsPerQuery, c.Docs) {
		d := int(g.docZ.Uint64())
		dup := false
		for _, p := range picked {
			dup = dup || p == d
		}
		if !dup {
			picked = append(picked, d)
		}
	}
	for _, d := range picked {
		ch.add(fmt.Sprintf("doc/%d", d), c.DocBlocks)
	}
	ch.add(fmt.Sprintf("rag-question/%d", g.seq), 1)
	return Request{ID: fmt.Sprintf("rag-%d", g.seq), Kind: RAG, Keys: ch.keys}
}

func (g *Generator) scan() Request {
	var ch chain
	ch.add(fmt.Sprintf("scan/%d/%d", g.cfg.Seed, g.seq), g.cfg.ScanBlocks)
	return Request{ID: fmt.Sprintf("scan-%d", g.seq), Kind: Scan, Keys: ch.keys}
}

// Steps cuts the first requests of the stream into steps: each step takes
// requests in order while their blocks fit in engineBlocks (the engine's
// KV pool), at least one per step.
func Steps(cfg Config, steps, engineBlocks int) ([][]Request, error) {
	if cfg.MaxBlocks() > engineBlocks {
		return nil, fmt.Errorf("a request can be %d blocks, more than the %d engine blocks; raise --engine-blocks", cfg.MaxBlocks(), engineBlocks)
	}
	g, err := New(cfg)
	if err != nil {
		return nil, err
	}
	out := make([][]Request, 0, steps)
	next := g.Next()
	for range steps {
		var step []Request
		used := 0
		for used+len(next.Keys) <= engineBlocks {
			step = append(step, next)
			used += len(next.Keys)
			next = g.Next()
		}
		out = append(out, step)
	}
	return out, nil
}

// Distinct counts the distinct keys of steps: the working set if nothing
// were evicted.
func Distinct(steps [][]Request) int {
	seen := map[string]struct{}{}
	for _, s := range steps {
		for _, r := range s {
			for _, k := range r.Keys {
				seen[string(k)] = struct{}{}
			}
		}
	}
	return len(seen)
}

// Expand cuts every block of steps into n blocks of 1/n its tokens: each
// key k becomes n keys, the j-th the hash of k and j, so the keys stay
// chained (equal keys, equal prefixes) and a prompt is n times as many
// blocks. A model with small blocks sees the trace's prompts at the
// lengths in tokens a model with n-times larger blocks does.
func Expand(steps [][]Request, n int) [][]Request {
	if n <= 1 {
		return steps
	}
	out := make([][]Request, len(steps))
	for i, st := range steps {
		for _, r := range st {
			x := Request{ID: r.ID, Kind: r.Kind, Keys: make([][]byte, 0, n*len(r.Keys))}
			for _, k := range r.Keys {
				for j := range n {
					h := sha256.Sum256(binary.LittleEndian.AppendUint32(append([]byte("expand/"), k...), uint32(j)))
					x.Keys = append(x.Keys, h[:model.HashBytes])
				}
			}
			out[i] = append(out[i], x)
		}
	}
	return out
}
