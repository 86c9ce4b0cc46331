package deploy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// manifests are the decoded objects of deploy/kubernetes/*.yaml.
type manifests struct {
	deployments []*appsv1.Deployment
	services    []*corev1.Service
	pvs         []*corev1.PersistentVolume
	pvcs        []*corev1.PersistentVolumeClaim
	classes     []*storagev1.StorageClass
}

// decodeManifests decodes every document of every manifest strictly into its
// Kubernetes API type: an unknown kind or field, a duplicate field or a
// value of the wrong type fails.
func decodeManifests(t *testing.T) *manifests {
	t.Helper()
	files, err := filepath.Glob("kubernetes/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in deploy/kubernetes: %v", err)
	}
	m := &manifests{}
	for _, f := range files {
		for i, doc := range regexp.MustCompile(`(?m)^---[ \t]*$`).Split(string(readFile(t, f)), -1) {
			if strings.TrimSpace(regexp.MustCompile(`(?m)^\s*#.*$`).ReplaceAllString(doc, "")) == "" {
				continue
			}
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
				t.Fatalf("%s document %d: %v", f, i, err)
			}
			var obj any
			switch tm.APIVersion + " " + tm.Kind {
			case "apps/v1 Deployment":
				d := &appsv1.Deployment{}
				m.deployments, obj = append(m.deployments, d), d
			case "v1 Service":
				s := &corev1.Service{}
				m.services, obj = append(m.services, s), s
			case "v1 PersistentVolume":
				v := &corev1.PersistentVolume{}
				m.pvs, obj = append(m.pvs, v), v
			case "v1 PersistentVolumeClaim":
				c := &corev1.PersistentVolumeClaim{}
				m.pvcs, obj = append(m.pvcs, c), c
			case "storage.k8s.io/v1 StorageClass":
				c := &storagev1.StorageClass{}
				m.classes, obj = append(m.classes, c), c
			default:
				t.Fatalf("%s document %d: kind %q %q is not one this test knows; add it", f, i, tm.APIVersion, tm.Kind)
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s document %d (%s): %v", f, i, tm.Kind, err)
			}
		}
	}
	return m
}

// sidecarPod is the pod of vLLM with kvoffloadd beside it.
type sidecarPod struct {
	tmpl    *corev1.PodTemplateSpec
	spec    *corev1.PodSpec
	daemon  *corev1.Container
	engine  *corev1.Container
	args    []string // the daemon's
	socket  string
	volumes map[string]*corev1.Volume
}

func findSidecarPod(t *testing.T, m *manifests) *sidecarPod {
	t.Helper()
	if len(m.deployments) != 1 {
		t.Fatalf("want one Deployment, have %d", len(m.deployments))
	}
	p := &sidecarPod{tmpl: &m.deployments[0].Spec.Template, volumes: map[string]*corev1.Volume{}}
	p.spec = &p.tmpl.Spec
	for i := range p.spec.InitContainers {
		if c := &p.spec.InitContainers[i]; c.Name == "kvoffloadd" {
			p.daemon = c
		}
	}
	for i := range p.spec.Containers {
		if c := &p.spec.Containers[i]; c.Name == "vllm" {
			p.engine = c
		}
	}
	if p.daemon == nil || p.engine == nil {
		t.Fatal("want an init container kvoffloadd and a container vllm")
	}
	for i := range p.spec.Volumes {
		p.volumes[p.spec.Volumes[i].Name] = &p.spec.Volumes[i]
	}
	if len(p.daemon.Command) != 0 {
		t.Errorf("kvoffloadd: command %q replaces the image's entrypoint (%s); pass flags as args", p.daemon.Command, DaemonPath)
	}
	p.args = p.daemon.Args
	p.socket, _ = flagValue(p.args, "socket")
	return p
}

// mountOf returns the volume mounted at path or above it in c, and the
// mount's path.
func mountOf(c *corev1.Container, path string) (volume, mountPath string) {
	for _, vm := range c.VolumeMounts {
		if path == vm.MountPath || strings.HasPrefix(path, strings.TrimSuffix(vm.MountPath, "/")+"/") {
			if len(vm.MountPath) > len(mountPath) {
				volume, mountPath = vm.Name, vm.MountPath
			}
		}
	}
	return volume, mountPath
}

