// Command image writes an OCI image of kvoffloadd without pulling a base
// image or running a container engine (`make image`): it builds the daemon
// and kvoffload-health statically (CGO_ENABLED=0), puts them in one layer
// beside a minimal /etc/passwd, /etc/group and /tmp, and writes an archive
// that is both an OCI image layout (index.json, blobs/) and a `docker save`
// archive (manifest.json), so `docker load`, `podman load`, `ctr images
// import` and `skopeo copy oci-archive:` all take it. The same sources and
// version give the same image digest: every time stamp is the epoch.
//
// The image is the host build. The CUDA build links the driver's
// libcuda.so.1 and needs a glibc base; docs/operations.md says how.
package main

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/kvoffloadd/kvoffloadd/deploy"
)

func main() {
	out := flag.String("out", "bin/kvoffloadd-image.tar", "archive to write.")
	arch := flag.String("arch", runtime.GOARCH, "GOARCH of the image: amd64 or arm64.")
	tag := flag.String("tag", "kvoffloadd:dev", "name:tag the archive carries.")
	version := flag.String("version", "dev", "version compiled into the daemon (kvoffloadd --version).")
	repo := flag.String("repo", ".", "repository root to build from.")
	flag.Parse()
	if err := run(*repo, *out, *arch, *tag, *version); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run(repo, out, arch, tag, version string) error {
	if arch != "amd64" && arch != "arm64" {
		return fmt.Errorf("--arch %q: want amd64 or arm64", arch)
	}
	name, ref, ok := strings.Cut(tag, ":")
	if !ok || name == "" || ref == "" || strings.ContainsAny(ref, "/@") {
		return fmt.Errorf("--tag %q: want name:tag", tag)
	}
	tmp, err := os.MkdirTemp("", "kvoffloadd-image")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	files := map[string]string{deploy.DaemonPath: "./cmd/kvoffloadd", deploy.HealthPath: "./cmd/kvoffload-health"}
	bins := map[string][]byte{}
	for path, pkg := range files {
		bin := filepath.Join(tmp, filepath.Base(path))
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-X main.version="+version, "-o", bin, pkg)
		cmd.Dir = repo
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
		if b, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %v\n%s", pkg, err, b)
		}
		if bins[path], err = os.ReadFile(bin); err != nil {
			return err
		}
	}
	img, err := build(bins, arch, version)
	if err != nil {
		return err
	}
	return writeArchive(img, filepath.Join(tmp, "layout"), out, tag, ref)
}

// epoch is every time stamp in the image, so that it is reproducible.
var epoch = time.Unix(0, 0).UTC()

