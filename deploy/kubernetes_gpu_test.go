package deploy

import (
	"encoding/json"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// TestKubernetesGPUPod checks deploy/kubernetes/gpu/, the CUDA build beside a
// GPU vLLM, decoded strictly into the Kubernetes API types: the daemon is
// the CUDA image; both containers see the same GPU (one DRA claim that both
// name, no device-plugin GPU that one container alone would get); the pod
// shares its pid namespace (CUDA IPC's open fails across pid namespaces)
// and asks for no host namespace; the daemon's flags pass its own
// validation; the connector names the daemon's socket, which both mount.
func TestKubernetesGPUPod(t *testing.T) {
	g := decodeGPUPod(t)
	dep, templates := g.deployment, g.templates
	const file = gpuPodFile
	spec := &dep.Spec.Template.Spec
	var daemon, engine *corev1.Container
	for i := range spec.InitContainers {
		if spec.InitContainers[i].Name == "kvoffloadd" {
			daemon = &spec.InitContainers[i]
		}
	}
	for i := range spec.Containers {
		if spec.Containers[i].Name == "vllm" {
			engine = &spec.Containers[i]
		}
	}
	if daemon == nil || engine == nil {
		t.Fatal("want an init container kvoffloadd and a container vllm")
	}
	if daemon.RestartPolicy == nil || *daemon.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Error("kvoffloadd is not a native sidecar (restartPolicy: Always)")
	}
	if !strings.Contains(daemon.Image, "/kvoffloadd-cuda:") {
		t.Errorf("kvoffloadd image %q is not the CUDA build's (make image-cuda)", daemon.Image)
	}

	// Pid namespace shared, no host namespace.
	if spec.ShareProcessNamespace == nil || !*spec.ShareProcessNamespace {
		t.Error("shareProcessNamespace is not true: CUDA IPC handles do not open across pid namespaces")
	}
	if spec.HostIPC || spec.HostPID || spec.HostNetwork {
		t.Error("the pod asks for a host namespace: CUDA IPC between the pod's containers needs none")
	}
	for _, c := range []*corev1.Container{daemon, engine} {
		if sc := c.SecurityContext; sc != nil && sc.Privileged != nil && *sc.Privileged {
			t.Errorf("%s is privileged", c.Name)
		}
	}

	// The same GPU in both: one claim from a template in the file, asking
	// for exactly one device, named by both containers; no device-plugin GPU.
	if len(spec.ResourceClaims) != 1 || spec.ResourceClaims[0].ResourceClaimTemplateName == nil {
		t.Fatalf("pod resourceClaims %+v: want one, from a ResourceClaimTemplate", spec.ResourceClaims)
	}
	claim := spec.ResourceClaims[0]
	rt := templates[*claim.ResourceClaimTemplateName]
	if rt == nil {
		t.Fatalf("no ResourceClaimTemplate %s in %s", *claim.ResourceClaimTemplateName, file)
	}
	reqs := rt.Spec.Spec.Devices.Requests
	if len(reqs) != 1 || reqs[0].Exactly == nil || reqs[0].Exactly.DeviceClassName != "gpu.nvidia.com" ||
		reqs[0].Exactly.AllocationMode != resourcev1.DeviceAllocationModeExactCount || reqs[0].Exactly.Count != 1 {
		t.Errorf("claim template %s: want exactly one gpu.nvidia.com device, have %+v", rt.Name, reqs)
	}
	for _, c := range []*corev1.Container{daemon, engine} {
		if !slices.ContainsFunc(c.Resources.Claims, func(rc corev1.ResourceClaim) bool { return rc.Name == claim.Name }) {
			t.Errorf("%s does not name the claim %s: it would not see the GPU", c.Name, claim.Name)
		}
		for _, rl := range []corev1.ResourceList{c.Resources.Requests, c.Resources.Limits} {
			for name := range rl {
				if strings.Contains(string(name), "gpu") {
					t.Errorf("%s asks a device plugin for %s: that GPU would be its alone", c.Name, name)
				}
			}
		}
	}

	// The daemon's flags, and the connector's socket.
	checkSidecarSecurity(t, spec, daemon, engine)
	checkDaemonArgs(t, "GPU pod kvoffloadd args", daemon.Args)
	socket, _ := flagValue(daemon.Args, "socket")
	i := slices.Index(engine.Args, "--kv-transfer-config")
	if i < 0 || i+1 >= len(engine.Args) {
		t.Fatal("vllm has no --kv-transfer-config")
	}
	var kvc struct {
		Connector   string `json:"kv_connector"`
		Module      string `json:"kv_connector_module_path"`
		ExtraConfig struct {
			Socket string `json:"socket"`
		} `json:"kv_connector_extra_config"`
	}
	if err := json.Unmarshal([]byte(engine.Args[i+1]), &kvc); err != nil {
		t.Fatal(err)
	}
	if kvc.Connector != "KVOffloadConnector" || kvc.Module != "kvoffload.vllm" || kvc.ExtraConfig.Socket != socket {
		t.Errorf("kv-transfer-config %+v does not load the connector on the daemon's socket %s", kvc, socket)
	}
	for _, c := range []*corev1.Container{daemon, engine} {
		if v, _ := mountOf(c, socket); v != "kvoffloadd-socket" {
			t.Errorf("%s does not mount the socket's volume at %s", c.Name, socket)
		}
	}
	// The daemon maps no /dev/shm file of a GPU engine: it needs no shm.
	if v, _ := mountOf(daemon, "/dev/shm/x"); v != "" {
		t.Errorf("kvoffloadd mounts %s at /dev/shm, which the CUDA path does not use", v)
	}
}

const gpuPodFile = "kubernetes/gpu/vllm-kvoffloadd-gpu.yaml"

type gpuPod struct {
	deployment *appsv1.Deployment
	templates  map[string]*resourcev1.ResourceClaimTemplate
}

// decodeGPUPod decodes the GPU pod's file strictly into the Kubernetes API
// types.
func decodeGPUPod(t *testing.T) *gpuPod {
	t.Helper()
	const file = gpuPodFile
	var dep *appsv1.Deployment
	templates := map[string]*resourcev1.ResourceClaimTemplate{}
	for i, doc := range regexp.MustCompile(`(?m)^---[ \t]*$`).Split(string(readFile(t, file)), -1) {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			t.Fatalf("document %d: %v", i, err)
		}
		var obj any
		var rt *resourcev1.ResourceClaimTemplate
		switch tm.APIVersion + " " + tm.Kind {
		case "apps/v1 Deployment":
			dep = &appsv1.Deployment{}
			obj = dep
		case "resource.k8s.io/v1 ResourceClaimTemplate":
			rt = &resourcev1.ResourceClaimTemplate{}
			obj = rt
		default:
			t.Fatalf("document %d: kind %q %q is not one this test knows", i, tm.APIVersion, tm.Kind)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			t.Fatalf("document %d (%s): %v", i, tm.Kind, err)
		}
		if rt != nil {
			templates[rt.Name] = rt
		}
	}
	if dep == nil {
		t.Fatal("no Deployment")
	}
	return &gpuPod{dep, templates}
}
