package disk

import (
	"bytes"
	"errors"
	"maps"
	"slices"
	"testing"
)

func TestChunkMapRoundTrip(t *testing.T) {
	m := chunkMap{file: 2, epoch: 90, chunkBytes: 1 << 20, chunks: []chunkEntry{{}, {slotBytes: 8192, minEpoch: 3}, {slotBytes: 1 << 20, minEpoch: 90}}}
	b := encodeMap(m)
	got, err := decodeMap(b, 2, 1<<20, 3)
	if err != nil {
		t.Fatal(err)
	}
	if got.file != m.file || got.epoch != m.epoch || got.chunkBytes != m.chunkBytes || !slices.Equal(got.chunks, m.chunks) {
		t.Errorf("decoded %+v, want %+v", got, m)
	}
	refuse := []struct {
		name       string
		b          []byte
		file       uint32
		chunkBytes uint64
		chunks     int
	}{
		{"other file", b, 1, 1 << 20, 3},
		{"other chunk size", b, 2, 1 << 19, 3},
		{"other chunk count", b, 2, 1 << 20, 4},
		{"cut", b[:len(b)-1], 2, 1 << 20, 3},
		{"empty", nil, 2, 1 << 20, 3},
		{"slot above chunk", encodeMap(chunkMap{file: 2, epoch: 9, chunkBytes: 1 << 20, chunks: []chunkEntry{{slotBytes: 2 << 20}, {}, {}}}), 2, 1 << 20, 3},
		{"assigned after the map", encodeMap(chunkMap{file: 2, epoch: 9, chunkBytes: 1 << 20, chunks: []chunkEntry{{slotBytes: 8192, minEpoch: 10}, {}, {}}}), 2, 1 << 20, 3},
	}
	for _, c := range refuse {
		if _, err := decodeMap(c.b, c.file, c.chunkBytes, c.chunks); !errors.Is(err, errMeta) {
			t.Errorf("%s: %v; want errMeta", c.name, err)
		}
	}
	for i := range b {
		bad := bytes.Clone(b)
		bad[i] ^= 0x10
		if _, err := decodeMap(bad, 2, 1<<20, 3); err == nil {
			t.Errorf("a flipped bit in byte %d went unnoticed", i)
		}
	}
}

func TestCatalogRoundTrip(t *testing.T) {
	for _, ns := range []map[[32]byte][]byte{
		{},
		{{1}: []byte("a"), {2}: {}, {3, 4}: bytes.Repeat([]byte{9}, 1000)},
	} {
		b := encodeCatalog(ns)
		got, err := decodeCatalog(b)
		if err != nil {
			t.Fatal(err)
		}
		if !maps.EqualFunc(got, ns, bytes.Equal) {
			t.Errorf("decoded %v, want %v", got, ns)
		}
		if !bytes.Equal(encodeCatalog(got), b) {
			t.Error("encoding is not canonical")
		}
		for i := range b {
			bad := bytes.Clone(b)
			bad[i] ^= 0x01
			if _, err := decodeCatalog(bad); err == nil {
				t.Errorf("a flipped bit in byte %d went unnoticed", i)
			}
		}
	}
}

// The decoders see whatever a damaged disk holds: they never panic, and
// what they accept encodes back to the same bytes.
func FuzzMeta(f *testing.F) {
	f.Add(encodeMap(chunkMap{file: 0, epoch: 5, chunkBytes: 1 << 20, chunks: []chunkEntry{{slotBytes: 8192, minEpoch: 5}, {}}}))
	f.Add(encodeCatalog(map[[32]byte][]byte{{1}: []byte("meta")}))
	f.Add([]byte("KVOFCMAP"))
	f.Fuzz(func(t *testing.T, b []byte) {
		if m, err := decodeMap(b, 0, 1<<20, 2); err == nil && !bytes.Equal(encodeMap(m), b) {
			t.Errorf("chunk map %x decodes to %+v, which encodes differently", b, m)
		}
		if ns, err := decodeCatalog(b); err == nil && !bytes.Equal(encodeCatalog(ns), b) {
			t.Errorf("catalog %x decodes to %v, which encodes differently", b, ns)
		}
	})
}
