package disk

import (
	"bytes"
	"maps"
	"testing"
)

// TestReadCatalogStreams: ReadCatalog reads what EncodeCatalog wrote as
// DecodeCatalog does, keeps only the entries asked for, and refuses a
// changed byte or a cut file.
func TestReadCatalogStreams(t *testing.T) {
	ns := map[[32]byte][]byte{}
	for i := range 50 {
		var d [32]byte
		d[0], d[1] = byte(i), byte(i*7)
		ns[d] = bytes.Repeat([]byte{byte(i)}, 100+i*1000)
	}
	b := EncodeCatalog(ns)
	got, err := ReadCatalog(bytes.NewReader(b), int64(len(b)), nil)
	if err != nil || !maps.EqualFunc(got, ns, bytes.Equal) {
		t.Fatalf("read %d entries (%v), want %d", len(got), err, len(ns))
	}
	got, err = ReadCatalog(bytes.NewReader(b), int64(len(b)), func(d [32]byte) bool { return d[0]%2 == 0 })
	if err != nil || len(got) != 25 {
		t.Fatalf("kept %d entries (%v), want 25", len(got), err)
	}
	for _, off := range []int{3, 20, len(b) / 2, len(b) - 1} {
		bad := bytes.Clone(b)
		bad[off] ^= 1
		if _, err := ReadCatalog(bytes.NewReader(bad), int64(len(bad)), nil); err == nil {
			t.Fatalf("a byte changed at %d was not noticed", off)
		}
	}
	if _, err := ReadCatalog(bytes.NewReader(b[:len(b)-100]), int64(len(b)-100), nil); err == nil {
		t.Fatal("a cut catalog was read")
	}
}
