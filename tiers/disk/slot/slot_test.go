package slot_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
)

func testHeader(t testing.TB, hash []byte, payload []byte) slot.Header {
	t.Helper()
	h := slot.Header{Group: 3, Epoch: 2, Seq: 41, Slot: 7}
	for i := range h.Namespace {
		h.Namespace[i] = byte(0xa0 + i)
	}
	if err := h.SetHash(hash); err != nil {
		t.Fatal(err)
	}
	h.SetPayload(payload)
	return h
}

func encode(t testing.TB, h slot.Header) []byte {
	t.Helper()
	buf := make([]byte, slot.HeaderSize)
	if err := slot.Encode(h, buf); err != nil {
		t.Fatal(err)
	}
	return buf
}

// resum recomputes the header checksum after a test edited the block, so
// the decoder's later checks are reached.
func resum(buf []byte) {
	binary.LittleEndian.PutUint32(buf[12:], 0)
	binary.LittleEndian.PutUint32(buf[12:], crc32.Checksum(buf, crc32.MakeTable(crc32.Castagnoli)))
}

func payload(n int, seed byte) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = seed ^ byte(i*131+i>>8)
	}
	return p
}

func TestRoundTrip(t *testing.T) {
	max := slot.Header{Group: ^uint32(0), Epoch: ^uint32(0), Seq: ^uint64(0), Slot: ^uint64(0),
		PayloadLen: slot.MaxPayloadLen, PayloadSum: ^uint64(0)}
	max.Namespace = [32]byte{31: 0xff}
	if err := max.SetHash(bytes.Repeat([]byte{0xff}, 32)); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		h    slot.Header
	}{
		{"hash=1", testHeader(t, []byte{9}, payload(100, 1))},
		{"hash=16", testHeader(t, payload(16, 2), payload(2<<20, 3))},
		{"hash=32", testHeader(t, payload(32, 4), nil)},
		{"max", max},
	} {
		t.Run(c.name, func(t *testing.T) {
			buf := encode(t, c.h)
			got, err := slot.Decode(buf)
			if err != nil {
				t.Fatal(err)
			}
			if got != c.h {
				t.Errorf("Decode(Encode(h)) = %+v, want %+v", got, c.h)
			}
			if !got.Matches(c.h.Namespace, c.h.Group, c.h.Key()) {
				t.Error("a header does not match its own key")
			}
		})
	}
}

// TestLayout pins the byte offsets docs/disk-format.md specifies, with
// numbers written out rather than taken from the package.
func TestLayout(t *testing.T) {
	h := testHeader(t, []byte{0xde, 0xad, 0xbe, 0xef}, []byte("payload"))
	buf := encode(t, h)
	le := binary.LittleEndian
	checks := []struct {
		field string
		got   uint64
		want  uint64
	}{
		{"version@8", uint64(le.Uint16(buf[8:])), 1},
		{"hash_len@11", uint64(buf[11]), 4},
		{"seq@16", le.Uint64(buf[16:]), 41},
		{"epoch@24", uint64(le.Uint32(buf[24:])), 2},
		{"group@28", uint64(le.Uint32(buf[28:])), 3},
		{"slot@32", le.Uint64(buf[32:]), 7},
		{"payload_len@40", le.Uint64(buf[40:]), 7},
		{"payload_sum@48", le.Uint64(buf[48:]), slot.Checksum([]byte("payload"))},
		{"namespace@64", uint64(buf[64]), 0xa0},
		{"namespace@95", uint64(buf[95]), 0xa0 + 31},
		{"hash@96", uint64(le.Uint32(buf[96:])), 0xefbeadde},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %#x, want %#x", c.field, c.got, c.want)
		}
	}
	if string(buf[:8]) != "KVOFSLOT" {
		t.Errorf("magic = %q", buf[:8])
	}
	sum := le.Uint32(buf[12:])
	le.PutUint32(buf[12:], 0)
	if want := crc32.Checksum(buf, crc32.MakeTable(crc32.Castagnoli)); sum != want {
		t.Errorf("header_sum@12 = %#x, want crc32c of the block with the field zeroed = %#x", sum, want)
	}
	if !bytes.Equal(buf[100:], make([]byte, slot.HeaderSize-100)) {
		t.Error("bytes after the key hash are not zero")
	}
}

