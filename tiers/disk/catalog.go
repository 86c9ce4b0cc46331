package disk

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"slices"

	"github.com/zeebo/xxh3"
)

// EncodeCatalog and DecodeCatalog are the namespace catalog's codec
// (docs/disk-format.md, "Namespace catalog"), for the CPU tier's persistent
// arena, which keeps its own catalog in the same format.
func EncodeCatalog(ns map[[32]byte][]byte) []byte { return encodeCatalog(ns) }

// DecodeCatalog reads a catalog EncodeCatalog wrote; an error says why it
// is unreadable.
func DecodeCatalog(b []byte) (map[[32]byte][]byte, error) { return decodeCatalog(b) }

// ReadCatalog reads a catalog of size bytes from r as DecodeCatalog does,
// without holding the file whole: only the entries keep wants are kept
// (the CPU arena's start reads an oversized catalog so, keeping the
// namespaces its records name). The checksum covers the whole stream.
func ReadCatalog(r io.Reader, size int64, keep func(digest [32]byte) bool) (map[[32]byte][]byte, error) {
	if size < 16+sumLen {
		return nil, fmt.Errorf("%w: %d bytes is too short", errMeta, size)
	}
	h := xxh3.New()
	body := io.TeeReader(bufio.NewReaderSize(io.LimitReader(r, size-sumLen), 1<<20), h)
	le := binary.LittleEndian
	var head [36]byte
	if _, err := io.ReadFull(body, head[:16]); err != nil {
		return nil, err
	}
	switch {
	case string(head[:8]) != catalogMagic:
		return nil, fmt.Errorf("%w: bad magic %q", errMeta, head[:8])
	case le.Uint16(head[8:]) != metaVersion:
		return nil, fmt.Errorf("%w: version %d, this build reads %d", errMeta, le.Uint16(head[8:]), metaVersion)
	case le.Uint16(head[10:]) != 0:
		return nil, fmt.Errorf("%w: reserved bytes are not zero", errMeta)
	}
	n := int(le.Uint32(head[12:]))
	left := size - sumLen - 16
	ns := map[[32]byte][]byte{}
	var prev [32]byte
	var meta []byte
	for i := range n {
		if left < 36 {
			return nil, fmt.Errorf("%w: entry %d of %d is cut short", errMeta, i, n)
		}
		if _, err := io.ReadFull(body, head[:]); err != nil {
			return nil, err
		}
		var d [32]byte
		copy(d[:], head[:32])
		l := int64(le.Uint32(head[32:]))
		if l > MaxNamespaceMeta || l > left-36 {
			return nil, fmt.Errorf("%w: entry %d holds %d bytes of metadata", errMeta, i, l)
		}
		if i > 0 && bytes.Compare(prev[:], d[:]) >= 0 {
			return nil, fmt.Errorf("%w: namespace %x is out of order or listed twice", errMeta, d[:8])
		}
		prev = d
		meta = slices.Grow(meta[:0], int(l))[:l]
		if _, err := io.ReadFull(body, meta); err != nil {
			return nil, err
		}
		if keep == nil || keep(d) {
			ns[d] = bytes.Clone(meta)
		}
		left -= 36 + l
	}
	if left != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the last entry", errMeta, left)
	}
	var sum [sumLen]byte
	if _, err := io.ReadFull(r, sum[:]); err != nil {
		return nil, err
	}
	if le.Uint64(sum[:]) != h.Sum64() {
		return nil, fmt.Errorf("%w: checksum mismatch", errMeta)
	}
	return ns, nil
}
