// Command image writes an OCI image of kvoffloadd without pulling a base
// image or running a container engine (`make image`): it builds the daemon
// and kvoffload-health statically (CGO_ENABLED=0), puts them in one layer
// beside a minimal /etc/passwd, /etc/group and /tmp, and writes an archive
// that is both an OCI image layout (index.json, blobs/) and a `docker save`
// archive (manifest.json), so `docker load`, `podman load`, `ctr images
// import` and `skopeo copy oci-archive:` all take it. The same sources and
// version give the same image digest: every time stamp is the epoch.
//
// With --cuda the image holds the CUDA build (`make image-cuda`): the daemon
// is built with cgo and -tags cuda against the libcuda stub of
// scripts/cuda-sdk.sh (whose CGO_CFLAGS and CGO_LDFLAGS the caller exports),
// and the layer adds the C libraries it needs, copied from this machine with
// their loader, into Debian's multiarch directory (/usr/lib/<triplet>, which
// the loader searches). libcuda.so.1 is left out on purpose: it must be the
// node driver's own, which the NVIDIA container toolkit mounts into the
// container at run time (docs/operations.md, The CUDA image).
package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"encoding/json"
	"errors"
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
	cuda := flag.Bool("cuda", false, "the CUDA build, with the C libraries it links but libcuda.so.1 (run with scripts/cuda-sdk.sh's flags exported; --arch must be this machine's).")
	flag.Parse()
	if err := run(*repo, *out, *arch, *tag, *version, *cuda); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run(repo, out, arch, tag, version string, cuda bool) error {
	if arch != "amd64" && arch != "arm64" {
		return fmt.Errorf("--arch %q: want amd64 or arm64", arch)
	}
	if cuda && arch != runtime.GOARCH {
		return fmt.Errorf("--cuda --arch %s: the CUDA build links this machine's C libraries (%s); build it on an %s machine", arch, runtime.GOARCH, arch)
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
		args := []string{"build", "-trimpath", "-ldflags", "-X main.version=" + version, "-o", bin}
		env := append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
		if cuda && path == deploy.DaemonPath {
			args = append(args, "-tags", "cuda")
			env = append(os.Environ(), "CGO_ENABLED=1", "GOOS=linux", "GOARCH="+arch)
		}
		cmd := exec.Command("go", append(args, pkg)...)
		cmd.Dir = repo
		cmd.Env = env
		if b, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %v\n%s", pkg, err, b)
		}
		if bins[path], err = os.ReadFile(bin); err != nil {
			return err
		}
	}
	var libs *sharedLibs
	if cuda {
		if libs, err = libsOf(filepath.Join(tmp, filepath.Base(deploy.DaemonPath)), arch); err != nil {
			return err
		}
	}
	img, err := build(bins, libs, arch, version)
	if err != nil {
		return err
	}
	return writeArchive(img, filepath.Join(tmp, "layout"), out, tag, ref)
}

// epoch is every time stamp in the image, so that it is reproducible.
var epoch = time.Unix(0, 0).UTC()

// CUDADriverLib is the library the CUDA build links and the image leaves
// out: the NVIDIA container toolkit mounts the node driver's.
const CUDADriverLib = "libcuda.so.1"

// sharedLibs are the C libraries a dynamically linked daemon needs, by
// their path in the image, and its loader.
type sharedLibs struct {
	dir    string            // /usr/lib/<triplet>
	files  map[string][]byte // image path -> bytes
	interp string            // the loader's path as the binary names it
	loader string            // where the loader's bytes are (in dir)
}

var triplets = map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}

