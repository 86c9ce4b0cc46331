package deploy

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"
)

// TestImageCUDA builds the CUDA image as `make image-cuda` does (against the
// libcuda stub of scripts/cuda-sdk.sh, which `make cuda-check` fetches too)
// and checks what can be checked without a GPU: the daemon is the
// dynamically linked CUDA build; its loader and every library it needs are
// in the image, on the loader's search path, but libcuda.so.1, which must be
// the node driver's (the NVIDIA container toolkit mounts it); and the
// image's own loader and libc run the binary as far as the driver: with the
// stub as libcuda.so.1 it reaches cuInit (which the stub fails), without it
// the only library missing is libcuda.so.1.
func TestImageCUDA(t *testing.T) {
	if runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64" {
		t.Skip("the CUDA image is built for amd64 and arm64 machines")
	}
	dir := t.TempDir()
	archive := filepath.Join(dir, "kvoffloadd-cuda-image.tar")
	cmd := exec.Command("bash", "-c", `eval "$(./scripts/cuda-sdk.sh)" && exec go run ./deploy/image --cuda --out "$1" --tag kvoffloadd-cuda:test --version v-test`, "image-cuda", archive)
	cmd.Dir = ".."
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("image builder --cuda: %v\n%s", err, b)
	}
	oci := filepath.Join(dir, "oci")
	untar(t, archive, oci)
	idx, err := layout.ImageIndexFromPath(oci)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil || len(im.Manifests) != 1 {
		t.Fatalf("OCI index: %v %+v", err, im)
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if c := cfg.Config; len(c.Entrypoint) != 1 || c.Entrypoint[0] != DaemonPath || c.User != ImageUser ||
		!slices.Contains(c.Env, "NVIDIA_DRIVER_CAPABILITIES=compute,utility") {
		t.Errorf("config: entrypoint %q user %q env %q: want %s, %s and the compute capability asked of the toolkit", c.Entrypoint, c.User, c.Env, DaemonPath, ImageUser)
	}
	checkDaemonArgs(t, "CUDA image cmd", cfg.Config.Cmd)

	files := imageFiles(t, img)
	// resolve follows the image's symlinks (absolute or relative) to a file.
	var resolve func(p string, depth int) (string, *imageFile)
	resolve = func(p string, depth int) (string, *imageFile) {
		if depth > 8 {
			return p, nil
		}
		parts := strings.Split(strings.TrimPrefix(p, "/"), "/")
		for i := range parts {
			prefix := "/" + strings.Join(parts[:i+1], "/")
			f, ok := files[prefix]
			if ok && f.hdr.Typeflag == tar.TypeSymlink {
				target := f.hdr.Linkname
				if !strings.HasPrefix(target, "/") {
					target = path.Join(path.Dir(prefix), target)
				}
				return resolve(path.Join(append([]string{target}, parts[i+1:]...)...), depth+1)
			}
		}
		if f, ok := files[p]; ok && f.hdr.Typeflag == tar.TypeReg {
			return p, &f
		}
		return p, nil
	}
	daemon := files[DaemonPath]
	if daemon.hdr == nil {
		t.Fatalf("%s missing from the image", DaemonPath)
	}
	e, err := elf.NewFile(bytes.NewReader(daemon.data))
	if err != nil {
		t.Fatal(err)
	}
	var interp string
	for _, p := range e.Progs {
		if p.Type == elf.PT_INTERP {
			b := make([]byte, p.Filesz)
			p.ReadAt(b, 0)
			interp = strings.TrimRight(string(b), "\x00")
		}
	}
	needed, err := e.ImportedLibraries()
	if err != nil {
		t.Fatal(err)
	}
	if interp == "" || !slices.Contains(needed, "libcuda.so.1") {
		t.Fatalf("the image's daemon is not the CUDA build: loader %q, needs %q", interp, needed)
	}
	loaderPath, loader := resolve(interp, 0)
	if loader == nil {
		t.Fatalf("the daemon's loader %s is not in the image", interp)
	}
	libDir := path.Dir(loaderPath)
	// Every library, the libraries' own needs included, is in the image in
	// the loader's system directory (Debian's /usr/lib/<triplet>), but the
	// driver's.
	todo := slices.Clone(needed)
	for seen := map[string]bool{}; len(todo) > 0; todo = todo[1:] {
		name := todo[0]
		if seen[name] || name == "libcuda.so.1" || name == path.Base(interp) {
			continue
		}
		seen[name] = true
		_, f := resolve(path.Join(libDir, name), 0)
		if f == nil {
			t.Errorf("%s (needed) is not in %s in the image", name, libDir)
			continue
		}
		le, err := elf.NewFile(bytes.NewReader(f.data))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		more, _ := le.ImportedLibraries()
		todo = append(todo, more...)
	}
	for p := range files {
		if strings.HasPrefix(path.Base(p), "libcuda.so") {
			t.Errorf("the image carries %s: the driver's own libcuda.so.1 must come from the node (the toolkit), never the build's stub", p)
		}
	}

	// Run it with the image's loader and libraries.
	root := filepath.Join(dir, "root")
	for p, f := range files {
		if f.hdr.Typeflag != tar.TypeReg {
			continue
		}
		local := filepath.Join(root, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(local), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(local, f.data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	run := func(extraLibDir string) string {
		libs := filepath.Join(root, filepath.FromSlash(libDir))
		if extraLibDir != "" {
			libs += ":" + extraLibDir
		}
		out, _ := exec.Command(filepath.Join(root, filepath.FromSlash(loaderPath)), "--inhibit-cache", "--library-path", libs, filepath.Join(root, DaemonPath[1:]), "--version").CombinedOutput()
		return string(out)
	}
	if out := run(""); !strings.Contains(out, "libcuda.so.1: cannot open shared object file") {
		t.Errorf("without a driver the daemon should miss libcuda.so.1 and nothing else; it says:\n%s", out)
	}
	sdk, err := exec.Command("bash", "-c", `eval "$(../scripts/cuda-sdk.sh)" && echo "$CGO_LDFLAGS"`).Output()
	if err != nil {
		t.Fatal(err)
	}
	stub := filepath.Join(dir, "stub")
	os.MkdirAll(stub, 0o755)
	if err := os.Symlink(filepath.Join(strings.TrimPrefix(strings.TrimSpace(string(sdk)), "-L"), "libcuda.so"), filepath.Join(stub, "libcuda.so.1")); err != nil {
		t.Fatal(err)
	}
	if out := run(stub); strings.Contains(out, "error while loading shared libraries") || !strings.Contains(out, "cuda-driver-api") {
		t.Errorf("with the stub as the driver the daemon should load every library and reach cuInit, which the stub fails; it says:\n%s", out)
	}
}