// build makes the image: one layer, the daemon as entrypoint, a non-root
// user, the metrics port exposed.
func build(bins map[string][]byte, arch, version string) (v1.Image, error) {
	uid, gid, _ := strings.Cut(deploy.ImageUser, ":")
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dir := func(name string, mode int64, owner string) error {
		id, _ := strconv.Atoi(owner)
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: mode, Uid: id, Gid: id, ModTime: epoch, Format: tar.FormatPAX})
	}
	file := func(name string, mode int64, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data)), ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nkvoffloadd:x:%s:%s:kvoffloadd:/var/lib/kvoffloadd:/sbin/nologin\n", uid, gid)
	group := fmt.Sprintf("root:x:0:\nkvoffloadd:x:%s:\n", gid)
	steps := []func() error{
		func() error { return dir("etc", 0o755, "0") },
		func() error { return file("etc/passwd", 0o644, []byte(passwd)) },
		func() error { return file("etc/group", 0o644, []byte(group)) },
		func() error { return dir("root", 0o700, "0") },
		// The daemon's socket directory (/run/kvoffloadd/sock, made by the
		// daemon 0700) and disk tier: the image's user owns their parents.
		func() error { return dir("run", 0o755, "0") },
		func() error { return dir("run/kvoffloadd", 0o755, uid) },
		func() error { return dir("tmp", 0o1777, "0") },
		func() error { return dir("usr", 0o755, "0") },
		func() error { return dir("usr/local", 0o755, "0") },
		func() error { return dir("usr/local/bin", 0o755, "0") },
		func() error { return dir("var", 0o755, "0") },
		func() error { return dir("var/lib", 0o755, "0") },
		func() error { return dir("var/lib/kvoffloadd", 0o700, uid) },
	}
	paths := make([]string, 0, len(bins))
	for p := range bins {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		steps = append(steps, func() error { return file(strings.TrimPrefix(p, "/"), 0o755, bins[p]) })
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	layerBytes := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerBytes)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{
		Layer:   layer,
		History: v1.History{Created: v1.Time{Time: epoch}, CreatedBy: "deploy/image: kvoffloadd " + version},
	})
	if err != nil {
		return nil, err
	}
	img = mutate.MediaType(mutate.ConfigMediaType(img, types.OCIConfigJSON), types.OCIManifestSchema1)
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cfg = cfg.DeepCopy()
	cfg.Architecture, cfg.OS, cfg.Created = arch, "linux", v1.Time{Time: epoch}
	metrics := fmt.Sprintf("%d/tcp", deploy.MetricsPort)
	cfg.Config = v1.Config{
		Entrypoint: []string{deploy.DaemonPath},
		// In a container only the metrics port reaches out; the socket is
		// shared through a volume at /run/kvoffloadd.
		Cmd:          []string{"--socket=/run/kvoffloadd/sock/kvoffloadd.sock", fmt.Sprintf("--metrics-addr=:%d", deploy.MetricsPort), "--metrics-expose"},
		User:         deploy.ImageUser,
		ExposedPorts: map[string]struct{}{metrics: {}},
		Env:          []string{"PATH=/usr/local/bin"},
		WorkingDir:   "/",
		StopSignal:   "SIGTERM",
		Labels: map[string]string{
			"org.opencontainers.image.title":       "kvoffloadd",
			"org.opencontainers.image.description": "KV-cache offload daemon for LLM inference engines (host build)",
			"org.opencontainers.image.version":     version,
		},
	}
	return mutate.ConfigFile(img, cfg)
}

// writeArchive writes img as an OCI image layout under dir, adds a docker
// manifest.json pointing at the same blobs, and tars it all into out.
func writeArchive(img v1.Image, dir, out, tag, ref string) error {
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	// containerd and docker read the image's name from the first
	// annotation, skopeo and podman the tag from the second.
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"io.containerd.image.name":          tag,
		"org.opencontainers.image.ref.name": ref,
	})); err != nil {
		return err
	}
	cfgName, err := img.ConfigName()
	if err != nil {
		return err
	}
	layers, err := img.Layers()
	if err != nil {
		return err
	}
	var layerPaths []string
	for _, l := range layers {
		d, err := l.Digest()
		if err != nil {
			return err
		}
		layerPaths = append(layerPaths, "blobs/"+d.Algorithm+"/"+d.Hex)
	}
	manifest, err := json.Marshal([]map[string]any{{
		"Config":   "blobs/" + cfgName.Algorithm + "/" + cfgName.Hex,
		"RepoTags": []string{tag},
		"Layers":   layerPaths,
	}})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "manifest.json"), manifest, 0o644); err != nil {
		return err
	}
	return tarDir(dir, out)
}

// tarDir writes the files under dir into the tar file out, in name order,
// with the epoch as every time stamp.
func tarDir(dir, out string) error {
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(out), ".image-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	tw := tar.NewWriter(f)
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || path == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		if d.IsDir() {
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: rel + "/", Mode: 0o755, ModTime: epoch})
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: rel, Mode: 0o644, Size: int64(len(b)), ModTime: epoch}); err != nil {
			return err
		}
		_, err = tw.Write(b)
		return err
	})
	if err == nil {
		err = tw.Close()
	}
	if err == nil {
		err = f.Chmod(0o644)
	}
	if err == nil {
		err = f.Close()
	}
	if err != nil {
		f.Close()
		return err
	}
	return os.Rename(f.Name(), out)
}
