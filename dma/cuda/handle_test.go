package cuda

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

func handle(fill byte) []byte { return bytes.Repeat([]byte{fill}, IPCHandleBytes) }

// torchHandle is h in the form PyTorch's UntypedStorage._share_cuda_()
// returns it: version, type 'c', the cudaIpcMemHandle_t.
func torchHandle(version byte, h []byte) []byte { return append([]byte{version, 'c'}, h...) }

func uuids(n int) [][UUIDBytes]byte {
	out := make([][UUIDBytes]byte, n)
	for i := range out {
		out[i] = fakeUUID(i)
	}
	return out
}

func TestParseRegion(t *testing.T) {
	good := func() dma.RegionSpec {
		return dma.RegionSpec{
			CUDA:         &dma.IPCMemory{Handle: handle(7), Device: 1, AllocSize: 1 << 20},
			Offset:       4096,
			BlockStride:  8192,
			NumBlocks:    100,
			SegmentBytes: 8192,
		}
	}
	tests := []struct {
		name       string
		edit       func(*dma.RegionSpec)
		devices    int
		wantErr    string // empty: accepted
		wantDevice int
	}{
		{name: "good", edit: func(*dma.RegionSpec) {}, devices: 2, wantDevice: 1},
		{name: "blocks end exactly at the allocation", devices: 2, wantDevice: 1, edit: func(s *dma.RegionSpec) {
			s.CUDA.AllocSize = 4096 + 99*8192 + 8192
		}},
		{name: "PyTorch's handle, version 1", devices: 2, wantDevice: 1, edit: func(s *dma.RegionSpec) {
			s.CUDA.Handle = torchHandle(1, s.CUDA.Handle)
		}},
		{name: "PyTorch's handle, version 2", devices: 2, wantDevice: 1, edit: func(s *dma.RegionSpec) {
			s.CUDA.Handle = torchHandle(2, s.CUDA.Handle)
		}},
		{name: "PyTorch's handle, unknown version", devices: 2, wantErr: "version 3, this daemon knows versions 1..2", edit: func(s *dma.RegionSpec) {
			s.CUDA.Handle = torchHandle(3, s.CUDA.Handle)
		}},
		{name: "PyTorch's handle of zeros", devices: 2, wantErr: "all zeros", edit: func(s *dma.RegionSpec) {
			s.CUDA.Handle = torchHandle(2, handle(0))
		}},
		{name: "PyTorch's expandable segment", devices: 2, wantErr: "expandable_segments:False", edit: func(s *dma.RegionSpec) {
			// 'e', then the segment's range and its POSIX fds or fabric
			// handles: nothing cuIpcOpenMemHandle can open.
			s.CUDA.Handle = append([]byte{2, 'e'}, bytes.Repeat([]byte{5}, 40)...)
		}},
		{name: "PyTorch's handle of an unknown type", devices: 2, wantErr: "type 'x'", edit: func(s *dma.RegionSpec) {
			s.CUDA.Handle = append([]byte{2, 'x'}, handle(7)...)
		}},
		{name: "device named by UUID, its ordinal another process's", devices: 2, wantDevice: 1, edit: func(s *dma.RegionSpec) {
			u := fakeUUID(1)
			s.CUDA.Device = 0 // every worker under its own CUDA_VISIBLE_DEVICES says 0
			s.CUDA.DeviceUUID = u[:]
		}},
		{name: "device UUID not visible", devices: 2, wantErr: "device GPU-aa05", edit: func(s *dma.RegionSpec) {
			u := fakeUUID(5)
			s.CUDA.DeviceUUID = u[:]
		}},
		{name: "device UUID of the wrong size", devices: 2, wantErr: "device_uuid is 3 bytes, want 16", edit: func(s *dma.RegionSpec) {
			s.CUDA.DeviceUUID = []byte{1, 2, 3}
		}},
		{name: "handle too short", devices: 2, wantErr: "handle is 63 bytes, want 64", edit: func(s *dma.RegionSpec) {
			s.CUDA.Handle = s.CUDA.Handle[:63]
		}},
		{name: "handle too long", devices: 2, wantErr: "handle is 65 bytes, want 64 (cudaIpcMemHandle_t) or 66", edit: func(s *dma.RegionSpec) {
			s.CUDA.Handle = append(s.CUDA.Handle, 1)
		}},
		{name: "handle empty", devices: 2, wantErr: "handle is 0 bytes", edit: func(s *dma.RegionSpec) {
			s.CUDA.Handle = nil
		}},
		{name: "handle all zeros", devices: 2, wantErr: "all zeros", edit: func(s *dma.RegionSpec) {
			s.CUDA.Handle = handle(0)
		}},
		{name: "device beyond those visible", devices: 1, wantErr: "device 1: this process sees 1 CUDA devices", edit: func(*dma.RegionSpec) {}},
		{name: "negative device", devices: 2, wantErr: "device -1", edit: func(s *dma.RegionSpec) {
			s.CUDA.Device = -1
		}},
		{name: "no device at all", devices: 0, wantErr: "sees 0 CUDA devices", edit: func(*dma.RegionSpec) {}},
		{name: "alloc size zero", devices: 2, wantErr: "alloc_size is 0", edit: func(s *dma.RegionSpec) {
			s.CUDA.AllocSize = 0
		}},
		{name: "offset beyond the allocation", devices: 2, wantErr: "block 0 (offset 1048576, 8192 bytes) does not fit in the allocation of 1048576 bytes", edit: func(s *dma.RegionSpec) {
			s.Offset = 1 << 20
			s.NumBlocks = 1
		}},
		{name: "last block one byte past the allocation", devices: 2, wantErr: "blocks reach byte 823297", edit: func(s *dma.RegionSpec) {
			s.CUDA.AllocSize = 4096 + 99*8192 + 8192
			s.Offset++
		}},
		{name: "one block, one byte past the allocation", devices: 2, wantErr: "block 0 (offset 1040384, 8193 bytes) does not fit", edit: func(s *dma.RegionSpec) {
			s.Offset = 1<<20 - 8192
			s.NumBlocks = 1
			s.SegmentBytes = 8193
		}},
		{name: "overlapping blocks", devices: 2, wantErr: "smaller than the segment", edit: func(s *dma.RegionSpec) {
			s.BlockStride = 4096
		}},
		{name: "offset near 2^64", devices: 2, wantErr: "overflows", edit: func(s *dma.RegionSpec) {
			s.Offset = ^uint64(0) - 10
		}},
		{name: "no blocks", devices: 2, wantErr: "num_blocks is 0", edit: func(s *dma.RegionSpec) {
			s.NumBlocks = 0
		}},
		{name: "shm region", devices: 2, wantErr: "host copy engine", edit: func(s *dma.RegionSpec) {
			s.CUDA = nil
			s.ShmPath = "/dev/shm/kv"
		}},
		{name: "both kinds", devices: 2, wantErr: "both shm_path and", edit: func(s *dma.RegionSpec) {
			s.ShmPath = "/dev/shm/kv"
		}},
		{name: "no memory", devices: 2, wantErr: "names no memory", edit: func(s *dma.RegionSpec) {
			s.CUDA = nil
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := good()
			tt.edit(&spec)
			k, err := parseRegion(spec, uuids(tt.devices))
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				if k.device != tt.wantDevice || !bytes.Equal(k.handle[:], handle(7)) {
					t.Fatalf("key = %+v, want device %d and the handle", k, spec.CUDA.Device)
				}
				return
			}
			if err == nil {
				t.Fatalf("accepted, want an error containing %q", tt.wantErr)
			}
			if !errors.Is(err, dma.ErrBadRegion) {
				t.Errorf("error %q does not wrap dma.ErrBadRegion", err)
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %q does not contain %q", err, tt.wantErr)
			}
		})
	}
}

