package disk

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
)

// State files: small files the tier's owner keeps beside the slot files
// (the remote tier's invalidation fences), in every directory, replaced
// durably like the catalog. Their contents are the owner's; the tier only
// writes and reads them.

func stateFileName(i int, name string) string { return fmt.Sprintf("kvoffload-%d.%s", i, name) }

// SaveState writes data as the state file name in every directory,
// durably before it returns (written, synced, renamed into place, the
// directory synced): after a crash each directory holds the old or the
// new contents, never a mix. An error names the directories that failed;
// the others hold the new contents.
func (t *Tier) SaveState(name string, data []byte) error {
	if len(data) > maxMetaFile {
		return fmt.Errorf("%w: state file %s of %d bytes, at most %d", ErrInvalid, name, len(data), maxMetaFile)
	}
	var errs []error
	for _, f := range t.files {
		if err := writeDurably(t.fs, f.dir, stateFileName(f.idx, name), data); err != nil {
			errs = append(errs, fmt.Errorf("disk tier: save %s in %s: %w", name, f.dir, err))
		}
	}
	return errors.Join(errs...)
}

// LoadState reads every directory's copy of the state file name, by path;
// a directory without one is left out. An error is a copy that exists but
// could not be read (or is larger than any state file the tier writes).
func (t *Tier) LoadState(name string) (map[string][]byte, error) {
	out := map[string][]byte{}
	var errs []error
	for _, f := range t.files {
		path := filepath.Join(f.dir, stateFileName(f.idx, name))
		b, err := readSmall(t.fs, path)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			errs = append(errs, fmt.Errorf("disk tier: %w", err))
		default:
			out[path] = b
		}
	}
	return out, errors.Join(errs...)
}
