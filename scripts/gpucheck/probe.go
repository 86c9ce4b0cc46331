//go:build cuda

package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"gorgonia.org/cu"
)

const probeBytes = 8 << 20

func probeFill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) ^ seed ^ byte(i>>12)
	}
}

// probeMain is the exporting side: it fills device memory behind a stall and
// an IPC event, and lets a child process read and rewrite it.
func probeMain(args []string) int {
	fs := flags("probe")
	jsonPath := fs.String("json", "", "write the result here")
	device := fs.Int("device", 0, "CUDA device")
	fs.Parse(args)
	r := newResult("probe")
	defer r.write(*jsonPath)
	if err := probe(r, *device); err != nil {
		r.fail("%v", err)
	}
	if len(r.Failures) > 0 {
		return 1
	}
	r.say("PASS")
	return 0
}

func probe(r *result, device int) error {
	r.Data["driver_version"] = cu.Version()
	batch, berr := haveMemcpyBatch()
	r.Data["memcpy_batch"] = batch
	if berr != nil {
		r.Data["memcpy_batch_err"] = berr.Error()
	}
	n, err := cu.NumDevices()
	if err != nil {
		return fmt.Errorf("cuDeviceGetCount: %w", err)
	}
	r.Data["devices"] = n
	dev, err := cu.GetDevice(device)
	if err != nil {
		return err
	}
	name, _ := dev.Name()
	uuid, err := deviceUUID(device)
	if err != nil {
		return err
	}
	r.Data["device"] = map[string]any{"ordinal": device, "name": name, "uuid": hex.EncodeToString(uuid)}
	r.say("driver %d, %d devices; device %d %s (uuid %x); cuMemcpyBatchAsync: %v", cu.Version(), n, device, name, uuid, batch)
	ctx, err := dev.RetainPrimaryCtx()
	if err != nil {
		return err
	}
	defer dev.ReleasePrimaryCtx()
	if err := cu.SetCurrentContext(ctx); err != nil {
		return err
	}
	s, err := cu.MakeStream(cu.NonBlocking)
	if err != nil {
		return err
	}
	defer s.Destroy()
	// An allocation with the probed memory at an offset inside it, as the
	// caching allocator hands out tensors.
	mem, err := cu.MemAlloc(probeBytes + 4096)
	if err != nil {
		return err
	}
	defer cu.MemFree(mem)
	host, err := newPinned(probeBytes + 4096)
	if err != nil {
		return err
	}
	defer host.free()
	probeFill(host.b[4096:], 0x11)
	ev, err := newIPCEvent()
	if err != nil {
		return err
	}
	defer ev.destroy()
	// The event completes 500 ms from now, after the fill: the child must
	// read the filled bytes, so it has to wait for the event.
	if err := stall(s, 500*time.Millisecond); err != nil {
		return err
	}
	if err := cu.MemcpyHtoDAsync(mem, host.ptr(0), probeBytes+4096, s); err != nil {
		return fmt.Errorf("cuMemcpyHtoDAsync: %w", err)
	}
	if err := ev.record(s); err != nil {
		return err
	}
	h, err := ipcMemHandle(mem)
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	child := exec.CommandContext(cctx, os.Args[0], "probe-child", "--handle", hex.EncodeToString(h),
		"--event", hex.EncodeToString(ev.handle), "--uuid", hex.EncodeToString(uuid), "--offset", "4096")
	out, err := child.CombinedOutput()
	r.Data["child_output"] = strings.TrimSpace(string(out))
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		r.say("child: %s", l)
	}
	if err != nil {
		return fmt.Errorf("the child process failed: %v", err)
	}
	if err := s.Synchronize(); err != nil {
		return err
	}
	if err := cu.MemcpyDtoH(host.ptr(0), mem, probeBytes+4096); err != nil {
		return err
	}
	want := make([]byte, probeBytes)
	probeFill(want, 0x22)
	if !bytes.Equal(host.b[4096:], want) {
		return fmt.Errorf("the bytes the child wrote through its IPC mapping are not in this process's memory")
	}
	r.say("IPC memory and event across processes, host registration, device by UUID: ok")
	return nil
}

// probeChild is the importing side, as the daemon is.
func probeChild(args []string) int {
	fs := flags("probe-child")
	hh := fs.String("handle", "", "memory handle, hex")
	eh := fs.String("event", "", "event handle, hex")
	uh := fs.String("uuid", "", "device UUID, hex")
	off := fs.Int("offset", 0, "offset of the probed bytes in the allocation")
	fs.Parse(args)
	if err := probeImport(*hh, *eh, *uh, *off); err != nil {
		fmt.Println("FAIL:", err)
		return 1
	}
	return 0
}

func probeImport(hh, eh, uh string, off int) error {
	h, err1 := hex.DecodeString(hh)
	eb, err2 := hex.DecodeString(eh)
	want, err3 := hex.DecodeString(uh)
	if err1 != nil || err2 != nil || err3 != nil {
		return fmt.Errorf("bad arguments")
	}
	n, err := cu.NumDevices()
	if err != nil {
		return err
	}
	ord := -1
	for i := range n {
		u, err := deviceUUID(i)
		if err != nil {
			return err
		}
		if bytes.Equal(u, want) {
			ord = i
		}
	}
	if ord < 0 {
		return fmt.Errorf("no device with UUID %x among %d", want, n)
	}
	fmt.Printf("device found by UUID: ordinal %d of %d\n", ord, n)
	dev, _ := cu.GetDevice(ord)
	ctx, err := dev.RetainPrimaryCtx()
	if err != nil {
		return err
	}
	defer dev.ReleasePrimaryCtx()
	if err := cu.SetCurrentContext(ctx); err != nil {
		return err
	}
	p, err := ipcOpenMem(h)
	if err != nil {
		return err
	}
	defer ipcCloseMem(p)
	pd, err := pointerDevice(p)
	if err != nil {
		return err
	}
	if pd != ord {
		return fmt.Errorf("the opened memory is on device %d, not %d", pd, ord)
	}
	ev, err := openIPCEvent(eb)
	if err != nil {
		return err
	}
	defer ev.destroy()
	start := time.Now()
	for {
		done, err := ev.done()
		if err != nil {
			return err
		}
		if done {
			break
		}
		if time.Since(start) > 30*time.Second {
			return fmt.Errorf("the exporter's event did not complete in 30s")
		}
		time.Sleep(time.Millisecond)
	}
	fmt.Printf("waited %v for the exporter's IPC event (it stalled 500ms)\n", time.Since(start).Round(time.Millisecond))
	host, err := newPinned(probeBytes)
	if err != nil {
		return err
	}
	defer host.free()
	if err := cu.MemcpyDtoH(host.ptr(0), p+cu.DevicePtr(off), probeBytes); err != nil {
		return err
	}
	want2 := make([]byte, probeBytes)
	probeFill(want2, 0x11)
	if !bytes.Equal(host.b, want2) {
		return fmt.Errorf("the bytes read through the IPC mapping are not what the exporter wrote before its event")
	}
	probeFill(host.b, 0x22)
	if err := cu.MemcpyHtoD(p+cu.DevicePtr(off), host.ptr(0), probeBytes); err != nil {
		return err
	}
	fmt.Println("read the exporter's bytes after its event, wrote new ones: ok")
	return nil
}
