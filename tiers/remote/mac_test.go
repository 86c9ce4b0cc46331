package remote

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/sha256"
	"fmt"
	"testing"
)

// BenchmarkMAC measures the MAC candidates over one block, the numbers
// behind the choice of keyed BLAKE3 (mac.go, docs/remote.md):
//
//	go test -run '^$' -bench MAC -count 6 ./tiers/remote > mac.txt && benchstat -col /algo mac.txt
//
// algo=blake3 is the MAC as the tier computes it (header and payload);
// hmac-sha256 and aes-gmac (AES-256-GCM sealing nothing, the data as
// additional data) are the alternatives; xxh3 is the unkeyed checksum
// every value carries anyway, for scale.
func BenchmarkMAC(b *testing.B) {
	key := make([]byte, 32)
	mac := testMAC(b, 1)
	for _, size := range []int{64 << 10, 2 << 20} {
		data := make([]byte, HeaderSize+size)
		for i := range data {
			data[i] = byte(i * 7)
		}
		head, payload := data[:offMAC], data[HeaderSize:]
		b.Run(fmt.Sprintf("algo=blake3/size=%d", size), func(b *testing.B) {
			b.SetBytes(int64(size))
			var out [MACLen]byte
			for b.Loop() {
				mac.sum(&out, head, payload)
			}
		})
		b.Run(fmt.Sprintf("algo=hmac-sha256/size=%d", size), func(b *testing.B) {
			b.SetBytes(int64(size))
			m := hmac.New(sha256.New, key)
			var out [32]byte
			for b.Loop() {
				m.Reset()
				m.Write(head)
				m.Write(payload)
				m.Sum(out[:0])
			}
		})
		b.Run(fmt.Sprintf("algo=aes-gmac/size=%d", size), func(b *testing.B) {
			b.SetBytes(int64(size))
			blk, _ := aes.NewCipher(key)
			g, _ := cipher.NewGCM(blk)
			nonce := make([]byte, g.NonceSize())
			out := make([]byte, 0, g.Overhead())
			for b.Loop() {
				out = g.Seal(out[:0], nonce, nil, data[:len(data)])
			}
		})
		b.Run(fmt.Sprintf("algo=xxh3/size=%d", size), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				Checksum(payload)
			}
		})
	}
}