func TestEncodeRefuses(t *testing.T) {
	good := testHeader(t, []byte{1, 2}, nil)
	junk := good
	junk.Hash[5] = 1
	noHash := good
	noHash.HashLen = 0
	longHash := good
	longHash.HashLen = 33
	big := good
	big.PayloadLen = slot.MaxPayloadLen + 1
	for _, c := range []struct {
		name string
		h    slot.Header
		buf  int
		want error
	}{
		{"short buffer", good, slot.HeaderSize - 1, slot.ErrLength},
		{"long buffer", good, slot.HeaderSize + 1, slot.ErrLength},
		{"no hash", noHash, slot.HeaderSize, slot.ErrLength},
		{"hash too long", longHash, slot.HeaderSize, slot.ErrLength},
		{"payload too long", big, slot.HeaderSize, slot.ErrLength},
		{"bytes past the hash", junk, slot.HeaderSize, slot.ErrMalformed},
	} {
		if err := slot.Encode(c.h, make([]byte, c.buf)); !errors.Is(err, c.want) {
			t.Errorf("%s: Encode = %v, want %v", c.name, err, c.want)
		}
	}
	var h slot.Header
	for _, n := range []int{0, 33} {
		if err := h.SetHash(make([]byte, n)); !errors.Is(err, slot.ErrLength) {
			t.Errorf("SetHash(%d bytes) = %v, want ErrLength", n, err)
		}
	}
}

func TestDecodeRejects(t *testing.T) {
	good := encode(t, testHeader(t, []byte{1, 2, 3}, payload(10, 0)))
	edit := func(f func(b []byte)) []byte {
		b := bytes.Clone(good)
		f(b)
		return b
	}
	for _, c := range []struct {
		name string
		buf  []byte
		want error
	}{
		{"nil", nil, slot.ErrLength},
		{"short", good[:slot.HeaderSize-1], slot.ErrLength},
		{"long", append(bytes.Clone(good), 0), slot.ErrLength},
		{"zeros", make([]byte, slot.HeaderSize), slot.ErrEmpty},
		{"magic", edit(func(b []byte) { b[3] ^= 1 }), slot.ErrBadMagic},
		{"zero magic, data after", edit(func(b []byte) { clear(b[:8]) }), slot.ErrBadMagic},
		{"version", edit(func(b []byte) { b[8] = 2 }), slot.ErrBadVersion},
		{"seq bit", edit(func(b []byte) { b[16] ^= 0x10 }), slot.ErrHeaderChecksum},
		{"padding bit", edit(func(b []byte) { b[4000] ^= 1 }), slot.ErrHeaderChecksum},
		{"torn at 512", edit(func(b []byte) { clear(b[512:]); b[600] = 1 }), slot.ErrHeaderChecksum},
		{"hash len 0", edit(func(b []byte) { b[11] = 0; resum(b) }), slot.ErrLength},
		{"hash len 33", edit(func(b []byte) { b[11] = 33; resum(b) }), slot.ErrLength},
		{"payload len", edit(func(b []byte) { b[44] = 1; resum(b) }), slot.ErrLength},
		{"reserved 10", edit(func(b []byte) { b[10] = 1; resum(b) }), slot.ErrMalformed},
		{"reserved 56", edit(func(b []byte) { b[63] = 1; resum(b) }), slot.ErrMalformed},
		{"hash padding", edit(func(b []byte) { b[96+3] = 1; resum(b) }), slot.ErrMalformed},
		{"tail", edit(func(b []byte) { b[slot.HeaderSize-1] = 1; resum(b) }), slot.ErrMalformed},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, err := slot.Decode(c.buf); !errors.Is(err, c.want) {
				t.Errorf("Decode = %v, want %v", err, c.want)
			}
		})
	}
}

// Every single-bit error in a header block is caught.
func TestDecodeEveryBitFlip(t *testing.T) {
	good := encode(t, testHeader(t, payload(32, 1), payload(10, 0)))
	for i := range len(good) * 8 {
		good[i/8] ^= 1 << (i % 8)
		if _, err := slot.Decode(good); err == nil {
			t.Fatalf("bit %d flipped: Decode accepted the header", i)
		}
		good[i/8] ^= 1 << (i % 8)
	}
}

func TestVerifyPayload(t *testing.T) {
	old := payload(64<<10, 1)
	cur := payload(64<<10, 2)
	h := testHeader(t, []byte{1}, cur)
	// A write torn in 4 KiB units: a prefix of the new payload over the old.
	torn := bytes.Clone(old)
	copy(torn[:40<<10], cur)
	flipped := bytes.Clone(cur)
	flipped[12345] ^= 0x20
	for _, c := range []struct {
		name    string
		payload []byte
		want    error
	}{
		{"good", cur, nil},
		{"old payload under a new header", old, slot.ErrPayloadChecksum},
		{"torn payload", torn, slot.ErrPayloadChecksum},
		{"bit flip", flipped, slot.ErrPayloadChecksum},
		{"short", cur[:len(cur)-1], slot.ErrLength},
		{"long", append(bytes.Clone(cur), 0), slot.ErrLength},
	} {
		if err := slot.VerifyPayload(h, c.payload); !errors.Is(err, c.want) || (c.want == nil && err != nil) {
			t.Errorf("%s: VerifyPayload = %v, want %v", c.name, err, c.want)
		}
	}
}

