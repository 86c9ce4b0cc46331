package baseline

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
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
	r, err := MeasureRedis(context.Background(), bin, t.TempDir(), port, keys, values, 2)
	if err != nil {
		t.Fatal(err)
	}
	if r.GetGBps <= 0 || r.SetGBps <= 0 || r.Version == "" || r.Blocks != 6 {
		t.Errorf("result %+v", r)
	}
}
