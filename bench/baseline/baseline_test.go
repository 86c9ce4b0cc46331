package baseline

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/slotfile"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

func TestMemcpy(t *testing.T) {
	for _, seg := range []int{64 << 10, 16 << 10} {
		v, err := Memcpy(64<<10, seg, 2, 4<<20, 8<<20)
		if err != nil || v <= 0 {
			t.Errorf("Memcpy(seg %d) = %v, %v", seg, v, err)
		}
	}
	if _, err := Memcpy(64<<10, 24<<10, 2, 4<<20, 8<<20); err == nil {
		t.Error("a segment that does not divide the block is accepted")
	}
}

func TestODirect(t *testing.T) {
	dir := t.TempDir()
	if err := vfs.ProbeDirect(dir); err != nil {
		t.Skip(err)
	}
	r, err := MeasureODirect(dir, 10000, 3, 1<<20, 1)
	if err != nil {
		t.Fatal(err)
	}
	if r.IOBytes != 12288 || r.ReadGBps <= 0 || r.WriteGBps <= 0 || r.FileBytes < 1<<20-12288 {
		t.Errorf("result %+v", r)
	}
}

// The RESP client against a real redis-server: values come back intact.
func TestRedis(t *testing.T) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("no redis-server in PATH")
	}
	port, err := daemon.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	var keys, values [][]byte
	for i := range 6 {
		keys = append(keys, fmt.Appendf(nil, "key-%d", i))
		values = append(values, bytes.Repeat([]byte{byte(i), '\r', '\n'}, 70000+i))
	}
	r, err := MeasureRedis(context.Background(), bin, t.TempDir(), port, keys, values, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r.GetGBps <= 0 || r.SetGBps <= 0 || r.Version == "" || r.Blocks != 6 {
		t.Errorf("result %+v", r)
	}
}

// The segment copier moves each block's segments between the engine
// region and an arena slot, packed back to back, both ways.
func TestSegmentCopier(t *testing.T) {
	region := testRegion(t, 2, 2, 8)
	shape := region.Shape
	c, err := NewSegmentCopier(region, 0, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	blocks := []int{5, 1, 6}
	keys := [][]byte{[]byte("key five, thirty-two bytes long.."), []byte("key one, thirty-two bytes long..."), []byte("key six, thirty-two bytes long...")}
	for i, b := range blocks {
		region.Fill(b, keys[i])
	}
	first := c.next
	el, n, _ := c.Copy(blocks, true)
	if el <= 0 || n != uint64(len(blocks)*shape.BlockBytes()) {
		t.Fatalf("store copy: %v, %d bytes", el, n)
	}
	for i := range blocks {
		slot := c.buf[(first+i)*shape.BlockBytes():][:shape.BlockBytes()]
		for s := range shape.Segments() {
			if j := model.CheckSegment(slot[s*shape.SegmentBytes():(s+1)*shape.SegmentBytes()], keys[i], s); j >= 0 {
				t.Fatalf("block %d segment %d: arena byte %d wrong", blocks[i], s, j)
			}
		}
		region.Poison(blocks[i])
	}
	c.next = first
	if _, n, _ := c.Copy(blocks, false); n != uint64(len(blocks)*shape.BlockBytes()) {
		t.Fatalf("load copy moved %d bytes", n)
	}
	for i, b := range blocks {
		if err := region.Check(b, keys[i]); err != nil {
			t.Errorf("after the load copy: %v", err)
		}
	}
	if c.next != first+len(blocks) {
		t.Errorf("next slot %d, want %d: copies do not move on through the buffer", c.next, first+len(blocks))
	}
}

// The tier reader reads a slot file's written slots, found by Scan, with
// the tier's two reads each.
func TestTierReader(t *testing.T) {
	dir := t.TempDir()
	if err := vfs.ProbeDirect(dir); err != nil {
		t.Skip(err)
	}
	const payload, chunk = 10000, 64 << 10 // 16 KiB slots, 4 per chunk
	path := dir + "/kvoffload-0.slots"
	f, err := vfs.Default.OpenFile(path, 4*chunk, true)
	if err != nil {
		t.Fatal(err)
	}
	hdr, err := vfs.AlignedBuffer(slot.HeaderSize)
	if err != nil {
		t.Fatal(err)
	}
	defer vfs.FreeBuffer(hdr)
	stride := slot.Size(payload)
	var written []int64
	for i, off := range []int64{0, 2 * stride, chunk + stride, 3*chunk + 3*stride} {
		h := slot.Header{Group: 0, PayloadLen: payload, Seq: uint64(i + 1), Slot: uint64(off / 4096)}
		if err := h.SetHash([]byte(fmt.Sprintf("hash %d", i))); err != nil {
			t.Fatal(err)
		}
		if err := slot.Encode(h, hdr); err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(hdr, off); err != nil {
			t.Fatal(err)
		}
		written = append(written, off)
	}
	f.Close()
	found, err := slotfile.Scan([]string{path}, chunk, payload, 3)
	if err != nil {
		t.Fatal(err)
	}
	if len(found) != len(written) {
		t.Fatalf("scan found %d slots, want %d: %+v", len(found), len(written), found)
	}
	for i, s := range found {
		if s.Off != written[i] || string(s.Hash) != fmt.Sprintf("hash %d", i) {
			t.Errorf("slot %d: %+v, want offset %d", i, s, written[i])
		}
	}
	r, err := NewTierReader(found, payload, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	bursts, err := r.Bursts(found, 3)
	if err != nil || len(bursts) != 2 {
		t.Fatalf("bursts %v, %v", bursts, err)
	}
	if r.IOBytes() != int(stride) {
		t.Errorf("IOBytes %d, want the slot's %d", r.IOBytes(), stride)
	}
}
