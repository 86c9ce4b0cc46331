package deploy

import (
	"os"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// shmArenaDir is a fresh directory on tmpfs for a daemon's --cpu-arena-dir
// (a manifest's own path is not on this host).
func shmArenaDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "kvo-deploy-arena-")
	if err != nil {
		t.Skip(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// TestKubernetesCPUArena: the sidecar keeps its arena in a memory-backed
// emptyDir (which outlives restarts of the container, not of the pod), in
// a directory of its own beneath the mount (the daemon refuses the
// emptyDir's world-writable root), large enough for the arena file
// (--cpu-bytes plus 1/32 for its records), mounted by kvoffloadd alone
// (it holds every cached block), and kvoffloadd's memory limit covers the
// file's pages, which are charged to it, and the daemon.
func TestKubernetesCPUArena(t *testing.T) {
	p := findSidecarPod(t, decodeManifests(t))
	dir, ok := flagValue(p.args, "cpu-arena-dir")
	if !ok {
		t.Fatal("kvoffloadd: no --cpu-arena-dir: its CPU tier does not survive a restart of the container")
	}
	vol, mp := mountOf(p.daemon, dir)
	if vol == "" || mp == dir || filepath.Dir(dir) != mp {
		t.Fatalf("--cpu-arena-dir %s: want a directory of its own directly beneath a volume mount (mounted: %q at %q)", dir, vol, mp)
	}
	v := p.volumes[vol]
	if v == nil || v.EmptyDir == nil || v.EmptyDir.Medium != corev1.StorageMediumMemory || v.EmptyDir.SizeLimit == nil {
		t.Fatalf("arena volume %s: want an emptyDir in memory with a sizeLimit", vol)
	}
	arena := flagBytes(t, p.args, "cpu-bytes")
	file := arena + arena/32 + 4<<20
	if v.EmptyDir.SizeLimit.Cmp(*resource.NewQuantity(file, resource.BinarySI)) < 0 {
		t.Errorf("arena volume %s: sizeLimit %s is smaller than the arena file (%d bytes)", vol, v.EmptyDir.SizeLimit.String(), file)
	}
	if ev, _ := mountOf(p.engine, dir); ev == vol {
		t.Errorf("vLLM mounts the arena volume %s: it holds every cached block and is the daemon's alone", vol)
	}
	lim := p.daemon.Resources.Limits[corev1.ResourceMemory]
	if lim.Cmp(*resource.NewQuantity(file+1<<30, resource.BinarySI)) < 0 {
		t.Errorf("kvoffloadd memory limit %s: want at least the arena file (%d bytes, charged to it) + 1GiB", lim.String(), file)
	}
}