// flagBytes reads a size flag in the daemon's units (4096, 64MiB, 8GiB).
func flagBytes(t *testing.T, args []string, name string) int64 {
	t.Helper()
	v, ok := flagValue(args, name)
	if !ok {
		t.Fatalf("the daemon's args have no --%s", name)
	}
	num, mult := v, int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}, {"B", 1}} {
		if n, ok := strings.CutSuffix(v, u.suffix); ok {
			num, mult = n, u.mult
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil {
		t.Fatalf("--%s %s: %v", name, v, err)
	}
	return n * mult
}

// TestKubernetesManifests decodes every manifest strictly and checks the
// sidecar pod against the daemon, the health probe, the image and the
// connector.
func TestKubernetesManifests(t *testing.T) {
	m := decodeManifests(t)
	p := findSidecarPod(t, m)
	d, e := p.daemon, p.engine

	t.Run("sidecar", func(t *testing.T) {
		if d.RestartPolicy == nil || *d.RestartPolicy != corev1.ContainerRestartPolicyAlways {
			t.Error("kvoffloadd is not a native sidecar (restartPolicy: Always): vLLM could start before it and it could stop before vLLM")
		}
		if d.StartupProbe == nil {
			t.Error("kvoffloadd has no startup probe: vLLM would start before the daemon serves")
		}
		checkDaemonArgs(t, "kvoffloadd args", p.args)
	})

	t.Run("pid namespace", func(t *testing.T) {
		// The connector hands a block back to vLLM only once the daemon
		// reported its copy, drained the registration or exited; it learns
		// the daemon's pid from the socket (SO_PEERCRED), which is 0 across
		// pid namespaces, and then falls back to a 30 s grace that a frozen
		// daemon can outlast (docs/vllm.md, "Daemon pid not visible").
		if p.spec.ShareProcessNamespace == nil || !*p.spec.ShareProcessNamespace {
			t.Error("the pod does not share its pid namespace (shareProcessNamespace: true): the connector cannot see the daemon's pid and runs with a grace period a frozen daemon can outlast")
		}
		if p.spec.HostPID {
			t.Error("hostPID: the pod would see the node's processes; shareProcessNamespace is what the connector needs")
		}
	})

	t.Run("socket", func(t *testing.T) {
		if p.socket == "" {
			t.Fatal("kvoffloadd: no --socket")
		}
		vol, mp := mountOf(d, p.socket)
		if vol == "" || filepath.Dir(p.socket) == mp {
			t.Fatalf("--socket %s: want it in a directory of its own beneath a volume mount (the daemon refuses an emptyDir's world-writable root)", p.socket)
		}
		if ev, emp := mountOf(e, p.socket); ev != vol || emp != mp {
			t.Fatalf("vLLM does not mount volume %s at %s, where the socket is", vol, mp)
		}
		if v := p.volumes[vol]; v == nil || v.EmptyDir == nil {
			t.Fatalf("socket volume %s: want an emptyDir", vol)
		}
	})

	t.Run("shm", func(t *testing.T) {
		shm, ok := flagValue(p.args, "shm-dir")
		if !ok {
			shm = "/dev/shm" // the daemon's default
		}
		dv, dmp := mountOf(d, shm)
		ev, emp := mountOf(e, shm)
		if dv == "" || dv != ev || dmp != shm || emp != shm {
			t.Fatalf("--shm-dir %s: want one volume mounted there in both containers (kvoffloadd %s at %s, vLLM %s at %s)", shm, dv, dmp, ev, emp)
		}
		v := p.volumes[dv]
		if v.EmptyDir == nil || v.EmptyDir.Medium != corev1.StorageMediumMemory || v.EmptyDir.SizeLimit == nil {
			t.Fatalf("volume %s: want an emptyDir in memory with a sizeLimit", dv)
		}
		if lim := e.Resources.Limits[corev1.ResourceMemory]; lim.Cmp(*v.EmptyDir.SizeLimit) <= 0 {
			t.Errorf("vLLM's memory limit %s does not cover the shm volume (%s), whose pages it is charged for", lim.String(), v.EmptyDir.SizeLimit)
		}
	})

	t.Run("disk", func(t *testing.T) {
		perDir := flagBytes(t, p.args, "disk-bytes")
		need := map[string]int64{}
		for i := 0; i < len(p.args); i++ {
			name, v, has := splitFlag(p.args[i])
			if name != "disk-dir" {
				continue
			}
			if !has {
				v = p.args[i+1]
			}
			vol, _ := mountOf(d, v)
			if vol == "" {
				t.Fatalf("--disk-dir %s is on no volume: the container's root is read-only and the cache would die with it", v)
			}
			need[vol] += perDir
		}
		if len(need) == 0 {
			t.Fatal("no --disk-dir: the example runs without a disk tier")
		}
		for vol, bytes := range need {
			v := p.volumes[vol]
			var have resource.Quantity
			switch {
			case v.EmptyDir != nil && v.EmptyDir.SizeLimit != nil:
				have = *v.EmptyDir.SizeLimit
			case v.PersistentVolumeClaim != nil:
				have = claimSize(t, m, v.PersistentVolumeClaim.ClaimName)
			default:
				t.Fatalf("disk volume %s: want a persistentVolumeClaim, or an emptyDir with a sizeLimit", vol)
			}
			if have.Value() < bytes {
				t.Errorf("disk volume %s holds %s, the slot files take %d bytes", vol, have.String(), bytes)
			}
		}
	})

	t.Run("memory", func(t *testing.T) {
		// The locked arena can be neither reclaimed nor swapped: the limit
		// covers it and the daemon, and the request is the limit.
		arena := flagBytes(t, p.args, "cpu-bytes")
		lim := d.Resources.Limits[corev1.ResourceMemory]
		if lim.Value() < arena+1<<30 {
			t.Errorf("kvoffloadd memory limit %s: want at least --cpu-bytes (%d) + 1GiB", lim.String(), arena)
		}
		for _, c := range []*corev1.Container{d, e} {
			for _, r := range []corev1.ResourceName{corev1.ResourceMemory, corev1.ResourceCPU} {
				req, lim := c.Resources.Requests[r], c.Resources.Limits[r]
				if lim.IsZero() || req.Cmp(lim) != 0 {
					t.Errorf("%s %s: request %s, limit %s; want them equal (a Guaranteed pod: locked memory cannot be overcommitted)", c.Name, r, req.String(), lim.String())
				}
			}
		}
	})

	t.Run("security", func(t *testing.T) {
		// Pod Security itself is deploy/podsecurity_test.go's; here what
		// the daemon needs of it: its client's uid, no capability.
		checkSidecarSecurity(t, p.spec, d, e)
	})

	t.Run("probes", func(t *testing.T) {
		for name, pr := range map[string]*corev1.Probe{"startup": d.StartupProbe, "readiness": d.ReadinessProbe, "liveness": d.LivenessProbe} {
			if pr == nil || pr.Exec == nil {
				t.Errorf("kvoffloadd %s probe: want an exec of %s", name, HealthPath)
				continue
			}
			cmd := pr.Exec.Command
			if len(cmd) == 0 || cmd[0] != HealthPath {
				t.Errorf("kvoffloadd %s probe runs %q, want %s", name, cmd, HealthPath)
				continue
			}
			if s, _ := flagValue(cmd[1:], "socket"); s != p.socket {
				t.Errorf("kvoffloadd %s probe asks %s, the daemon listens on %s", name, s, p.socket)
			}
			if to, _ := flagValue(cmd[1:], "timeout"); to != "" {
				d, err := time.ParseDuration(to)
				if err != nil || d >= time.Duration(pr.TimeoutSeconds)*time.Second {
					t.Errorf("kvoffloadd %s probe: --timeout %s must end before timeoutSeconds %d", name, to, pr.TimeoutSeconds)
				}
			}
			checkHealthArgs(t, name+" probe", cmd[1:])
		}
	})

	t.Run("metrics", func(t *testing.T) {
		addr, _ := flagValue(p.args, "metrics-addr")
		_, port, err := splitHostPort(addr)
		if err != nil {
			t.Fatalf("--metrics-addr %q: %v", addr, err)
		}
		if _, ok := flagValue(p.args, "metrics-expose"); !ok {
			t.Error("no --metrics-expose: Prometheus scrapes the pod IP, the daemon would listen on loopback only")
		}
		found := false
		for _, cp := range d.Ports {
			found = found || (cp.Name == "metrics" && cp.ContainerPort == int32(port))
		}
		if !found || port != MetricsPort {
			t.Errorf("kvoffloadd: want a container port named metrics at %d (--metrics-addr %s, the image's exposed port)", MetricsPort, addr)
		}
		a := p.tmpl.Annotations
		if a["prometheus.io/scrape"] != "true" || a["prometheus.io/port"] != strconv.Itoa(port) || a["prometheus.io/path"] != "/metrics" {
			t.Errorf("scrape annotations %v do not point at port %d, /metrics", a, port)
		}
	})

	t.Run("shutdown", func(t *testing.T) {
		st, ok := flagValue(p.args, "shutdown-timeout")
		if !ok {
			st = "30s"
		}
		sd, err := time.ParseDuration(st)
		if err != nil {
			t.Fatal(err)
		}
		// The grace period covers the whole pod: vLLM stops first, then
		// the sidecar within --shutdown-timeout.
		if g := p.spec.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second <= 2*sd {
			t.Errorf("terminationGracePeriodSeconds leaves vLLM less than --shutdown-timeout %s before the sidecar's own", sd)
		}
		if m.deployments[0].Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
			t.Error("in a rolling update the new daemon would find the disk volume locked by the old one; want strategy Recreate")
		}
	})

	t.Run("connector", func(t *testing.T) { checkConnector(t, p) })

	t.Run("objects", func(t *testing.T) {
		labels := p.tmpl.Labels
		for _, s := range m.services {
			for k, v := range s.Spec.Selector {
				if labels[k] != v {
					t.Errorf("service %s selects %s=%s, the pod has %q", s.Name, k, v, labels[k])
				}
			}
		}
		for _, c := range m.pvcs {
			if c.Spec.StorageClassName == nil {
				t.Errorf("claim %s names no storage class", c.Name)
				continue
			}
			matched := false
			for _, v := range m.pvs {
				want := c.Spec.Resources.Requests[corev1.ResourceStorage]
				have := v.Spec.Capacity[corev1.ResourceStorage]
				matched = matched || (v.Spec.StorageClassName == *c.Spec.StorageClassName && have.Cmp(want) >= 0)
			}
			if !matched {
				t.Errorf("claim %s: no volume of class %s large enough", c.Name, *c.Spec.StorageClassName)
			}
		}
		for _, v := range m.pvs {
			found := false
			for _, c := range m.classes {
				found = found || c.Name == v.Spec.StorageClassName
			}
			if !found {
				t.Errorf("volume %s: storage class %s is not defined", v.Name, v.Spec.StorageClassName)
			}
		}
	})
}

