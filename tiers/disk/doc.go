// Package disk owns the disk tier: one preallocated slot file per
// directory (striping a tier across NVMe devices), cut into slots of a
// 4 KiB header block plus the payload, read and written with O_DIRECT
// straight from and into host-arena slots by a fixed set of I/O workers;
// every read verified before it is reported good; a chunk map and a
// namespace catalog beside the slot files so that Recover can rebuild the
// tier's contents after a restart.
//
// # Basics
//
// Open creates or reopens the files, after taking each directory's lock
// (one daemon per directory) and refusing symbolic links where its files
// go. The tier embeds a slots.Space over the files concatenated (file i
// holds bytes [i*FileBytes, (i+1)*FileBytes) of the space), so callers
// allocate, pin and release disk slots as they do CPU slots, with
// Class(SlotBytes(payload)). Open holds every chunk the chunk maps name;
// Recover, called right after, scans them in the background (several
// readers per file, files in parallel) and hands each chunk's intact
// blocks to the owner, who brings them online, while Allocs are served
// from the chunks already scanned and the free ones (recover.go). Write,
// Read and Discard queue a request on the slot's file and return at once;
// the request's done callback runs on an I/O worker when the transfer has
// finished (and, for a read, been verified). Close stops recovery and
// drains the queues.
//
// # What a read promises
//
// A Read reports success only if the header names the key asked for, the
// slot, the payload length and the write (epoch, sequence number) this
// tier last made to the slot, and the payload hashes to the header's
// checksum. Anything else is ErrIO (the device failed: quarantine the
// slot) or ErrCorrupt (the device answered with the wrong bytes: free the
// slot). docs/disk-format.md specifies the files.
//
// # Caveats
//
// Linux only (O_DIRECT, fallocate, flock). Callers keep a slot pinned
// while a request on it is queued: two requests on one slot at once (a
// Discard racing a Write, say) leave the slot's contents unspecified.
// Recover once, right after Open. Done callbacks run on the I/O workers:
// they must not block on work that needs a worker, and must not call
// Close.
package disk
