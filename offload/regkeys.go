package offload

import (
	"bytes"
	"fmt"
	"slices"
)

// SetRegistrationKey records the key a client's peers find r by
// (FindRegistrations): an engine's scheduler learns what its workers
// registered under from the daemon, not through a channel of its own to
// them. An empty key makes r unfindable. The key is at most
// Limits.MaxFingerprint bytes.
func (s *Service) SetRegistrationKey(r *Registration, key []byte) error {
	if len(key) > s.lim.MaxFingerprint {
		return fmt.Errorf("%w: registration_key is %d bytes, at most %d", ErrInvalid, len(key), s.lim.MaxFingerprint)
	}
	s.mu.Lock()
	r.key = string(key)
	s.mu.Unlock()
	return nil
}

// FindRegistrations returns, for each key, the distinct fingerprints of the
// live registrations made with it, sorted (none: an empty list). At most
// Limits.MaxNamespaces keys, each 1 to Limits.MaxFingerprint bytes.
func (s *Service) FindRegistrations(keys [][]byte) ([][][]byte, error) {
	if len(keys) > s.lim.MaxNamespaces {
		return nil, fmt.Errorf("%w: keys has %d entries, at most %d", ErrInvalid, len(keys), s.lim.MaxNamespaces)
	}
	want := make(map[string]int, len(keys))
	for i, k := range keys {
		if len(k) == 0 || len(k) > s.lim.MaxFingerprint {
			return nil, fmt.Errorf("%w: keys[%d] is %d bytes, want 1..%d", ErrInvalid, i, len(k), s.lim.MaxFingerprint)
		}
		want[string(k)] = i
	}
	found := make(map[string][][]byte, len(want))
	s.mu.Lock()
	for _, r := range s.mu.regs {
		if _, ok := want[r.key]; !ok || r.key == "" {
			continue
		}
		fps := found[r.key]
		if !slices.ContainsFunc(fps, func(f []byte) bool { return bytes.Equal(f, r.ns.Fingerprint) }) {
			found[r.key] = append(fps, bytes.Clone(r.ns.Fingerprint))
		}
	}
	s.mu.Unlock()
	out := make([][][]byte, len(keys))
	for i, k := range keys {
		fps := slices.Clone(found[string(k)])
		slices.SortFunc(fps, bytes.Compare)
		out[i] = fps
	}
	return out, nil
}
