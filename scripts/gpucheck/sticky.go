//go:build cuda

package main

import (
	"context"
	"fmt"
	"time"

	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
)

// stickyMain runs against a daemon started with --cuda-fault-after-batches
// N: it stores until a store fails, and checks that it failed as a device
// fault must (the job's blocks DMA_ERROR, or the call refused because the
// daemon is going away) and that the daemon then stops serving. The script
// checks the daemon's exit status and log.
func stickyMain(args []string) int {
	fs := flags("sticky")
	jsonPath := fs.String("json", "", "write the result here")
	socket := fs.String("socket", "", "the daemon's unix socket (required)")
	device := fs.Int("device", 0, "CUDA device")
	maxStores := fs.Int("max-stores", 10, "give up after this many stores")
	fs.Parse(args)
	r := newResult("sticky")
	defer r.write(*jsonPath)
	if err := sticky(r, *socket, *device, *maxStores); err != nil {
		r.fail("%v", err)
		return 1
	}
	r.say("PASS")
	return 0
}

func sticky(r *result, socket string, device, maxStores int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	g, err := newGPU(device)
	if err != nil {
		return err
	}
	defer g.close()
	uuid, _ := deviceUUID(device)
	cl, err := client.Dial(socket)
	if err != nil {
		return err
	}
	defer cl.Close()
	if err := waitHealthy(ctx, cl, socket); err != nil {
		return err
	}
	bc := benchCase{Name: "sticky", Regions: 2, SegBytes: 64 << 10, RegionBlocks: 64, Xfer: 4}
	k, err := newKV(ctx, g, cl, bc, uuid)
	defer func() {
		k.regID = 0 // the daemon is gone: nothing to unregister
		k.free()
	}()
	if err != nil {
		return err
	}
	for i := 1; i <= maxStores; i++ {
		if _, err := cl.Invalidate(ctx, []uint32{k.nsID}, nil); err != nil {
			r.Data["failed_store"] = i
			r.Data["failure"] = "Invalidate: " + err.Error()
			r.say("store %d: the daemon refused the call before it: %v", i, err)
			break
		}
		res, err := cl.Store(ctx, k.regID, []*pb.Job{k.job(k.src)}, true)
		if err == nil && len(res) == 1 && res[0].GetOk() {
			r.say("store %d: ok", i)
			continue
		}
		r.Data["failed_store"] = i
		if err != nil {
			r.Data["failure"] = err.Error()
			r.say("store %d: the call failed: %v", i, err)
			break
		}
		counts := map[string]int{}
		for _, f := range res[0].GetFailures() {
			counts[f.GetStatus().String()]++
		}
		r.Data["failure"] = fmt.Sprintf("job failed: %v", counts)
		r.say("store %d: job failed, blocks by status %v", i, counts)
		if counts[pb.BlockStatus_BLOCK_STATUS_DMA_ERROR.String()] != len(res[0].GetFailures()) {
			return fmt.Errorf("store %d failed with %v, want every block DMA_ERROR", i, counts)
		}
		break
	}
	if _, ok := r.Data["failed_store"]; !ok {
		return fmt.Errorf("%d stores succeeded: the daemon never lost its context (was it started with --cuda-fault-after-batches?)", maxStores)
	}
	// The daemon must stop serving: NOT_SERVING, then gone.
	deadline := time.Now().Add(30 * time.Second)
	for {
		hctx, hcancel := context.WithTimeout(ctx, time.Second)
		ok, err := cl.Healthy(hctx)
		hcancel()
		if !ok {
			r.Data["health_after"] = fmt.Sprint(err)
			r.say("health after the fault: not serving (%v)", err)
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the daemon still says SERVING 30s after its context was lost")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
