package disk

// EncodeCatalog and DecodeCatalog are the namespace catalog's codec
// (docs/disk-format.md, "Namespace catalog"), for the CPU tier's persistent
// arena, which keeps its own catalog in the same format.
func EncodeCatalog(ns map[[32]byte][]byte) []byte { return encodeCatalog(ns) }

// DecodeCatalog reads a catalog EncodeCatalog wrote; an error says why it
// is unreadable.
func DecodeCatalog(b []byte) (map[[32]byte][]byte, error) { return decodeCatalog(b) }