func claimSize(t *testing.T, m *manifests, name string) resource.Quantity {
	t.Helper()
	for _, c := range m.pvcs {
		if c.Name == name {
			return c.Spec.Resources.Requests[corev1.ResourceStorage]
		}
	}
	t.Fatalf("claim %s is not defined in deploy/kubernetes", name)
	return resource.Quantity{}
}

func splitHostPort(addr string) (string, int, error) {
	i := strings.LastIndex(addr, ":")
	if i < 0 {
		return "", 0, fmt.Errorf("no port")
	}
	port, err := strconv.Atoi(addr[i+1:])
	return addr[:i], port, err
}

// checkConnector checks vLLM's --kv-transfer-config: the connector class
// exists at the module path, and the connector's own settings parser takes
// the config and finds the daemon's socket in it.
func checkConnector(t *testing.T, p *sidecarPod) {
	var raw string
	args := append(append([]string{}, p.engine.Command...), p.engine.Args...)
	for i, a := range args {
		if a == "--kv-transfer-config" && i+1 < len(args) {
			raw = args[i+1]
		} else if v, ok := strings.CutPrefix(a, "--kv-transfer-config="); ok {
			raw = v
		}
	}
	if raw == "" {
		t.Fatal("vLLM has no --kv-transfer-config")
	}
	var ktc struct {
		Connector  string         `json:"kv_connector"`
		Module     string         `json:"kv_connector_module_path"`
		Role       string         `json:"kv_role"`
		Extra      map[string]any `json:"kv_connector_extra_config"`
		LoadPolicy string         `json:"kv_load_failure_policy"`
	}
	dec := json.NewDecoder(strings.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&ktc); err != nil {
		t.Fatalf("--kv-transfer-config %s: %v", raw, err)
	}
	if ktc.Role != "kv_both" {
		t.Errorf("kv_role %q: the connector both stores and loads", ktc.Role)
	}
	module := filepath.Join("..", "clients", "python", filepath.FromSlash(strings.ReplaceAll(ktc.Module, ".", "/"))+".py")
	src, err := os.ReadFile(module)
	if err != nil {
		t.Fatalf("kv_connector_module_path %s: %v", ktc.Module, err)
	}
	if !regexp.MustCompile(`(?m)^class ` + regexp.QuoteMeta(ktc.Connector) + `\(`).Match(src) {
		t.Errorf("kv_connector %s is not a class of %s", ktc.Connector, module)
	}
	env := map[string]string{}
	for _, ev := range p.engine.Env {
		env[ev.Name] = ev.Value
	}
	if env["PYTHONHASHSEED"] == "" {
		t.Error("vLLM: PYTHONHASHSEED unset: its block hashes would differ at every start, and no restarted engine would hit")
	}
	// The connector's settings parser, as vLLM's worker runs it, with a
	// stand-in of vLLM's config holding this kv_transfer_config.
	extra, _ := json.Marshal(ktc.Extra)
	envJSON, _ := json.Marshal(env)
	py := exec.Command(python(), "-c", `
import json, sys, types
from kvoffload.settings import settings_from_vllm
ktc = types.SimpleNamespace(kv_connector_extra_config=json.loads(sys.argv[1]))
s = settings_from_vllm(types.SimpleNamespace(kv_transfer_config=ktc), None, env=json.loads(sys.argv[2]))
print(s.socket)
`, string(extra), string(envJSON))
	py.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join("..", "clients", "python"))
	out, err := py.CombinedOutput()
	if err != nil {
		t.Fatalf("the connector refuses kv_connector_extra_config %s (python3 and python3-grpcio come from scripts/test-deps.sh): %v\n%s", extra, err, out)
	}
	if got := strings.TrimSpace(string(out)); got != p.socket {
		t.Errorf("the connector dials %s, the daemon listens on %s", got, p.socket)
	}
}

