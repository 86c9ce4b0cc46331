package remote

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"testing"
)

func testMAC(t testing.TB, seed byte) *MAC {
	t.Helper()
	m, err := NewMAC(bytes.Repeat([]byte{seed}, 32))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func testIdent(hashLen int) Ident {
	id := Ident{Group: 3, Hash: make([]byte, hashLen)}
	for i := range id.NS {
		id.NS[i] = byte(i*5 + 1)
	}
	for i := range id.Hash {
		id.Hash[i] = byte(0xa0 + i)
	}
	return id
}

// testStamp is the generations test values are stamped with.
var testStamp = Stamp{Key: 0x1111, NS: 0x2222, Write: 7}

// makeValue builds a value for id with a pseudo-random payload of n bytes,
// stamped testStamp.
func makeValue(t testing.TB, id Ident, n int, mac *MAC) []byte {
	t.Helper()
	v := make([]byte, HeaderSize+n)
	var seed [32]byte
	seed[0], seed[1], seed[2] = byte(n), byte(n>>8), byte(n>>16)
	rand.NewChaCha8(seed).Read(v[HeaderSize:])
	if err := EncodeHeader(v, id, testStamp, mac); err != nil {
		t.Fatal(err)
	}
	return v
}

func TestValueRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name    string
		hashLen int
		mac     *MAC
	}{{"open/hash=16", 16, nil}, {"open/hash=32", 32, nil}, {"mac/hash=16", 16, testMAC(t, 1)}, {"mac/hash=32", 32, testMAC(t, 1)}} {
		t.Run(tc.name, func(t *testing.T) {
			id := testIdent(tc.hashLen)
			v := makeValue(t, id, 10000, tc.mac)
			p, err := Verify(v, id, 10000, tc.mac)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(p, v[HeaderSize:]) {
				t.Fatal("Verify returned another payload")
			}
		})
	}
}

// TestVerifyEveryHeaderBitFlip: every field of the header is compared with
// what the reader expects or covered by the checksum or the MAC, so no
// single flipped bit in it goes unnoticed. Without a MAC, a flipped
// generation makes the value stale instead (the reader compares it with
// the store's records); the write id is covered by the MAC only (it is
// random: a reader compares it with the same value's header read again).
func TestVerifyEveryHeaderBitFlip(t *testing.T) {
	for _, mac := range []*MAC{nil, testMAC(t, 2)} {
		id := testIdent(16)
		v := makeValue(t, id, 4096, mac)
		for bit := 0; bit < HeaderSize*8; bit++ {
			w := bytes.Clone(v)
			w[bit/8] ^= 1 << (bit % 8)
			if mac == nil && bit/8 >= offKeyGen && bit/8 < offReserved {
				if bit/8 < offWriteID && StampOf(w).Current(testStamp.Key, testStamp.NS) {
					t.Fatalf("flipping header bit %d: the value is still current", bit)
				}
				continue
			}
			if _, err := Verify(w, id, 4096, mac); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("mac=%v: flipping header bit %d: Verify = %v, want ErrCorrupt", mac != nil, bit, err)
			}
		}
	}
}

func TestVerifyRejects(t *testing.T) {
	key, other := testMAC(t, 3), testMAC(t, 4)
	id := testIdent(32)
	good := makeValue(t, id, 8192, nil)
	goodMAC := makeValue(t, id, 8192, key)
	otherID := func(f func(*Ident)) Ident {
		o := testIdent(32)
		f(&o)
		return o
	}
	for _, tc := range []struct {
		name  string
		value []byte
		want  Ident
		n     uint64
		mac   *MAC
		err   error
	}{
		{"empty", nil, id, 8192, nil, ErrLength},
		{"short header", good[:HeaderSize-1], id, 8192, nil, ErrLength},
		{"truncated payload", good[:len(good)-1], id, 8192, nil, ErrLength},
		{"extra byte", append(bytes.Clone(good), 0), id, 8192, nil, ErrLength},
		{"namespace expects other length", good, id, 4096, nil, ErrLength},
		{"other namespace", good, otherID(func(o *Ident) { o.NS[31] ^= 1 }), 8192, nil, ErrKeyMismatch},
		{"other group", good, otherID(func(o *Ident) { o.Group++ }), 8192, nil, ErrKeyMismatch},
		{"other hash", good, otherID(func(o *Ident) { o.Hash[0] ^= 1 }), 8192, nil, ErrKeyMismatch},
		{"shorter hash", good, otherID(func(o *Ident) { o.Hash = o.Hash[:16] }), 8192, nil, ErrKeyMismatch},
		{"payload bit", flip(good, HeaderSize+100), id, 8192, nil, ErrChecksum},
		{"last payload bit", flip(good, len(good)-1), id, 8192, nil, ErrChecksum},
		{"open value, keyed reader", good, id, 8192, key, ErrMAC},
		{"keyed value, open reader", goodMAC, id, 8192, nil, ErrMAC},
		{"keyed value, other key", goodMAC, id, 8192, other, ErrMAC},
		{"keyed value, payload bit", flip(goodMAC, HeaderSize+5), id, 8192, key, ErrChecksum},
		{"keyed value, MAC bit", flip(goodMAC, offMAC+7), id, 8192, key, ErrMAC},
		{"forged: payload and checksum changed without the key", forge(t, goodMAC), id, 8192, key, ErrMAC},
		{"other magic", flip(good, 0), id, 8192, nil, ErrBadMagic},
		{"other version", flip(good, offVersion), id, 8192, nil, ErrBadVersion},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Verify(tc.value, tc.want, tc.n, tc.mac)
			if !errors.Is(err, ErrCorrupt) || !errors.Is(err, tc.err) {
				t.Fatalf("Verify = %v, want ErrCorrupt and %v", err, tc.err)
			}
		})
	}
}

