package slot_test

import (
	"fmt"
	"hash/crc32"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
)

var sink uint64

// BenchmarkChecksum chose the payload checksum: xxh3-64 against crc32c
// (hash/crc32 uses the SSE4.2 crc32 instruction on amd64) over a page and a
// 2 MiB KV block, hot in cache and cold (cycling through 256 MiB, more
// than the last-level cache, as a block arriving from a DMA is). Compare
// with benchstat -col /algo over -count=6.
func BenchmarkChecksum(b *testing.B) {
	castagnoli := crc32.MakeTable(crc32.Castagnoli)
	algos := []struct {
		name string
		sum  func([]byte) uint64
	}{
		{"crc32c", func(p []byte) uint64 { return uint64(crc32.Checksum(p, castagnoli)) }},
		{"xxh3", xxh3.Hash},
	}
	const coldBytes = 256 << 20
	cold := payload(coldBytes, 3)
	for _, c := range []struct {
		size int
		cold bool
	}{{4 << 10, false}, {2 << 20, false}, {2 << 20, true}} {
		for _, a := range algos {
			cache := "hot"
			if c.cold {
				cache = "cold"
			}
			b.Run(fmt.Sprintf("size=%s/cache=%s/algo=%s", sizeName(c.size), cache, a.name), func(b *testing.B) {
				b.SetBytes(int64(c.size))
				b.ReportAllocs()
				p, off := payload(c.size, 7), 0
				for b.Loop() {
					if c.cold {
						p = cold[off : off+c.size]
						off = (off + c.size) % coldBytes
					}
					sink += a.sum(p)
				}
			})
		}
	}
}

func BenchmarkHeader(b *testing.B) {
	h := testHeader(b, make([]byte, 32), nil)
	buf := make([]byte, slot.HeaderSize)
	b.Run("op=encode", func(b *testing.B) {
		b.SetBytes(slot.HeaderSize)
		b.ReportAllocs()
		for b.Loop() {
			if err := slot.Encode(h, buf); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("op=decode", func(b *testing.B) {
		b.SetBytes(slot.HeaderSize)
		b.ReportAllocs()
		for b.Loop() {
			if _, err := slot.Decode(buf); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%dMiB", n>>20)
	}
	return fmt.Sprintf("%dKiB", n>>10)
}
