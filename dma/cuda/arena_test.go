package cuda

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

func newTestEngine(t *testing.T, devices int, cfg Config) (*fakeDriver, *Engine) {
	t.Helper()
	drv := newFakeDriver(devices)
	cfg.Logger = quiet()
	e, err := newEngine(drv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		drv.releaseAll()
		e.Close()
		leakcheck.VerifyNone(t)
	})
	return drv, e
}

func regionOn(drv *fakeDriver, dev int, uuidOf int) dma.RegionSpec {
	h, mem := drv.export(dev, 0, 1<<16)
	m := &dma.IPCMemory{Handle: h, Device: 0, AllocSize: uint64(len(mem))}
	if uuidOf >= 0 {
		u := fakeUUID(uuidOf)
		m.DeviceUUID = u[:]
	}
	return dma.RegionSpec{CUDA: m, BlockStride: 4096, NumBlocks: 16, SegmentBytes: 4096}
}

func opened(drv *fakeDriver) (devs []int) {
	drv.locked(func() {
		for ord := range drv.gpus {
			devs = append(devs, ord)
		}
	})
	return devs
}

// TestArenaPinnedByTheDeviceThatUsesIt: with several GPUs visible, no
// context is made on one nobody uses: the arena is pinned by the device of
// the first region, and only that device is set up.
func TestArenaPinnedByTheDeviceThatUsesIt(t *testing.T) {
	drv, e := newTestEngine(t, 4, Config{})
	arena := make([]byte, 1<<16)
	if err := e.SetArena(arena); err != nil {
		t.Fatal(err)
	}
	if devs := opened(drv); len(devs) != 0 {
		t.Fatalf("SetArena set up devices %v with four visible and no region yet", devs)
	}
	r, err := e.Open(regionOn(drv, 2, 2), dma.Peer{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	drv.locked(func() {
		if drv.registerOn != 2 || len(drv.registered) != len(arena) {
			t.Errorf("arena registered by device %d (%d bytes), want device 2", drv.registerOn, len(drv.registered))
		}
	})
	if devs := opened(drv); len(devs) != 1 || devs[0] != 2 {
		t.Errorf("devices set up: %v, want only 2", devs)
	}
}

func TestArenaDevice(t *testing.T) {
	for _, tc := range []struct {
		name    string
		devices int
		cfg     string
		want    int // device that pins at SetArena
		wantErr string
	}{
		{name: "one device visible: pinned at once", devices: 1, want: 0},
		{name: "by ordinal", devices: 3, cfg: "2", want: 2},
		{name: "by UUID", devices: 3, cfg: FormatUUID(func() []byte { u := fakeUUID(1); return u[:] }()), want: 1},
		{name: "unknown UUID", devices: 3, cfg: "GPU-00000000-0000-0000-0000-000000000000", wantErr: "is not visible"},
		{name: "ordinal out of range", devices: 3, cfg: "3", wantErr: "want an ordinal 0..2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			drv := newFakeDriver(tc.devices)
			e, err := newEngine(drv, Config{ArenaDevice: tc.cfg, Logger: quiet()})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			if err := e.SetArena(make([]byte, 4096)); err != nil {
				t.Fatal(err)
			}
			drv.locked(func() {
				if drv.registerOn != tc.want {
					t.Errorf("registered by device %d, want %d", drv.registerOn, tc.want)
				}
			})
		})
	}
}

// TestArenaReleasedBeforeUnmap: SetArena(nil), which the daemon calls before
// it unmaps the arena, unregisters it; Close then does not touch the
// unmapped memory again.
func TestArenaReleasedBeforeUnmap(t *testing.T) {
	drv := newFakeDriver(1)
	e, err := newEngine(drv, Config{Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.SetArena(mem); err != nil {
		t.Fatal(err)
	}
	if err := e.SetArena(nil); err != nil {
		t.Fatal(err)
	}
	drv.locked(func() {
		if drv.registered != nil {
			t.Error("SetArena(nil) left the arena registered")
		}
	})
	if err := unix.Munmap(mem); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Errorf("Close after SetArena(nil): %v", err)
	}
	leakcheck.VerifyNone(t)
}

// TestArenaFollowsTheGPUsNUMANode: on a machine with several NUMA nodes the
// arena's pages are moved to the node sysfs names for the pinning GPU's PCI
// address, before the arena is pinned.
func TestArenaFollowsTheGPUsNUMANode(t *testing.T) {
	root := t.TempDir()
	for _, n := range []string{"node0", "node1"} {
		if err := os.MkdirAll(filepath.Join(root, "devices", "system", "node", n), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// The driver names the bus in upper case (0000:1B:00.0); sysfs in lower.
	dev := filepath.Join(root, "bus", "pci", "devices", "0000:1b:00.0")
	if err := os.MkdirAll(dev, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dev, "numa_node"), []byte("1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		noNUMA   bool
		badBus   bool
		wantNode int
	}{
		{name: "moved to node 1", wantNode: 1},
		{name: "NoNUMA", noNUMA: true, wantNode: -1},
		{name: "no PCI address: left alone", badBus: true, wantNode: -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			drv, e := newTestEngine(t, 2, Config{NoNUMA: tc.noNUMA, ArenaDevice: "1"})
			drv.badBusID = tc.badBus
			e.sysfs = root
			var mu sync.Mutex
			node := -1
			pinnedBefore := false
			e.preferNode = func(mem []byte, n int) error {
				mu.Lock()
				defer mu.Unlock()
				node = n
				drv.locked(func() { pinnedBefore = drv.registered != nil })
				return nil
			}
			if err := e.SetArena(make([]byte, 4096)); err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			defer mu.Unlock()
			if node != tc.wantNode || pinnedBefore {
				t.Errorf("moved to node %d (pinned already: %v), want node %d before pinning", node, pinnedBefore, tc.wantNode)
			}
		})
	}
}

func TestNUMANode(t *testing.T) {
	root := t.TempDir()
	dev := filepath.Join(root, "bus", "pci", "devices", "0000:3b:00.0")
	os.MkdirAll(dev, 0o755)
	os.WriteFile(filepath.Join(dev, "numa_node"), []byte("-1\n"), 0o644)
	if n, err := numaNode(root, "0000:3B:00.0"); err != nil || n != -1 {
		t.Errorf("numaNode = %d, %v; want -1 (no node)", n, err)
	}
	if _, err := numaNode(root, "0000:99:00.0"); err == nil {
		t.Error("a device sysfs does not list: no error")
	}
	os.WriteFile(filepath.Join(dev, "numa_node"), []byte("zero\n"), 0o644)
	if _, err := numaNode(root, "0000:3b:00.0"); err == nil {
		t.Error("garbage in numa_node: no error")
	}
}

// TestPreferNode runs mbind on real memory: node 0 exists on every Linux
// machine, and the pages end up there.
func TestPreferNode(t *testing.T) {
	mem, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	for i := range mem {
		mem[i] = 1
	}
	if err := preferNode(mem, 0); err != nil {
		if errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EPERM) {
			t.Skipf("mbind is not available here: %v", err)
		}
		t.Fatal(err)
	}
	nodes, err := pageNodes(mem)
	if err != nil {
		t.Fatal(err)
	}
	for i, n := range nodes {
		if n != 0 {
			t.Fatalf("page %d on node %d after mbind to node 0", i, n)
		}
	}
	if err := preferNode(mem, 5000); err == nil {
		t.Error("node 5000 accepted")
	}
}

// TestOpenChecksTheMemorysDevice: a region names its device by UUID (every
// worker under its own CUDA_VISIBLE_DEVICES calls its GPU 0); the engine
// opens it there. Memory that is on another device than the region says is
// refused: copies would cross devices, or the client is confused.
func TestOpenChecksTheMemorysDevice(t *testing.T) {
	drv, e := newTestEngine(t, 3, Config{})
	if err := e.SetArena(make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	r, err := e.Open(regionOn(drv, 2, 2), dma.Peer{})
	if err != nil {
		t.Fatalf("a region on device 2, named by UUID, ordinal 0 as its process sees it: %v", err)
	}
	r.Close()
	_, err = e.Open(regionOn(drv, 1, 2), dma.Peer{})
	if !errors.Is(err, dma.ErrBadRegion) || !strings.Contains(err.Error(), "on device 1") || !strings.Contains(err.Error(), "names device 2") {
		t.Fatalf("memory on device 1 in a region naming device 2: %v", err)
	}
	drv.locked(func() {
		if drv.opens != 2 || drv.closes != 2 {
			t.Errorf("%d opens, %d closes: the refused mapping must be closed", drv.opens, drv.closes)
		}
	})
}

// TestOpenTorchHandle: PyTorch's 66-byte form of a handle opens the same
// allocation as the raw handle, once for both.
func TestOpenTorchHandle(t *testing.T) {
	drv, e := newTestEngine(t, 1, Config{})
	if err := e.SetArena(make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	spec := regionOn(drv, 0, -1)
	raw, err := e.Open(spec, dma.Peer{})
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	spec.CUDA.Handle = torchHandle(2, spec.CUDA.Handle)
	spec.Offset = 4096
	spec.NumBlocks = 15
	torch, err := e.Open(spec, dma.Peer{})
	if err != nil {
		t.Fatalf("PyTorch's handle refused: %v", err)
	}
	defer torch.Close()
	drv.locked(func() {
		if drv.opens != 1 {
			t.Errorf("the allocation was opened %d times, want once", drv.opens)
		}
	})
}
