package deploy

import (
	"encoding/json"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	psaapi "k8s.io/pod-security-admission/api"
	"sigs.k8s.io/yaml"
)

// TestKubernetesNodeDaemon checks deploy/kubernetes/node/, one daemon per
// node shared by its engines: decoded strictly; the daemon's flags pass its
// validation; daemon and engines meet on one hostPath socket directory, in
// the host's pid and IPC namespaces, the engines in the socket's group; and
// what it needs is what the namespace allows: Kubernetes' Pod Security
// evaluator refuses both pods at baseline, so the namespace they run in
// enforces privileged, as its label says.
func TestKubernetesNodeDaemon(t *testing.T) {
	const file = "kubernetes/node/kvoffloadd-daemonset.yaml"
	var ns *corev1.Namespace
	var ds *appsv1.DaemonSet
	var engines *appsv1.Deployment
	for i, doc := range regexp.MustCompile(`(?m)^---[ \t]*$`).Split(string(readFile(t, file)), -1) {
		if strings.TrimSpace(regexp.MustCompile(`(?m)^\s*#.*$`).ReplaceAllString(doc, "")) == "" {
			continue
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			t.Fatalf("document %d: %v", i, err)
		}
		var obj any
		switch tm.APIVersion + " " + tm.Kind {
		case "v1 Namespace":
			ns = &corev1.Namespace{}
			obj = ns
		case "apps/v1 DaemonSet":
			ds = &appsv1.DaemonSet{}
			obj = ds
		case "apps/v1 Deployment":
			engines = &appsv1.Deployment{}
			obj = engines
		default:
			t.Fatalf("document %d: kind %q %q is not one this test knows", i, tm.APIVersion, tm.Kind)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			t.Fatalf("document %d (%s): %v", i, tm.Kind, err)
		}
	}
	if ns == nil || ds == nil || engines == nil {
		t.Fatal("want a Namespace, a DaemonSet and an engine Deployment")
	}
	if ds.Namespace != ns.Name || engines.Namespace != ns.Name {
		t.Errorf("the DaemonSet (%q) and the engines (%q) are not in the namespace %q the file makes", ds.Namespace, engines.Namespace, ns.Name)
	}
	if ns.Labels["pod-security.kubernetes.io/enforce"] != "privileged" {
		t.Errorf("namespace %s: enforce label %q, want privileged", ns.Name, ns.Labels["pod-security.kubernetes.io/enforce"])
	}
	dspec, espec := &ds.Spec.Template.Spec, &engines.Spec.Template.Spec
	for name, tmpl := range map[string]*corev1.PodTemplateSpec{"the daemon": &ds.Spec.Template, "the engines": &engines.Spec.Template} {
		if f := podSecurity(t, psaapi.LevelBaseline, &tmpl.ObjectMeta, &tmpl.Spec); len(f) == 0 {
			t.Errorf("%s pass Pod Security baseline: then they need no privileged namespace, and the file says they do", name)
		}
		if !tmpl.Spec.HostPID || !tmpl.Spec.HostIPC {
			t.Errorf("%s: want hostPID and hostIPC (CUDA IPC between pods)", name)
		}
	}
	if len(dspec.Containers) != 1 {
		t.Fatalf("the DaemonSet has %d containers, want 1", len(dspec.Containers))
	}
	d := &dspec.Containers[0]
	if !strings.Contains(d.Image, "/kvoffloadd-cuda:") {
		t.Errorf("daemon image %q is not the CUDA build's", d.Image)
	}
	checkDaemonArgs(t, "node daemon args", d.Args)
	socket, _ := flagValue(d.Args, "socket")
	if mode, _ := flagValue(d.Args, "socket-mode"); mode != "0660" {
		t.Errorf("--socket-mode %q: the engines, another uid, connect through the group: want 0660", mode)
	}
	hostDir := func(spec *corev1.PodSpec, c *corev1.Container, path string) string {
		v, mp := mountOf(c, path)
		for _, vol := range spec.Volumes {
			if vol.Name == v && vol.HostPath != nil {
				return vol.HostPath.Path + strings.TrimPrefix(path, mp)
			}
		}
		return ""
	}
	ds0 := hostDir(dspec, d, socket)
	if ds0 == "" {
		t.Fatalf("the daemon's socket %s is not on a hostPath volume", socket)
	}
	if gid := d.SecurityContext.RunAsGroup; gid == nil || espec.SecurityContext == nil || espec.SecurityContext.RunAsGroup == nil || *espec.SecurityContext.RunAsGroup != *gid {
		t.Error("the engines do not run in the daemon's group, which the 0660 socket lets in")
	}
	for i := range espec.Containers {
		e := &espec.Containers[i]
		j := slices.Index(e.Args, "--kv-transfer-config")
		if j < 0 || j+1 >= len(e.Args) {
			t.Fatalf("engine %s has no --kv-transfer-config", e.Name)
		}
		var kvc struct {
			Extra struct {
				Socket string `json:"socket"`
			} `json:"kv_connector_extra_config"`
		}
		if err := json.Unmarshal([]byte(e.Args[j+1]), &kvc); err != nil {
			t.Fatal(err)
		}
		if got := hostDir(espec, e, kvc.Extra.Socket); got != ds0 {
			t.Errorf("engine %s's connector socket %s is %q on the node, the daemon's %q", e.Name, kvc.Extra.Socket, got, ds0)
		}
	}
	if disk, _ := flagValue(d.Args, "disk-dir"); hostDir(dspec, d, disk) == "" {
		t.Errorf("the disk tier %s is not on the node (hostPath)", disk)
	}
}
