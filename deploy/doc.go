// Package deploy holds what an operator runs kvoffloadd with: the systemd
// unit (systemd/), the Kubernetes sidecar manifests (kubernetes/), the
// Grafana dashboard (grafana/) and the Prometheus alert rules (prometheus/),
// and the image builder (image/). Its tests check each against the real
// daemon: the flags they pass are the daemon's, the unit passes
// systemd-analyze, the manifests decode strictly into the Kubernetes API
// types, and every metric the dashboard and the alerts query is one the
// daemon serves. docs/operations.md ("Deploying") walks through them.
package deploy

// Where the image puts the binaries, the port it serves metrics on and the
// user it runs as. The image builder uses these; the manifests and the unit
// name the same paths, which the tests check.
const (
	DaemonPath  = "/usr/local/bin/kvoffloadd"
	HealthPath  = "/usr/local/bin/kvoffload-health"
	MetricsPort = 9464
	ImageUser   = "65532:65532"
)
