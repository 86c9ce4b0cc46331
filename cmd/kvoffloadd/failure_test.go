package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// failingCopier wraps the host copy engine with what the CUDA engine does
// after a sticky error: Failed closes, the batches it held fail, and every
// later batch fails at once. Held batches may instead be released.
type failingCopier struct {
	dma.Engine
	arrived chan struct{}
	failed  chan struct{}

	mu      sync.Mutex
	holding bool
	held    []*dma.Batch
	err     error
}

func (c *failingCopier) Failed() <-chan struct{} { return c.failed }

func (c *failingCopier) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *failingCopier) Submit(b *dma.Batch) {
	c.mu.Lock()
	switch {
	case c.err != nil:
		err := c.err
		c.mu.Unlock()
		go b.Done(fmt.Errorf("%w: %w", dma.ErrCopy, err))
		return
	case c.holding:
		c.held = append(c.held, b)
		c.mu.Unlock()
		c.arrived <- struct{}{}
		return
	}
	c.mu.Unlock()
	c.Engine.Submit(b)
}

func (c *failingCopier) hold() {
	c.mu.Lock()
	c.holding = true
	c.mu.Unlock()
}

// release submits the batches held, and those that come later, to the
// host engine.
func (c *failingCopier) release() {
	c.mu.Lock()
	c.holding = false
	held := c.held
	c.held = nil
	c.mu.Unlock()
	for _, b := range held {
		c.Engine.Submit(b)
	}
}

func (c *failingCopier) fail(err error) {
	c.mu.Lock()
	c.err = err
	held := c.held
	c.held = nil
	c.mu.Unlock()
	close(c.failed)
	for _, b := range held {
		go b.Done(fmt.Errorf("%w: %w", dma.ErrCopy, err))
	}
}

// TestCopyEngineFailureStopsTheDaemon: when the copy engine fails as a
// whole (the CUDA engine after a sticky error: an illegal address, an
// uncorrectable ECC error), the daemon must not stay SERVING and fail every
// job: the job in flight fails (DMA_ERROR), health goes NOT_SERVING, and
// the daemon exits with an error naming the cause, for a supervisor to
// restart it.
func TestCopyEngineFailureStopsTheDaemon(t *testing.T) {
	fc := &failingCopier{arrived: make(chan struct{}, 16), failed: make(chan struct{})}
	wrapCopier = func(e dma.Engine) dma.Engine {
		fc.Engine = e
		return fc
	}
	t.Cleanup(func() { wrapCopier = nil })
	sock := filepath.Join(t.TempDir(), "kv.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	exited := make(chan error, 1)
	go func() {
		exited <- run(ctx, []string{"--socket", sock, "--metrics-addr", "", "--cpu-bytes", "16MiB", "--shutdown-timeout", "1m"}, io.Discard, io.Discard)
	}()
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitServing(t, c, true, exited)

	m := testenv.Model{Layers: 2, Blocks: 8, SegBytes: 4096}
	r := testenv.NewRegion(t, m.RegionBytes())
	rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer rcancel()
	reg, err := c.Register(rctx, []byte(t.Name()), m.Layout(), m.Regions(r), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	h := [][]byte{m.Hash(1, 0), m.Hash(1, 1)}
	m.Fill(r, 0, h[0])
	res, err := c.Store(rctx, reg.RegistrationId, []*pb.Job{testenv.Job(1, h[:1], []uint32{0})}, true)
	if err != nil || !res[0].Ok {
		t.Fatalf("store before the failure: %v %v", res, err)
	}

	fc.hold()
	stored := make(chan []*pb.JobResult, 1)
	go func() {
		m.Fill(r, 1, h[1])
		res, err := c.Store(rctx, reg.RegistrationId, []*pb.Job{testenv.Job(2, h[1:], []uint32{1})}, true)
		if err != nil {
			t.Errorf("store during the failure: %v", err)
		}
		stored <- res
	}()
	<-fc.arrived
	fc.fail(errors.New("cuEventSynchronize on device 0: CUDA_ERROR_ILLEGAL_ADDRESS (700)"))

	res = <-stored
	if len(res) != 1 || res[0].Ok || len(res[0].Failures) != 1 || res[0].Failures[0].Status != pb.BlockStatus_BLOCK_STATUS_DMA_ERROR {
		t.Errorf("the job in flight: %v, want its block failed DMA_ERROR", res)
	}
	select {
	case err := <-exited:
		if err == nil || !strings.Contains(err.Error(), "copy engine failed") || !strings.Contains(err.Error(), "CUDA_ERROR_ILLEGAL_ADDRESS") {
			t.Fatalf("run returned %v, want an error naming the failed engine and its cause", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the daemon kept running after its copy engine failed")
	}
	if ok, _ := c.Healthy(context.Background()); ok {
		t.Error("still SERVING after exit")
	}
}

// waitServing waits until health is SERVING (or not), failing if the daemon
// exits first.
func waitServing(t *testing.T, c *client.Client, want bool, exited chan error) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		ok, _ := c.Healthy(ctx)
		cancel()
		if ok == want {
			return
		}
		select {
		case err := <-exited:
			t.Fatalf("the daemon exited: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("health never became serving=%v", want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
