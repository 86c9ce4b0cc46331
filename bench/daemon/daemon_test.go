package daemon

import (
	"strings"
	"testing"
)

func TestParseMetrics(t *testing.T) {
	m, err := ParseMetrics(strings.NewReader(`# HELP kvoffload_blocks_total Blocks.
# TYPE kvoffload_blocks_total counter
kvoffload_blocks_total{op="load",status="ok"} 12
kvoffload_blocks_total{op="load",status="io_error"} 3
kvoffload_blocks_total{op="store",status="ok"} 5
kvoffload_lookups_total 7
bad line
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"kvoffload_blocks_total", nil, 20},
		{"kvoffload_blocks_total", []string{`op="load"`}, 15},
		{"kvoffload_blocks_total", []string{`op="load"`, `status="io_error"`}, 3},
		{"kvoffload_lookups_total", nil, 7},
		{"kvoffload_lookups", nil, 0},
	} {
		if got := Sum(m, c.name, c.labels...); got != c.want {
			t.Errorf("Sum(%s, %v) = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

func TestParseHelp(t *testing.T) {
	help := "kvoffloadd keeps blocks\n-not a flag\nFlags:\n  -cpu-bytes value\n    \tsize of the CPU tier\n    \t-not-a-flag either\n  -disk-dir string\n    \tdirectory\n  -version\n    \tprint the version\n"
	got := parseHelp(help)
	if len(got) != 3 || !got["cpu-bytes"] || !got["disk-dir"] || !got["version"] {
		t.Errorf("parseHelp = %v", got)
	}
}
