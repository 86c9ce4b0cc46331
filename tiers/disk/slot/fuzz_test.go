package slot_test

import (
	"bytes"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
)

// FuzzDecode feeds Decode arbitrary blocks. With repair set, the input is
// padded or cut to HeaderSize and its header checksum recomputed, so the
// fuzzer gets past the checksum to the field checks. Decode must never
// panic, and a header it accepts must encode back to the same bytes (the
// format has one encoding per header).
//
// Run it with a short minimization time: a new interesting input of 4 KiB
// otherwise stalls the fuzzer for up to a minute while it shrinks it.
//
//	go test -run '^$' -fuzz=FuzzDecode -fuzztime=30s -fuzzminimizetime=2s ./tiers/disk/slot
func FuzzDecode(f *testing.F) {
	f.Add(encode(f, testHeader(f, []byte{1, 2, 3}, []byte("seed"))), false)
	f.Add([]byte("KVOFSLOT\x01\x00\x00\x10"), true)
	f.Fuzz(func(t *testing.T, data []byte, repair bool) {
		buf := data
		if repair {
			buf = make([]byte, slot.HeaderSize)
			copy(buf, data)
			resum(buf)
		}
		h, err := slot.Decode(buf)
		if err != nil {
			return
		}
		out := make([]byte, slot.HeaderSize)
		if err := slot.Encode(h, out); err != nil {
			t.Fatalf("Decode accepted a header Encode refuses: %v", err)
		}
		if !bytes.Equal(out, buf) {
			t.Fatal("Encode(Decode(b)) != b")
		}
		if !h.Matches(h.Namespace, h.Group, h.Key()) {
			t.Fatal("a decoded header does not match its own key")
		}
	})
}