func TestParseRegionKeysByDeviceAndHandle(t *testing.T) {
	spec := func(dev int, fill byte) dma.RegionSpec {
		return dma.RegionSpec{
			CUDA:   &dma.IPCMemory{Handle: handle(fill), Device: dev, AllocSize: 1 << 20},
			Offset: 0, BlockStride: 4096, NumBlocks: 4, SegmentBytes: 4096,
		}
	}
	k := func(s dma.RegionSpec) ipcKey {
		key, err := parseRegion(s, uuids(2))
		if err != nil {
			t.Fatal(err)
		}
		return key
	}
	a := spec(0, 1)
	b := a
	b.Offset = 1 << 16 // another tensor of the same allocation
	if k(a) != k(b) {
		t.Error("two regions of one allocation got different keys: it would be opened twice")
	}
	if k(a) == k(spec(1, 1)) {
		t.Error("the same handle on two devices got one key")
	}
	if k(a) == k(spec(0, 2)) {
		t.Error("two handles got one key")
	}
	c := a
	c.CUDA = &dma.IPCMemory{Handle: torchHandle(2, handle(1)), Device: 0, AllocSize: 1 << 20}
	if k(a) != k(c) {
		t.Error("PyTorch's form of a handle got another key than the raw handle: the allocation would be opened twice")
	}
}

func TestValidateEventHandle(t *testing.T) {
	tests := []struct {
		name    string
		h       []byte
		wantErr string
	}{
		{"none", nil, ""},
		{"good", handle(3), ""},
		{"short", handle(3)[:10], "ready event handle is 10 bytes, want 64"},
		{"zeros", handle(0), "ready event handle is all zeros"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := ValidateEventHandle(tt.h)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || err.Error() != tt.wantErr {
				t.Fatalf("err = %v, want %q", err, tt.wantErr)
			}
		})
	}
}

func TestCheckCopy(t *testing.T) {
	const region, arena = 1000, 4096
	tests := []struct {
		name    string
		c       dma.Copy
		wantErr string
	}{
		{"inside", dma.Copy{RegionOff: 10, ArenaOff: 20, Len: 100}, ""},
		{"ends at both ends", dma.Copy{RegionOff: 900, ArenaOff: 3996, Len: 100}, ""},
		{"region end plus one", dma.Copy{RegionOff: 901, Len: 100}, "overruns the region"},
		{"longer than region", dma.Copy{Len: 1001}, "overruns the region"},
		{"region offset wraps", dma.Copy{RegionOff: ^uint64(0) - 5, Len: 10}, "overruns the region"},
		{"arena end plus one", dma.Copy{ArenaOff: 3997, Len: 100}, "overruns the arena"},
		{"arena offset wraps", dma.Copy{ArenaOff: ^uint64(0), Len: 1}, "overruns the arena"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := checkCopy(tt.c, region, arena)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}