func flip(v []byte, i int) []byte {
	w := bytes.Clone(v)
	w[i] ^= 0x10
	return w
}

// forge changes a keyed value's payload and fixes its checksum, as someone
// who can write to the store but has no key would.
func forge(t *testing.T, v []byte) []byte {
	w := bytes.Clone(v)
	w[HeaderSize+1] ^= 0xff
	var mac [MACLen]byte
	copy(mac[:], w[offMAC:])
	id := testIdent(32)
	if err := EncodeHeader(w, id, StampOf(w), nil); err != nil {
		t.Fatal(err)
	}
	w[offMACAlg] = macBLAKE3
	copy(w[offMAC:], mac[:])
	return w
}

func TestEncodeHeaderRefuses(t *testing.T) {
	id := testIdent(16)
	if err := EncodeHeader(make([]byte, HeaderSize-1), id, testStamp, nil); !errors.Is(err, ErrLength) {
		t.Fatalf("short buffer: %v", err)
	}
	for _, n := range []int{0, MaxHashLen + 1} {
		bad := id
		bad.Hash = make([]byte, n)
		if err := EncodeHeader(make([]byte, HeaderSize+1), bad, testStamp, nil); !errors.Is(err, ErrLength) {
			t.Fatalf("hash of %d bytes: %v", n, err)
		}
	}
}

// FuzzVerify: Verify never panics, and whatever it accepts is exactly the
// one encoding of its ident, stamp and payload (nothing else verifies).
func FuzzVerify(f *testing.F) {
	key := testMAC(f, 9)
	for _, mac := range []*MAC{nil, key} {
		for _, hl := range []int{16, 32} {
			f.Add(makeValue(f, testIdent(hl), 64, mac), hl, uint64(64), mac != nil)
		}
	}
	f.Add([]byte(Magic), 16, uint64(0), false)
	f.Fuzz(func(t *testing.T, value []byte, hashLen int, n uint64, keyed bool) {
		if hashLen < 1 || hashLen > MaxHashLen {
			return
		}
		var mac *MAC
		if keyed {
			mac = key
		}
		id := testIdent(hashLen)
		payload, err := Verify(value, id, n, mac)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Verify error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		again := make([]byte, len(value))
		copy(again[HeaderSize:], payload)
		if err := EncodeHeader(again, id, StampOf(value), mac); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(again, value) {
			t.Fatalf("Verify accepted a value that is not the encoding of its payload:\n got %x\nwant %x", value[:HeaderSize], again[:HeaderSize])
		}
	})
}

func TestCheckFetch(t *testing.T) {
	id := testIdent(16)
	v := makeValue(t, id, 4096, nil)
	fetch := func(size int64, headN, bodyN int, err error) *Fetch {
		f := &Fetch{Head: bytes.Clone(v[:HeaderSize]), Body: bytes.Clone(v[HeaderSize:]), Size: size, HeadN: headN, BodyN: bodyN, Gen: testStamp.Key, NSGen: testStamp.NS, Err: err}
		return f
	}
	good := func(mut func(*Fetch)) *Fetch { f := fetch(int64(len(v)), HeaderSize, 4096, nil); mut(f); return f }
	for _, tc := range []struct {
		name  string
		f     *Fetch
		found bool
		err   error
	}{
		{"good", fetch(int64(len(v)), HeaderSize, 4096, nil), true, nil},
		{"absent", fetch(0, 0, 0, nil), false, nil},
		{"unavailable", fetch(0, 0, 0, ErrUnavailable), false, ErrUnavailable},
		{"longer value", fetch(int64(len(v)+1), HeaderSize, 4096, nil), true, ErrLength},
		{"shorter value", fetch(int64(len(v)-1), HeaderSize, 4095, nil), true, ErrLength},
		{"tiny value", fetch(10, 10, 0, nil), true, ErrLength},
		{"torn", good(func(f *Fetch) { f.Torn = true }), false, nil},
		{"key invalidated since", good(func(f *Fetch) { f.Gen++ }), true, ErrStale},
		{"key record gone", good(func(f *Fetch) { f.Gen = 0 }), true, ErrStale},
		{"namespace invalidated since", good(func(f *Fetch) { f.NSGen++ }), true, ErrStale},
		{"namespace record gone", good(func(f *Fetch) { f.NSGen = 0 }), true, ErrStale},
	} {
		t.Run(tc.name, func(t *testing.T) {
			found, err := CheckFetch(tc.f, id, 4096, nil)
			if found != tc.found || (tc.err == nil) != (err == nil) || (tc.err != nil && !errors.Is(err, tc.err)) {
				t.Fatalf("CheckFetch = %v, %v; want %v, %v", found, err, tc.found, tc.err)
			}
			if errors.Is(err, ErrStale) && errors.Is(err, ErrCorrupt) {
				t.Fatal("a stale value is reported corrupt (its value would be logged as an attack)")
			}
			// A header-only look agrees: current, stale or unknown.
			f := *tc.f
			f.Body, f.BodyN = nil, 0
			hfound, stale, herr := CheckHead(&f, id, 4096, nil)
			if tc.err == nil && !tc.f.Torn && hfound != tc.found || errors.Is(tc.err, ErrStale) && !stale || errors.Is(tc.err, ErrUnavailable) && herr == nil {
				t.Fatalf("CheckHead = %v, %v, %v", hfound, stale, herr)
			}
		})
	}
}