func TestCheck(t *testing.T) {
	p := payload(10000, 5)
	h := testHeader(t, []byte("0123456789abcdef"), p)
	size := slot.Size(int64(len(p)))
	block := make([]byte, size)
	if err := slot.Encode(h, block[:slot.HeaderSize]); err != nil {
		t.Fatal(err)
	}
	copy(block[slot.HeaderSize:], p)
	want := slot.Expect{Namespace: h.Namespace, Group: h.Group, Hash: h.Key(), Epoch: h.Epoch, Seq: h.Seq, Slot: h.Slot}

	expect := func(f func(e *slot.Expect)) slot.Expect {
		e := want
		f(&e)
		return e
	}
	edit := func(f func(b []byte)) []byte {
		b := bytes.Clone(block)
		f(b)
		return b
	}
	for _, c := range []struct {
		name  string
		block []byte
		e     slot.Expect
		want  error
	}{
		{"good", block, want, nil},
		{"header only", block[:slot.HeaderSize], want, slot.ErrLength},
		{"short read", block[:100], want, slot.ErrLength},
		{"payload cut", block[:slot.HeaderSize+len(p)-1], want, slot.ErrLength},
		{"never written", make([]byte, size), want, slot.ErrEmpty},
		{"other namespace", block, expect(func(e *slot.Expect) { e.Namespace[0]++ }), slot.ErrKeyMismatch},
		{"other group", block, expect(func(e *slot.Expect) { e.Group++ }), slot.ErrKeyMismatch},
		{"other hash", block, expect(func(e *slot.Expect) { e.Hash = []byte("0123456789abcdeF") }), slot.ErrKeyMismatch},
		{"hash prefix", block, expect(func(e *slot.Expect) { e.Hash = e.Hash[:15] }), slot.ErrKeyMismatch},
		{"lower seq on disk", block, expect(func(e *slot.Expect) { e.Seq++ }), slot.ErrStale},
		{"higher seq on disk", block, expect(func(e *slot.Expect) { e.Seq-- }), slot.ErrStale},
		{"other epoch", block, expect(func(e *slot.Expect) { e.Epoch++ }), slot.ErrStale},
		{"other slot", block, expect(func(e *slot.Expect) { e.Slot = 8 }), slot.ErrMisplaced},
		{"payload bit", edit(func(b []byte) { b[slot.HeaderSize+9999] ^= 1 }), want, slot.ErrPayloadChecksum},
		{"header bit", edit(func(b []byte) { b[30] ^= 1 }), want, slot.ErrHeaderChecksum},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := slot.Check(c.block, c.e)
			if c.want == nil {
				if err != nil || got != h {
					t.Fatalf("Check = %+v, %v; want the header", got, err)
				}
				return
			}
			if !errors.Is(err, c.want) {
				t.Errorf("Check = %v, want %v", err, c.want)
			}
		})
	}
}

func TestNewer(t *testing.T) {
	for _, c := range []struct {
		a, b slot.Header
		want bool
	}{
		{slot.Header{Epoch: 1, Seq: 5}, slot.Header{Epoch: 1, Seq: 4}, true},
		{slot.Header{Epoch: 1, Seq: 4}, slot.Header{Epoch: 1, Seq: 5}, false},
		{slot.Header{Epoch: 1, Seq: 4}, slot.Header{Epoch: 1, Seq: 4}, false},
		{slot.Header{Epoch: 2, Seq: 0}, slot.Header{Epoch: 1, Seq: 99}, true},
		{slot.Header{Epoch: 1, Seq: 99}, slot.Header{Epoch: 2, Seq: 0}, false},
	} {
		if got := c.a.Newer(c.b); got != c.want {
			t.Errorf("(%d.%d).Newer(%d.%d) = %v", c.a.Epoch, c.a.Seq, c.b.Epoch, c.b.Seq, got)
		}
	}
}

func TestSize(t *testing.T) {
	for _, c := range []struct{ payload, want int64 }{
		{0, 4096}, {1, 8192}, {4096, 8192}, {4097, 12288}, {2 << 20, 4096 + 2<<20}, {-1, 4096},
	} {
		if got := slot.Size(c.payload); got != c.want {
			t.Errorf("Size(%d) = %d, want %d", c.payload, got, c.want)
		}
	}
}
