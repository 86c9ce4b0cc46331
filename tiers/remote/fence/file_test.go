package fence

import (
	"encoding/binary"
	"errors"
	"reflect"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

func testFences() durableFences {
	ks := remote.NewKeyspace(nil)
	var df durableFences
	for i := 0; i < 3; i++ {
		var fk Key
		fk.NS[0], fk.Group, fk.Hash[0], fk.Hash[15] = byte(i), uint32(i), 0xab, byte(i)
		df.keys = append(df.keys, durableKey{fk: fk, store: ks.Key(remote.Ident{NS: fk.NS, Group: fk.Group, Hash: fk.Hash[:16]})})
	}
	var d [32]byte
	d[31] = 9
	df.spaces = append(df.spaces, durableSpace{ns: d, keyspace: ks.Prefix()}, durableSpace{ns: d, keyspace: "kvo:2:0123456789abcdef:"})
	return df
}

// TestFencesFile: the fences file round-trips; every truncation, every bit
// flip, an unknown version and counts past the bounds are refused.
func TestFencesFile(t *testing.T) {
	df := testFences()
	b := encodeFences(df)
	back, err := decodeFences(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, df) { // encodeFences sorted df in place
		t.Fatalf("round trip:\n got %+v\nwant %+v", back, df)
	}
	if empty, err := decodeFences(encodeFences(durableFences{})); err != nil || len(empty.keys)+len(empty.spaces) != 0 {
		t.Fatalf("empty file: %+v %v", empty, err)
	}
	for n := 0; n < len(b); n++ {
		if _, err := decodeFences(b[:n]); !errors.Is(err, errFences) {
			t.Fatalf("cut to %d of %d bytes: %v", n, len(b), err)
		}
	}
	for bit := 0; bit < 8*len(b); bit++ {
		c := append([]byte(nil), b...)
		c[bit/8] ^= 1 << (bit % 8)
		if _, err := decodeFences(c); !errors.Is(err, errFences) {
			t.Fatalf("bit %d flipped: %v", bit, err)
		}
	}
	// Well-formed but refused: checksummed anew.
	resum := func(mut func([]byte)) []byte {
		c := append([]byte(nil), b[:len(b)-8]...)
		mut(c)
		return binary.LittleEndian.AppendUint64(c, xxh3.Hash(c))
	}
	for name, mut := range map[string]func([]byte){
		"version 3":     func(c []byte) { c[8] = 3 },
		"reserved":      func(c []byte) { c[21] = 1 },
		"too many keys": func(c []byte) { binary.LittleEndian.PutUint32(c[12:], maxPendingTotal+1) },
		"one key more":  func(c []byte) { binary.LittleEndian.PutUint32(c[12:], 4) },
		"empty key":     func(c []byte) { binary.LittleEndian.PutUint16(c[fencesHeader+68:], 0) },
	} {
		if _, err := decodeFences(resum(mut)); !errors.Is(err, errFences) {
			t.Errorf("%s: %v", name, err)
		}
	}
	// Version 1 listed deletes of version-1 values, which this build
	// never reads: nothing to fence.
	if v1, err := decodeFences(resum(func(c []byte) { c[8] = 1 })); err != nil || len(v1.keys)+len(v1.spaces) != 0 {
		t.Errorf("version 1: %+v %v", v1, err)
	}
	if _, err := decodeFences(append(resum(func([]byte) {}), 0)); !errors.Is(err, errFences) {
		t.Error("a byte after the checksum was accepted")
	}
}

func TestNSPrefixOf(t *testing.T) {
	df := testFences()
	for _, k := range df.keys {
		want := remote.NewKeyspace(nil).NamespacePrefix(k.fk.NS)
		if got := nsPrefixOf(k.store); got != want {
			t.Fatalf("nsPrefixOf(%q) = %q, want %q", k.store, got, want)
		}
	}
}
