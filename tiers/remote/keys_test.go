package remote

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestKeyLayout(t *testing.T) {
	id := testIdent(16)
	got := NewKeyspace(nil).Key(id)
	bucket := Bucket(id.Hash)
	want := fmt.Sprintf("kvo:2:open:{01060b10151a1f24292e33383d42474c:%d}:3:a0a1a2a3a4a5a6a7a8a9aaabacadaeaf", bucket)
	if got != want {
		t.Fatalf("key\n got %s\nwant %s", got, want)
	}
	// The records beside it: the same hash tag, so the same slot.
	if g := GenKey(got); g != want+":gen" {
		t.Fatalf("generation record %s", g)
	}
	nsRec := fmt.Sprintf("kvo:2:open:{01060b10151a1f24292e33383d42474c:%d}:ns", bucket)
	if g := NamespaceGenKeyOf(got); g != nsRec {
		t.Fatalf("namespace record %s, want %s", g, nsRec)
	}
	all := NewKeyspace(nil).NamespaceGenKeys(id.NS)
	if len(all) != NamespaceBuckets || all[bucket] != nsRec {
		t.Fatalf("the namespace's records: %d, bucket %d is %s", len(all), bucket, all[bucket])
	}
	if p := NewKeyspace(nil).NamespacePrefix(id.NS); !strings.HasPrefix(got, p) || !strings.HasPrefix(nsRec, p) {
		t.Fatalf("namespace prefix %s does not cover the key and the records", p)
	}
	mac := testMAC(t, 1)
	keyed := NewKeyspace(mac).Key(id)
	if !strings.HasPrefix(keyed, KeyPrefix+mac.ID()+":") || strings.TrimPrefix(keyed, KeyPrefix+mac.ID()) != strings.TrimPrefix(got, KeyPrefix+"open") {
		t.Fatalf("keyed key %s does not differ from %s by the key id alone", keyed, got)
	}
	if other := NewKeyspace(testMAC(t, 2)).Key(id); other == keyed {
		t.Fatal("two MAC keys share a keyspace")
	}
}

func TestNamespaceDigest(t *testing.T) {
	base := NamespaceDigest([]byte("model-a"), []byte("layout-1"))
	for name, d := range map[string][32]byte{
		"other fingerprint": NamespaceDigest([]byte("model-b"), []byte("layout-1")),
		"other layout":      NamespaceDigest([]byte("model-a"), []byte("layout-2")),
		// Length prefixes keep the boundary: no two splits of the same
		// bytes collide.
		"moved boundary": NamespaceDigest([]byte("model-al"), []byte("ayout-1")),
	} {
		if d == base {
			t.Errorf("%s: same digest", name)
		}
	}
	if NamespaceDigest([]byte("model-a"), []byte("layout-1")) != base {
		t.Fatal("digest is not deterministic")
	}
}

func TestLoadMAC(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	material := bytes.Repeat([]byte("k"), 40)
	a, err := LoadMAC(write("a", material))
	if err != nil {
		t.Fatal(err)
	}
	b, err := LoadMAC(write("b", append(append([]byte(" \n"), material...), '\n')))
	if err != nil {
		t.Fatal(err)
	}
	if a.ID() != b.ID() {
		t.Fatal("surrounding whitespace changed the key")
	}
	if _, err := LoadMAC(write("short", []byte("too short\n"))); err == nil {
		t.Fatal("a short key was accepted")
	}
	if _, err := LoadMAC(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("a missing key file was accepted")
	}
}

func TestIsRecordKey(t *testing.T) {
	ks := KeyspaceOf(KeyPrefix)
	var ns [32]byte
	v := ks.Key(Ident{NS: ns, Group: 1, Hash: []byte("0123456789abcdef")})
	if IsRecordKey(v) {
		t.Errorf("value key %q taken for a record", v)
	}
	for _, k := range []string{GenKey(v), NamespaceGenKeyOf(v), ks.NamespaceGenKeys(ns)[7]} {
		if !IsRecordKey(k) {
			t.Errorf("record key %q not recognised", k)
		}
	}
}
