package offload

import "errors"

// Sentinel errors. Every error the Service returns wraps one of these (or
// dma.ErrBadRegion / dma.ErrNoCUDA); rpc/server maps them to gRPC codes.
var (
	// ErrInvalid: a request field is malformed or out of bounds. The
	// message names the field.
	ErrInvalid = errors.New("invalid argument")
	// ErrUnknownNamespace: a namespace id that no Register returned.
	ErrUnknownNamespace = errors.New("unknown namespace")
	// ErrUnknownRegistration: the registration id is not (or no longer)
	// registered; its connection may have closed. Register again.
	ErrUnknownRegistration = errors.New("unknown registration")
	// ErrLayoutMismatch: the fingerprint is registered with another layout.
	ErrLayoutMismatch = errors.New("fingerprint already registered with a different layout")
	// ErrBacklog: the registration has too many unfinished or unread jobs;
	// read Completions before submitting more.
	ErrBacklog = errors.New("too many pending jobs")
	// ErrLimit: a bound on what clients may make the daemon hold was
	// reached (registrations, mapped regions, leases, pinned blocks,
	// namespaces, block sizes); the message names it and, where there is
	// one, its flag. Retry once some is given back, or raise the bound.
	ErrLimit = errors.New("limit reached")
	// ErrShuttingDown: the daemon is stopping and takes no new work.
	ErrShuttingDown = errors.New("daemon is shutting down")
)
