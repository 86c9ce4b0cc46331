package disk_test

import (
	"testing"
)

// TestStateFiles: a state file is written into every directory, replaced
// whole by the next save, read back after a reopen from each directory,
// and absent where it was never written.
func TestStateFiles(t *testing.T) {
	for _, be := range backends(t) {
		t.Run(be.name, func(t *testing.T) {
			cfg := be.config(2, 2*chunk)
			tier := open(t, cfg)
			if got, err := tier.LoadState("fences"); err != nil || len(got) != 0 {
				t.Fatalf("before any save: %v %v", got, err)
			}
			for _, data := range []string{"first, longer than the second", "second"} {
				if err := tier.SaveState("fences", []byte(data)); err != nil {
					t.Fatal(err)
				}
			}
			tier.Close()
			tier = open(t, cfg)
			got, err := tier.LoadState("fences")
			if err != nil || len(got) != 2 {
				t.Fatalf("after a reopen: %d copies, %v; want 2", len(got), err)
			}
			for path, b := range got {
				if string(b) != "second" {
					t.Errorf("%s holds %q, want the last save", path, b)
				}
			}
			if other, err := tier.LoadState("other"); err != nil || len(other) != 0 {
				t.Errorf("a state never saved: %v %v", other, err)
			}
		})
	}
}
