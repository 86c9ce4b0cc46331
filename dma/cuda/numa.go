package cuda

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The arena's pages should sit on the NUMA node of the GPU that copies to
// and from them: a copy that crosses the socket interconnect runs slower and
// loads it. The daemon maps and locks the arena before it knows which GPU
// will use it, so the pages are moved afterwards, once, before the arena is
// pinned (cuMemHostRegister): pinned pages cannot move.

// numaNode returns the NUMA node of PCI device busID as sysfs under root
// says, or -1 when it says none (a single-node machine, a VM).
func numaNode(root, busID string) (int, error) {
	// The driver writes the domain and bus in upper case; sysfs uses lower.
	p := filepath.Join(root, "bus", "pci", "devices", strings.ToLower(busID), "numa_node")
	b, err := os.ReadFile(p)
	if err != nil {
		return -1, err
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1, fmt.Errorf("%s: %q is not a node number", p, b)
	}
	return n, nil
}

// onlineNodes counts the machine's online NUMA nodes (sysfs under root).
func onlineNodes(root string) int {
	ents, err := filepath.Glob(filepath.Join(root, "devices", "system", "node", "node[0-9]*"))
	if err != nil {
		return 0
	}
	return len(ents)
}

// The mbind(2) mode and flag, from <linux/mempolicy.h>.
const (
	mpolPreferred = 1
	mpolMFMove    = 1 << 1
)

// preferNode makes node the preferred node of mem's pages (MPOL_PREFERRED:
// other nodes still serve when it is full) and moves the pages already
// placed elsewhere (MPOL_MF_MOVE).
func preferNode(mem []byte, node int) error {
	if len(mem) == 0 {
		return nil
	}
	if node < 0 || node >= 1024 {
		return fmt.Errorf("NUMA node %d out of range", node)
	}
	var mask [1024 / 64]uint64
	mask[node/64] |= 1 << (node % 64)
	_, _, errno := unix.Syscall6(unix.SYS_MBIND,
		uintptr(unsafe.Pointer(unsafe.SliceData(mem))), uintptr(len(mem)),
		mpolPreferred, uintptr(unsafe.Pointer(&mask[0])), uintptr(len(mask)*64+1), mpolMFMove)
	if errno != 0 {
		return fmt.Errorf("mbind to NUMA node %d: %w", node, errno)
	}
	return nil
}

// pageNodes reports the node each page of mem is on (move_pages(2) in query
// mode), for tests and logs.
func pageNodes(mem []byte) ([]int, error) {
	ps := os.Getpagesize()
	n := (len(mem) + ps - 1) / ps
	pages := make([]uintptr, n)
	status := make([]int32, n)
	base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	for i := range pages {
		pages[i] = base + uintptr(i*ps)
	}
	_, _, errno := unix.Syscall6(unix.SYS_MOVE_PAGES, 0, uintptr(n),
		uintptr(unsafe.Pointer(&pages[0])), 0, uintptr(unsafe.Pointer(&status[0])), 0)
	if errno != 0 {
		return nil, fmt.Errorf("move_pages: %w", errno)
	}
	out := make([]int, n)
	for i, s := range status {
		out[i] = int(s)
	}
	return out, nil
}

// followDevice moves the arena's pages to d's NUMA node, when the machine
// has several and sysfs names d's. It only logs failures: placement is
// about speed, never correctness.
func (e *Engine) followDevice(mem []byte, d *device) {
	if onlineNodes(e.sysfs) < 2 {
		return
	}
	bus, err := e.drv.pciBusID(d.ord)
	if err != nil {
		e.log.Warn("cannot place the arena on the GPU's NUMA node: no PCI address", "device", d.ord, "err", err)
		return
	}
	node, err := numaNode(e.sysfs, bus)
	if err != nil || node < 0 {
		e.log.Info("the GPU's NUMA node is unknown; the arena stays where it is", "device", d.ord, "pci", bus, "err", err)
		return
	}
	start := time.Now()
	if err := e.preferNode(mem, node); err != nil {
		if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOSYS) {
			e.log.Info("the arena cannot be moved to the GPU's NUMA node", "device", d.ord, "node", node, "err", err)
		} else {
			e.log.Warn("moving the arena to the GPU's NUMA node failed", "device", d.ord, "node", node, "err", err)
		}
		return
	}
	e.log.Info("arena placed on the GPU's NUMA node", "device", d.ord, "pci", bus, "node", node, "bytes", len(mem), "took", time.Since(start))
}
