package deploy

import (
	"bytes"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/rpc/server"
)

// One version and one protocol number for the daemon and the connector
// (docs/vllm.md, Versions): the VERSION file, which the Makefile compiles
// into the daemon, is the wheel's version, and the Python client speaks the
// daemon's protocol. The wheel carries the repository's LICENSE.
func TestOneVersionOneProtocolOneLicense(t *testing.T) {
	version := strings.TrimSpace(string(readFile(t, "../VERSION")))
	if !regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+$`).MatchString(version) {
		t.Fatalf("VERSION %q is not MAJOR.MINOR.PATCH (both a Go -X value and a PEP 440 version)", version)
	}
	py := string(readFile(t, "../clients/python/kvoffload/_version.py"))
	if m := regexp.MustCompile(`(?m)^__version__ = "(.*)"$`).FindStringSubmatch(py); m == nil || m[1] != version {
		t.Errorf("clients/python/kvoffload/_version.py: __version__ %v, VERSION says %s", m, version)
	}
	m := regexp.MustCompile(`(?m)^PROTOCOL_VERSION = ([0-9]+)$`).FindStringSubmatch(py)
	if m == nil || m[1] != strconv.Itoa(server.ProtocolVersion) {
		t.Errorf("the Python client's PROTOCOL_VERSION %v, the daemon speaks %d", m, server.ProtocolVersion)
	}
	if !strings.Contains(string(readFile(t, "../clients/python/pyproject.toml")), `version = { attr = "kvoffload._version.__version__" }`) {
		t.Error("pyproject.toml does not take its version from kvoffload/_version.py")
	}
	lic := readFile(t, "../LICENSE")
	if !bytes.Contains(lic, []byte("Apache License")) || !bytes.Contains(lic, []byte("Version 2.0, January 2004")) {
		t.Error("LICENSE is not the Apache License 2.0, which pyproject.toml names")
	}
	if !bytes.Equal(lic, readFile(t, "../clients/python/LICENSE")) {
		t.Error("clients/python/LICENSE (the wheel's) differs from LICENSE")
	}
}
