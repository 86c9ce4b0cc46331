package baseline

import (
	"os"
	"strings"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
)

// The test binary is its own ProcessCopier helper.
func TestMain(m *testing.M) {
	ServeIfHelper()
	os.Exit(m.Run())
}

// testRegion is a /dev/shm region of blocks blocks of a small shape,
// removed when the test ends.
func testRegion(t *testing.T, layers, heads, blocks int) *model.Region {
	t.Helper()
	shape := model.Shape{Name: "t", Layers: layers, BlockTokens: 16, KVHeads: heads, HeadDim: 64, DTypeBytes: 2}
	region, err := model.NewRegion("/dev/shm", shape, blocks)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { region.Close() })
	return region
}

func startProcessCopier(t *testing.T, region *model.Region) *ProcessCopier {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p, err := StartProcessCopier(exe, region, 0, 2)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// The helper process copies each block's segments into its own buffer
// and back out, into the slots the parent chose: a store then a load of
// the same slots brings every byte back, and a block the helper did not
// copy is left alone.
func TestProcessCopier(t *testing.T) {
	region := testRegion(t, 2, 2, 8)
	shape := region.Shape
	p := startProcessCopier(t, region)
	defer func() {
		if err := p.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	}()
	blocks := []int{5, 1, 6}
	keys := [][]byte{[]byte("key five, thirty-two bytes long.."), []byte("key one, thirty-two bytes long..."), []byte("key six, thirty-two bytes long...")}
	for round := range 3 { // the slots move on, and wrap, between rounds
		for i, b := range blocks {
			region.Fill(b, append(keys[i], byte(round)))
		}
		first := p.next
		el, n, err := p.Copy(blocks, true)
		if err != nil || el <= 0 || n != uint64(len(blocks)*shape.BlockBytes()) {
			t.Fatalf("round %d store copy: %v, %d bytes, %v", round, el, n, err)
		}
		for _, b := range blocks {
			region.Poison(b)
		}
		region.Fill(2, []byte("untouched"))
		p.next = first
		if _, n, err := p.Copy(blocks, false); err != nil || n != uint64(len(blocks)*shape.BlockBytes()) {
			t.Fatalf("round %d load copy: %d bytes, %v", round, n, err)
		}
		for i, b := range blocks {
			if err := region.Check(b, append(keys[i], byte(round))); err != nil {
				t.Errorf("round %d, after the load copy: %v", round, err)
			}
		}
		if err := region.Check(2, []byte("untouched")); err != nil {
			t.Errorf("round %d: a block not copied changed: %v", round, err)
		}
		p.next = (first + len(blocks) + 11) % p.spec.Slots
	}
	if _, _, err := p.Copy([]int{8}, true); err == nil || !strings.Contains(err.Error(), "block 8") {
		t.Errorf("a block past the region: %v", err)
	}
}

// A helper that is gone makes Copy fail, not hang or report a time.
func TestProcessCopierHelperGone(t *testing.T) {
	p := startProcessCopier(t, testRegion(t, 1, 1, 4))
	if _, _, err := p.Copy([]int{0, 3}, true); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.Copy([]int{1}, false); err == nil {
		t.Error("a copy by a killed helper reported no error")
	}
	if _, _, err := p.Copy([]int{1}, false); err == nil {
		t.Error("a second copy by a killed helper reported no error")
	}
	if err := p.Close(); err == nil {
		t.Error("Close of a killed helper reported no error")
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// A helper that cannot map its region says why and does not start.
func TestProcessCopierBadRegion(t *testing.T) {
	region := testRegion(t, 1, 1, 4)
	region.Close() // the file is gone
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p, err := StartProcessCopier(exe, region, 0, 1)
	if err == nil {
		p.Close()
		t.Fatal("started on a region file that does not exist")
	}
	if !strings.Contains(err.Error(), "the helper said: segment copy baseline") || !strings.Contains(err.Error(), region.Path) {
		t.Errorf("the error does not carry what the helper said: %v", err)
	}
}
