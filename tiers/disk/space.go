package disk

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// ErrNoSpace means the slot files do not fit in what their filesystem has
// free, less the reserve the tier leaves (ReserveBytes).
var ErrNoSpace = errors.New("disk tier: not enough free space")

// ReserveBytes is what the tier leaves free on a filesystem of total
// bytes: 5% of it, at most 1GiB. A slot file is preallocated whole, so on a
// filesystem shared with the system or the engine the tier would otherwise
// take its last free space.
func ReserveBytes(total uint64) uint64 { return min(total/20, 1<<30) }

// checkSpace refuses slot files that their filesystems cannot hold with
// the reserve left free. What an existing file already holds counts as
// its own; directories on one filesystem share its free space.
func (t *Tier) checkSpace() error {
	type fsNeed struct {
		sp                vfs.Space
		dirs              []string
		need, held, files uint64
	}
	var order []uint64
	byDev := map[uint64]*fsNeed{}
	for i, dir := range t.cfg.Dirs {
		sp, err := t.fs.Space(dir)
		if err != nil {
			return fmt.Errorf("disk tier: %w", err)
		}
		var held uint64
		switch fi, err := t.fs.Stat(filepath.Join(dir, slotFileName(i))); {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return fmt.Errorf("disk tier: %w", err)
		default:
			held = min(vfs.Allocated(fi), t.fileBytes)
		}
		n := byDev[sp.Dev]
		if n == nil {
			n = &fsNeed{sp: sp}
			byDev[sp.Dev] = n
			order = append(order, sp.Dev)
		}
		n.dirs = append(n.dirs, dir)
		n.need += t.fileBytes - held
		n.held += held
		n.files++
	}
	var errs []error
	for _, dev := range order {
		n := byDev[dev]
		// A tier that takes nothing more starts whatever is free: others
		// filling the disk cost no cache.
		reserve := ReserveBytes(n.sp.Total)
		if n.need == 0 || n.need+reserve <= n.sp.Free {
			continue
		}
		// The largest slot file that fits, in whole chunks.
		fits := uint64(0)
		if n.sp.Free > reserve {
			fits = (n.sp.Free - reserve + n.held) / n.files / t.chunkBytes * t.chunkBytes
		}
		errs = append(errs, fmt.Errorf("%w in %s: %d slot file(s) of %s need %s more, and the filesystem has %s free, of which the tier leaves %s (5%% of its %s, at most 1GiB); at most %s per directory fits there",
			ErrNoSpace, strings.Join(n.dirs, ", "), n.files, size(t.fileBytes), size(n.need), size(n.sp.Free), size(reserve), size(n.sp.Total), size(fits)))
	}
	return errors.Join(errs...)
}

// size prints a byte count for an operator: whole MiB or GiB when it is
// one, otherwise MiB with a fraction.
func size(n uint64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%dGiB", n>>30)
	case n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	default:
		return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20))
	}
}
