package offload

import (
	"errors"
	"fmt"

	"github.com/kvoffloadd/kvoffloadd/events"
)

// Subscribe follows what the tiers hold of the namespaces ids (none: every
// namespace) from a snapshot on (docs/events.md). The caller closes the
// subscription; past the hub's bound the error wraps ErrLimit.
func (s *Service) Subscribe(ids []uint32) (*events.Sub, error) {
	if len(ids) > s.lim.MaxNamespaces {
		return nil, fmt.Errorf("%w: namespace_ids has %d entries, at most %d", ErrInvalid, len(ids), s.lim.MaxNamespaces)
	}
	s.mu.Lock()
	closing := s.mu.closing
	for i, id := range ids {
		if _, ok := s.mu.byID[id]; !ok {
			s.mu.Unlock()
			return nil, fmt.Errorf("%w: namespace_ids[%d] = %d", ErrUnknownNamespace, i, id)
		}
	}
	s.mu.Unlock()
	if closing {
		return nil, ErrShuttingDown
	}
	sub, err := s.ev.Subscribe(ids, true)
	if errors.Is(err, events.ErrTooMany) {
		return nil, fmt.Errorf("%w: %v", ErrLimit, err)
	}
	return sub, err
}
