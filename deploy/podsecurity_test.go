package deploy

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	psaapi "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
)

// podSecurity evaluates a pod with Kubernetes' own Pod Security checks (the
// admission plugin's library, at the k8s.io release of go.mod) at level, for
// the latest policy version, and returns what it forbids.
func podSecurity(t *testing.T, level psaapi.Level, meta *metav1.ObjectMeta, spec *corev1.PodSpec) []string {
	t.Helper()
	ev, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var forbidden []string
	for _, r := range ev.EvaluatePod(psaapi.LevelVersion{Level: level, Version: psaapi.LatestVersion()}, meta, spec) {
		if !r.Allowed {
			forbidden = append(forbidden, r.ForbiddenReason+": "+r.ForbiddenDetail)
		}
	}
	return forbidden
}

// TestPodSecurity: the pods of deploy/kubernetes (the host build) and
// deploy/kubernetes/gpu (the CUDA build) pass Pod Security "restricted", and
// so "baseline", as Kubernetes' evaluator judges them; the pod of the old
// layout (root with IPC_LOCK) is refused by both, so the check can fail.
func TestPodSecurity(t *testing.T) {
	pods := map[string]*corev1.PodTemplateSpec{"deploy/kubernetes": findSidecarPod(t, decodeManifests(t)).tmpl}
	gpu := decodeGPUPod(t)
	pods["deploy/kubernetes/gpu"] = &gpu.deployment.Spec.Template
	for name, tmpl := range pods {
		for _, level := range []psaapi.Level{psaapi.LevelBaseline, psaapi.LevelRestricted} {
			if f := podSecurity(t, level, &tmpl.ObjectMeta, &tmpl.Spec); len(f) > 0 {
				t.Errorf("%s: Pod Security %s forbids the pod: %q", name, level, f)
			}
		}
	}

	old := pods["deploy/kubernetes"].DeepCopy()
	for i := range old.Spec.InitContainers {
		c := &old.Spec.InitContainers[i]
		root := int64(0)
		c.SecurityContext.RunAsUser = &root
		c.SecurityContext.Capabilities.Add = []corev1.Capability{"IPC_LOCK"}
	}
	for _, level := range []psaapi.Level{psaapi.LevelBaseline, psaapi.LevelRestricted} {
		if f := podSecurity(t, level, &old.ObjectMeta, &old.Spec); len(f) == 0 {
			t.Errorf("Pod Security %s allows a root sidecar with IPC_LOCK: the evaluator is not checking", level)
		}
	}
}

// checkSidecarSecurity checks what the daemon needs of the pod's security
// settings: it runs as its client's uid (the socket is 0600, and without
// CAP_SETUID the daemon maps only memory its own uid can), adds no
// capability, and drops them all.
func checkSidecarSecurity(t *testing.T, spec *corev1.PodSpec, daemon, engine *corev1.Container) {
	t.Helper()
	uid := func(c *corev1.Container) *int64 {
		if c.SecurityContext != nil && c.SecurityContext.RunAsUser != nil {
			return c.SecurityContext.RunAsUser
		}
		if spec.SecurityContext != nil {
			return spec.SecurityContext.RunAsUser
		}
		return nil
	}
	du, eu := uid(daemon), uid(engine)
	if du == nil || eu == nil || *du != *eu || *du == 0 {
		t.Errorf("kvoffloadd runs as uid %v, vllm as %v: want one non-root uid set for both", du, eu)
	}
	sc := daemon.SecurityContext
	if sc == nil || sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || len(sc.Capabilities.Add) != 0 {
		t.Fatal("kvoffloadd: want every capability dropped and none added")
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Error("kvoffloadd: want allowPrivilegeEscalation false and a read-only root filesystem")
	}
}