// TestKubernetesSidecarRuns starts the daemon with the sidecar's args (paths
// under a temp dir, a small arena and disk, a free metrics port), and runs
// the pod's probes against it: the startup probe passes once it serves, the
// metrics answer on every interface (--metrics-expose), and after SIGTERM
// the readiness probe fails.
func TestKubernetesSidecarRuns(t *testing.T) {
	p := findSidecarPod(t, decodeManifests(t))
	root := t.TempDir()
	port := freePort(t)
	args := hostArgs(t, "kvoffloadd args", p.args, root, map[string]string{
		"cpu-bytes": "64MiB", "disk-bytes": "64MiB", "metrics-addr": fmt.Sprintf(":%d", port),
	})
	d := startDaemon(t, args)
	probe := func(pr *corev1.Probe, extra ...string) (int, string) {
		var cmd []string
		for _, a := range pr.Exec.Command[1:] {
			if v, ok := strings.CutPrefix(a, "--socket="); ok {
				a = "--socket=" + filepath.Join(root, v)
			}
			cmd = append(cmd, a)
		}
		return health(t, append(cmd, extra...)...)
	}
	if code, out := probe(p.daemon.StartupProbe, "--wait=1m"); code != 0 {
		t.Fatalf("startup probe: exit %d, %s", code, out)
	}
	for name, pr := range map[string]*corev1.Probe{"readiness": p.daemon.ReadinessProbe, "liveness": p.daemon.LivenessProbe} {
		if code, out := probe(pr); code != 0 {
			t.Fatalf("%s probe on a serving daemon: exit %d, %s", name, code, out)
		}
	}
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `kvoffload_tier_capacity_bytes{tier="disk"} 6.7108864e+07`) {
		t.Fatalf("metrics lack the disk tier:\n%.2000s", body)
	}
	// In one pid namespace, as the pod shares its own, the connector finds
	// the daemon's process from the socket and watches it exit.
	sock := filepath.Join(root, p.socket)
	watch := exec.Command(python(), "-c", `
import sys
from kvoffload.daemon_process import DaemonProcess, daemon_pid
pid = daemon_pid(sys.argv[1])
d = DaemonProcess(pid)
print(pid, d.known, d.exited())
`, sock)
	watch.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join("..", "clients", "python"))
	out, err := watch.CombinedOutput()
	if err != nil {
		t.Fatalf("daemon_pid: %v\n%s", err, out)
	}
	if want := fmt.Sprintf("%d True False", d.cmd.Process.Pid); strings.TrimSpace(string(out)) != want {
		t.Fatalf("the connector sees the daemon on %s as %q, want %q (pid, known, exited)", sock, strings.TrimSpace(string(out)), want)
	}
	if err := d.stop(t); err != nil {
		t.Fatalf("daemon exit: %v", err)
	}
	if code, _ := probe(p.daemon.ReadinessProbe); code != 1 {
		t.Fatalf("readiness probe after the daemon stopped: exit %d, want 1", code)
	}
}

// python is the interpreter with Debian's python3-grpcio, as the Makefile's
// $(PYTHON): /usr/bin/python3 unless PYTHON says otherwise.
func python() string {
	if p := os.Getenv("PYTHON"); p != "" {
		return p
	}
	return "/usr/bin/python3"
}