// libsOf finds, on this machine, the loader of the binary at bin and every
// library it needs, directly or through another, but libcuda.so.1.
func libsOf(bin, arch string) (*sharedLibs, error) {
	f, err := elf.Open(bin)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var interp string
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			b, err := io.ReadAll(p.Open())
			if err != nil {
				return nil, err
			}
			interp = strings.TrimRight(string(b), "\x00")
		}
	}
	if interp == "" {
		return nil, errors.New("the CUDA build is statically linked: no loader to copy (was cgo on?)")
	}
	dir := "/usr/lib/" + triplets[arch]
	libs := &sharedLibs{dir: dir, files: map[string][]byte{}, interp: interp, loader: dir + "/" + filepath.Base(interp)}
	if libs.files[libs.loader], err = os.ReadFile(interp); err != nil {
		return nil, fmt.Errorf("the loader %s: %w", interp, err)
	}
	var add func(f *elf.File, who string) error
	add = func(f *elf.File, who string) error {
		needed, err := f.ImportedLibraries()
		if err != nil {
			return err
		}
		for _, name := range needed {
			if name == CUDADriverLib || name == filepath.Base(interp) || libs.files[dir+"/"+name] != nil {
				continue
			}
			var found string
			for _, d := range []string{"/lib/" + triplets[arch], dir, "/lib64", "/usr/lib64", "/lib", "/usr/lib"} {
				if _, err := os.Stat(filepath.Join(d, name)); err == nil {
					found = filepath.Join(d, name)
					break
				}
			}
			if found == "" {
				return fmt.Errorf("%s needs %s, which this machine lacks", who, name)
			}
			b, err := os.ReadFile(found)
			if err != nil {
				return err
			}
			libs.files[dir+"/"+name] = b
			lf, err := elf.NewFile(bytes.NewReader(b))
			if err != nil {
				return fmt.Errorf("%s: %w", found, err)
			}
			if err := add(lf, name); err != nil {
				return err
			}
		}
		return nil
	}
	if err := add(f, "kvoffloadd"); err != nil {
		return nil, err
	}
	return libs, nil
}

// build makes the image: one layer, the daemon as entrypoint, a non-root
// user, the metrics port exposed; with libs, the CUDA build's C libraries.
func build(bins map[string][]byte, libs *sharedLibs, arch, version string) (v1.Image, error) {
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
	if libs != nil {
		// Debian's merged /usr: /lib is /usr/lib. The loader is at the path
		// the binary names (/lib64/... on amd64, /lib/... on arm64).
		steps = append(steps,
			func() error {
				return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: "lib", Linkname: "usr/lib", Mode: 0o777, ModTime: epoch, Format: tar.FormatPAX})
			},
			func() error { return dir("usr/lib", 0o755, "0") },
			func() error { return dir(strings.TrimPrefix(libs.dir, "/"), 0o755, "0") })
		names := make([]string, 0, len(libs.files))
		for p := range libs.files {
			names = append(names, p)
		}
		sort.Strings(names)
		for _, p := range names {
			steps = append(steps, func() error { return file(strings.TrimPrefix(p, "/"), 0o755, libs.files[p]) })
		}
		if !strings.HasPrefix(libs.interp, "/lib/") {
			steps = append(steps,
				func() error { return dir(strings.TrimPrefix(filepath.Dir(libs.interp), "/"), 0o755, "0") },
				func() error {
					return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: strings.TrimPrefix(libs.interp, "/"), Linkname: libs.loader, Mode: 0o777, ModTime: epoch, Format: tar.FormatPAX})
				})
		}
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
	env, desc := []string{"PATH=/usr/local/bin"}, "host build"
	if libs != nil {
		// The toolkit mounts the driver's libraries for the compute
		// capability only when asked; which GPUs is the orchestrator's
		// (NVIDIA_VISIBLE_DEVICES, a device plugin or a DRA claim).
		env, desc = append(env, "NVIDIA_DRIVER_CAPABILITIES=compute,utility"), "CUDA build: the NVIDIA container toolkit provides libcuda.so.1"
	}
	cfg.Config = v1.Config{
		Entrypoint: []string{deploy.DaemonPath},
		// In a container only the metrics port reaches out; the socket is
		// shared through a volume at /run/kvoffloadd.
		Cmd:          []string{"--socket=/run/kvoffloadd/sock/kvoffloadd.sock", fmt.Sprintf("--metrics-addr=:%d", deploy.MetricsPort), "--metrics-expose"},
		User:         deploy.ImageUser,
		ExposedPorts: map[string]struct{}{metrics: {}},
		Env:          env,
		WorkingDir:   "/",
		StopSignal:   "SIGTERM",
		Labels: map[string]string{
			"org.opencontainers.image.title":       "kvoffloadd",
			"org.opencontainers.image.description": "KV-cache offload daemon for LLM inference engines (" + desc + ")",
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
