package errorfs_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
)

func TestParsePlan(t *testing.T) {
	for _, c := range []struct {
		spec      string
		want      errorfs.Plan
		canonical string
	}{
		{"", errorfs.Plan{}, ""},
		{"   ", errorfs.Plan{}, ""},
		{
			"read-eio=0.01,bitflip=0.001,latency=2ms@0.05,seed=7",
			errorfs.Plan{ReadEIO: 0.01, BitFlip: 0.001, Latency: 2 * time.Millisecond, LatencyRate: 0.05, Seed: 7},
			"read-eio=0.01,bitflip=0.001,latency=2ms@0.05,seed=7",
		},
		{
			"seed=3,enospc=1,torn-write=0.5,short-read=0.25,write-eio=0.125,read-eio=0,bitflip=1e-3",
			errorfs.Plan{ENOSPC: 1, TornWrite: 0.5, ShortRead: 0.25, WriteEIO: 0.125, BitFlip: 0.001, Seed: 3},
			"write-eio=0.125,short-read=0.25,torn-write=0.5,bitflip=0.001,enospc=1,seed=3",
		},
		{" read-eio = 0.5 , seed= 9 ", errorfs.Plan{ReadEIO: 0.5, Seed: 9}, "read-eio=0.5,seed=9"},
		{"read-eio=1", errorfs.Plan{ReadEIO: 1}, "read-eio=1,seed=0"},
		{"latency=1.5s@1", errorfs.Plan{Latency: 1500 * time.Millisecond, LatencyRate: 1}, "latency=1.5s@1,seed=0"},
		{"seed=18446744073709551615", errorfs.Plan{Seed: 1<<64 - 1}, "seed=18446744073709551615"},
	} {
		t.Run(c.spec, func(t *testing.T) {
			got, err := errorfs.ParsePlan(c.spec)
			if err != nil {
				t.Fatal(err)
			}
			if got != c.want {
				t.Errorf("ParsePlan = %+v, want %+v", got, c.want)
			}
			if s := got.String(); s != c.canonical {
				t.Errorf("String() = %q, want %q", s, c.canonical)
			}
			back, err := errorfs.ParsePlan(got.String())
			if err != nil || back != got {
				t.Errorf("ParsePlan(String()) = %+v, %v; want %+v", back, err, got)
			}
			if err := got.Validate(); err != nil {
				t.Errorf("Validate: %v", err)
			}
		})
	}
}

func TestParsePlanErrors(t *testing.T) {
	for _, c := range []struct {
		spec  string
		token string // the token the error must quote
		say   string // and a word of the reason
	}{
		{"foo=0.1", "foo=0.1", "unknown kind"},
		{"read-eio=0.1,index=0.5", "index=0.5", "unknown kind"},
		{"read-eio=1.5", "read-eio=1.5", "outside [0,1]"},
		{"read-eio=-0.1", "read-eio=-0.1", "outside [0,1]"},
		{"read-eio=NaN", "read-eio=NaN", "outside [0,1]"},
		{"read-eio=Inf", "read-eio=Inf", "outside [0,1]"},
		{"read-eio=abc", "read-eio=abc", "not a number"},
		{"read-eio=", "read-eio=", "not a number"},
		{"read-eio", "read-eio", "kind=value"},
		{"=0.1", "=0.1", "kind=value"},
		{"read-eio=0.1,", "", "kind=value"},
		{"read-eio=0.1,read-eio=0.2", "read-eio=0.2", "twice"},
		{"read-eio=0,read-eio=0", "read-eio=0", "twice"},
		{"seed=1,bitflip=0.1,seed=2", "seed=2", "twice"},
		{"latency=1ms@0.1,latency=2ms@0.1", "latency=2ms@0.1", "twice"},
		{"latency=2ms", "latency=2ms", "DURATION@RATE"},
		{"latency=2xs@0.1", "latency=2xs@0.1", "duration"},
		{"latency=0s@0.5", "latency=0s@0.5", "positive duration"},
		{"latency=-1ms@0.5", "latency=-1ms@0.5", "positive duration"},
		{"latency=2ms@2", "latency=2ms@2", "outside [0,1]"},
		{"latency=2ms@", "latency=2ms@", "not a number"},
		{"seed=-1", "seed=-1", "unsigned integer"},
		{"seed=x", "seed=x", "unsigned integer"},
		{"seed=18446744073709551616", "seed=18446744073709551616", "unsigned integer"},
	} {
		t.Run(c.spec, func(t *testing.T) {
			p, err := errorfs.ParsePlan(c.spec)
			if !errors.Is(err, errorfs.ErrSpec) {
				t.Fatalf("ParsePlan = %+v, %v; want ErrSpec", p, err)
			}
			if !strings.Contains(err.Error(), `"`+c.token+`"`) || !strings.Contains(err.Error(), c.say) {
				t.Errorf("error %q should quote %q and say %q", err, c.token, c.say)
			}
		})
	}
}

func TestPlanValidate(t *testing.T) {
	for _, c := range []struct {
		name string
		plan errorfs.Plan
		ok   bool
	}{
		{"zero", errorfs.Plan{}, true},
		{"ones", errorfs.Plan{ReadEIO: 1, WriteEIO: 1, ShortRead: 1, TornWrite: 1, BitFlip: 1, ENOSPC: 1, Latency: 1, LatencyRate: 1}, true},
		{"rate above 1", errorfs.Plan{TornWrite: 1.01}, false},
		{"negative rate", errorfs.Plan{ENOSPC: -1}, false},
		{"latency rate", errorfs.Plan{Latency: time.Millisecond, LatencyRate: 2}, false},
		{"negative latency", errorfs.Plan{Latency: -time.Millisecond, LatencyRate: 0.5}, false},
		{"latency rate without latency", errorfs.Plan{LatencyRate: 0.5}, false},
		{"latency without rate", errorfs.Plan{Latency: time.Millisecond}, true},
	} {
		err := c.plan.Validate()
		if c.ok != (err == nil) || (err != nil && !errors.Is(err, errorfs.ErrSpec)) {
			t.Errorf("%s: Validate = %v", c.name, err)
		}
	}
}

func TestPlanEnabled(t *testing.T) {
	for _, c := range []struct {
		plan errorfs.Plan
		want bool
	}{
		{errorfs.Plan{}, false},
		{errorfs.Plan{Seed: 5}, false},
		{errorfs.Plan{Latency: time.Second}, false},
		{errorfs.Plan{LatencyRate: 1}, false},
		{errorfs.Plan{Latency: time.Second, LatencyRate: 0.1}, true},
		{errorfs.Plan{BitFlip: 1e-9}, true},
	} {
		if got := c.plan.Enabled(); got != c.want {
			t.Errorf("%+v.Enabled() = %v", c.plan, got)
		}
	}
}
