package slots

import (
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// TestForgetsCounts: every Forget counts, of a key the policy holds or not,
// before it reaches the policy; Learn and Admit do not. Recovery spares its
// second look at the index only when the count did not move
// (offload/recover.go): a Forget that went uncounted would let a block
// dropped before its Learn stay in the policy for good.
func TestForgetsCounts(t *testing.T) {
	bothPolicies(t, func(t *testing.T) {
		const chunk = 1 << 20
		sp, _ := newSpace(t, 4*chunk, chunk)
		c, err := sp.Class(256 << 10)
		if err != nil {
			t.Fatal(err)
		}
		k0, k1 := key(0), key(1)
		if c.Forgets() != 0 {
			t.Fatalf("a new class counts %d Forgets", c.Forgets())
		}
		c.Forget(&k0) // not held
		c.Admit([]index.Key{k0})
		c.Learn([]index.Key{k1})
		if c.Forgets() != 1 {
			t.Fatalf("Forgets = %d after one Forget, an Admit and a Learn", c.Forgets())
		}
		c.Forget(&k0)
		c.Forget(&k1)
		if c.Forgets() != 3 {
			t.Fatalf("Forgets = %d after three Forgets", c.Forgets())
		}
	})
}
