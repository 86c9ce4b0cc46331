package deploy

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// buildImage runs the image builder as `make image` does and returns the
// archive's path.
func buildImage(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(dir, "kvoffloadd-image.tar")
	cmd := exec.Command("go", "run", "./deploy/image", "--out", out, "--tag", "kvoffloadd:test", "--version", "v-test")
	cmd.Dir = ".."
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("image builder: %v\n%s", err, b)
	}
	return out
}

// untar extracts the tar file at path into dir.
func untar(t *testing.T, path, dir string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		if !strings.HasPrefix(p, dir+string(filepath.Separator)) {
			t.Fatalf("archive entry %q escapes the archive", h.Name)
		}
		if h.Typeflag == tar.TypeDir {
			os.MkdirAll(p, 0o755)
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestImage builds the image twice, reads the archive back both as an OCI
// image layout and as a `docker save` archive, and checks its config
// (entrypoint, user, metrics port, default flags the daemon accepts) and its
// files: static binaries that run, a user the config names, what the
// Kubernetes manifests exec.
func TestImage(t *testing.T) {
	dir := t.TempDir()
	archive := buildImage(t, dir)

	// As an OCI image layout: one image, named.
	oci := filepath.Join(dir, "oci")
	untar(t, archive, oci)
	idx, err := layout.ImageIndexFromPath(oci)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 || im.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "test" || im.Manifests[0].Annotations["io.containerd.image.name"] != "kvoffloadd:test" {
		t.Fatalf("OCI index: %+v", im.Manifests)
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	digest, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	// As a docker archive: the same image.
	dimg, err := tarball.ImageFromPath(archive, nil)
	if err != nil {
		t.Fatalf("docker archive: %v", err)
	}
	dcfg, err := dimg.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	if ccfg, _ := img.ConfigName(); dcfg != ccfg {
		t.Fatalf("docker manifest.json names config %s, the OCI manifest %s", dcfg, ccfg)
	}
	if dl, err := dimg.Layers(); err != nil || len(dl) != 1 {
		t.Fatalf("docker archive layers: %d, %v", len(dl), err)
	}

	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	c := cfg.Config
	if len(c.Entrypoint) != 1 || c.Entrypoint[0] != DaemonPath {
		t.Errorf("entrypoint %q, want [%s]", c.Entrypoint, DaemonPath)
	}
	if c.User != ImageUser {
		t.Errorf("user %q, want %s", c.User, ImageUser)
	}
	port := fmt.Sprintf("%d/tcp", MetricsPort)
	if _, ok := c.ExposedPorts[port]; !ok || len(c.ExposedPorts) != 1 {
		t.Errorf("exposed ports %v, want only %s", c.ExposedPorts, port)
	}
	if cfg.OS != "linux" || cfg.Architecture == "" {
		t.Errorf("platform %s/%s", cfg.OS, cfg.Architecture)
	}
	if addr, _ := flagValue(c.Cmd, "metrics-addr"); addr != fmt.Sprintf(":%d", MetricsPort) {
		t.Errorf("default --metrics-addr %q does not serve the exposed port %s on every interface", addr, port)
	}
	if _, ok := flagValue(c.Cmd, "metrics-expose"); !ok {
		t.Error("default flags lack --metrics-expose: the exposed metrics port would be refused")
	}
	checkDaemonArgs(t, "image cmd", c.Cmd)

	files := imageFiles(t, img)
	uid, _, _ := strings.Cut(ImageUser, ":")
	if !strings.Contains(string(files["/etc/passwd"].data), ":x:"+uid+":") {
		t.Errorf("/etc/passwd has no user %s:\n%s", uid, files["/etc/passwd"].data)
	}
	if h := files["/tmp"].hdr; h == nil || h.Mode&0o1777 != 0o1777 {
		t.Error("/tmp is missing or not 1777")
	}
	if h := files["/run/kvoffloadd"].hdr; h == nil || fmt.Sprint(h.Uid) != uid {
		t.Errorf("/run/kvoffloadd, where the daemon makes its socket directory, is not owned by %s", uid)
	}
	bin := t.TempDir()
	for path, args := range map[string][]string{DaemonPath: {"--version"}, HealthPath: {"--help"}} {
		f := files[path]
		if f.hdr == nil || f.hdr.Typeflag != tar.TypeReg || f.hdr.Mode&0o755 != 0o755 {
			t.Fatalf("%s: missing or not executable in the image", path)
		}
		local := filepath.Join(bin, filepath.Base(path))
		if err := os.WriteFile(local, f.data, 0o755); err != nil {
			t.Fatal(err)
		}
		e, err := elf.Open(local)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range e.Progs {
			if p.Type == elf.PT_INTERP {
				t.Errorf("%s is dynamically linked: the image has no libc", path)
			}
		}
		e.Close()
		if cfg.Architecture != runtimeArch() {
			continue
		}
		out, err := exec.Command(local, args...).CombinedOutput()
		if err != nil {
			t.Errorf("%s %v: %v\n%s", path, args, err, out)
		} else if path == DaemonPath && !strings.HasPrefix(string(out), "kvoffloadd v-test ") {
			t.Errorf("%s --version: %q", path, out)
		}
	}

	// What the sidecar execs and exposes is in the image.
	p := findSidecarPod(t, decodeManifests(t))
	for _, pr := range []*struct{ name, path string }{{"startup", p.daemon.StartupProbe.Exec.Command[0]}, {"readiness", p.daemon.ReadinessProbe.Exec.Command[0]}, {"liveness", p.daemon.LivenessProbe.Exec.Command[0]}} {
		if files[pr.path].hdr == nil {
			t.Errorf("the %s probe execs %s, which the image lacks", pr.name, pr.path)
		}
	}

	// Reproducible: the same sources give the same archive, byte for byte.
	if a, b := readFile(t, archive), readFile(t, buildImage(t, t.TempDir())); !bytes.Equal(a, b) {
		t.Errorf("a second build of image %s wrote another archive", digest)
	}
}

type imageFile struct {
	hdr  *tar.Header
	data []byte
}

// imageFiles is the image's flattened filesystem by absolute path.
func imageFiles(t *testing.T, img v1.Image) map[string]imageFile {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	files := map[string]imageFile{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files["/"+strings.Trim(h.Name, "/")] = imageFile{hdr: h, data: b}
	}
}
