package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvoffloadd/kvoffloadd/offload"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// remoteFlags are the remote tier's settings (docs/remote.md).
type remoteFlags struct {
	addrs        []string
	passwordFile string
	tls          bool
	caFile       string
	timeout      time.Duration
	keyFile      string
	write        string
	writeMode    offload.WriteMode
	queue        int
	waitReplicas int
	stateDir     string
}

func (r *remoteFlags) register(fs *flag.FlagSet) {
	r.timeout = 500 * time.Millisecond
	r.write = "all"
	r.queue = 256
	fs.Func("remote-redis", "seed nodes of a Redis Cluster (or Valkey) for the shared remote tier, host:port[,host:port...]; the rest of the cluster is learned from them. Without it there is no remote tier. A cluster that is down at start is a warning: the local tiers serve and the daemon keeps trying. An Invalidate writes generation records into the cluster that make every node refuse the old values; a write that fails makes the Invalidate answer UNAVAILABLE (other nodes may load the blocks until it goes through) and is tried again until it does; with --disk-dir (or --remote-state-dir) it is kept there and resumed after a restart, without either a restart forgets it.", func(v string) error {
		for _, a := range strings.Split(v, ",") {
			if a = strings.TrimSpace(a); a != "" {
				r.addrs = append(r.addrs, a)
			}
		}
		return nil
	})
	fs.StringVar(&r.passwordFile, "remote-password-file", "", "file holding the cluster's password (requirepass / AUTH); surrounding whitespace is ignored. Must not be readable by others.")
	fs.BoolVar(&r.tls, "remote-tls", false, "reach the cluster over TLS, verifying its nodes' certificates against the system roots or --remote-ca-file.")
	fs.StringVar(&r.caFile, "remote-ca-file", "", "PEM file of the CA(s) that sign the cluster's certificates (with --remote-tls).")
	fs.DurationVar(&r.timeout, "remote-timeout", r.timeout, "bound on one round trip to the cluster: a Lookup's check, one batch (at most 64MiB) of a Load, a publish batch, a Store's read of its blocks' generation records (while its copies run; its result waits for it), an Invalidate's writes of its generation records. A node slower than this costs IO_ERROR for its blocks, never a stall.")
	fs.StringVar(&r.keyFile, "remote-key-file", "", "file of at least 32 bytes of secret key material shared by the fleet: every value carries a keyed BLAKE3 MAC and a value without a valid one is CORRUPT. Nodes with different keys (or none) use separate keyspaces. Must not be readable by others.")
	fs.StringVar(&r.write, "remote-write", r.write, "which blocks this node publishes to the remote tier, each stamped with the generation records read while its Store ran: all (every block a Store makes ready, deduplicated), kept (only those the CPU tier still holds when their turn in the publish queue comes) or none (read only).")
	fs.IntVar(&r.waitReplicas, "remote-wait-replicas", 0, "with a positive N, an Invalidate's generation records count as written only once N replicas of their master acknowledged them (WAIT, within --remote-timeout); fewer makes the Invalidate answer UNAVAILABLE and the records are tried again. 0: a master's acknowledgement is enough (a master that dies before replicating a record can leave its promoted replica serving the old blocks).")
	fs.StringVar(&r.stateDir, "remote-state-dir", "", "for a node without --disk-dir: a directory (created if absent) that keeps the Invalidates whose generation records are still to be written to the cluster (kvoffload.remote-fences, synced before the Invalidate returns), so a restart, even after kill -9, fences them again and writes them. The directory is locked (kvoffload.remote.lock): a second daemon given it refuses to start. With --disk-dir they are kept there; without either, a restart forgets them.")
	fs.IntVar(&r.queue, "remote-queue", r.queue, "blocks waiting to be published, at most; past it a publish is dropped and counted. With --remote-write=all each holds its CPU slot until sent.")
}

// validate checks the remote flags; bad collects each problem.
func (r *remoteFlags) validate(bad func(format string, a ...any)) {
	if len(r.addrs) == 0 {
		if r.passwordFile != "" || r.tls || r.caFile != "" || r.keyFile != "" || r.stateDir != "" || r.waitReplicas != 0 {
			bad("--remote-password-file, --remote-tls, --remote-ca-file, --remote-key-file, --remote-state-dir and --remote-wait-replicas need a remote tier: add --remote-redis")
		}
		return
	}
	for _, a := range r.addrs {
		host, port, err := net.SplitHostPort(a)
		if p, perr := strconv.Atoi(port); err != nil || host == "" || perr != nil || p < 1 || p > 65535 {
			bad("--remote-redis %q: want host:port", a)
		}
	}
	if r.timeout <= 0 || r.timeout > time.Minute {
		bad("--remote-timeout %s: want a positive duration of at most 1m", r.timeout)
	}
	m, err := offload.ParseWriteMode(r.write)
	if err != nil {
		bad("--remote-write %v", err)
	}
	r.writeMode = m
	if r.queue < 1 || r.queue > 1<<16 {
		bad("--remote-queue %d: want 1..65536", r.queue)
	}
	if r.waitReplicas < 0 || r.waitReplicas > 16 {
		bad("--remote-wait-replicas %d: want 0..16", r.waitReplicas)
	}
	if r.stateDir != "" {
		if err := os.MkdirAll(r.stateDir, 0o700); err != nil {
			bad("--remote-state-dir: %v", err)
		}
	}
	if r.caFile != "" && !r.tls {
		bad("--remote-ca-file needs --remote-tls")
	}
	for flagName, path := range map[string]string{"--remote-password-file": r.passwordFile, "--remote-key-file": r.keyFile} {
		if path == "" {
			continue
		}
		if err := privateFile(path); err != nil {
			bad("%s %s: %v", flagName, path, err)
		}
	}
	if r.caFile != "" {
		if _, err := os.Stat(r.caFile); err != nil {
			bad("--remote-ca-file: %v", err)
		}
	}
}

// privateFile refuses a secret file that others may read or anyone but its
// owner may write.
func privateFile(path string) error {
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("not a regular file")
	}
	if p := st.Mode().Perm(); p&0o026 != 0 {
		return fmt.Errorf("mode %#o lets others read it or others than its owner write it; chmod 0600 (or 0640)", p)
	}
	return nil
}

// remoteConfig builds the remote tier from the flags (nil without
// --remote-redis). The cluster is not reached here: the service checks it
// at start and a cluster that is down is only a warning.
func remoteConfig(r *remoteFlags, log *slog.Logger) (*offload.RemoteConfig, error) {
	if len(r.addrs) == 0 {
		return nil, nil
	}
	redis.SetLogger(redisLogger{log})
	cfg := remote.RedisConfig{Addrs: r.addrs, Timeout: r.timeout, WaitReplicas: r.waitReplicas}
	if r.passwordFile != "" {
		b, err := os.ReadFile(r.passwordFile)
		if err != nil {
			return nil, fmt.Errorf("--remote-password-file: %w", err)
		}
		cfg.Password = strings.TrimSpace(string(b))
	}
	if r.tls {
		cfg.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
		if r.caFile != "" {
			pem, err := os.ReadFile(r.caFile)
			if err != nil {
				return nil, fmt.Errorf("--remote-ca-file: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("--remote-ca-file %s: no PEM certificate in it", r.caFile)
			}
			cfg.TLS.RootCAs = pool
		}
	}
	var mac *remote.MAC
	if r.keyFile != "" {
		m, err := remote.LoadMAC(r.keyFile)
		if err != nil {
			return nil, fmt.Errorf("--remote-key-file: %w", err)
		}
		mac = m
	} else {
		log.Warn("remote tier without --remote-key-file: anyone who can write to the cluster can make this node load blocks of their choosing (their checksums are checked, not their origin)")
	}
	store, err := remote.NewRedis(cfg)
	if err != nil {
		return nil, fmt.Errorf("--remote-redis: %w", err)
	}
	return &offload.RemoteConfig{Store: store, MAC: mac, Timeout: r.timeout, Write: r.writeMode, Queue: r.queue, StateDir: r.stateDir}, nil
}

// redisLogger sends go-redis's own log lines (a refused dial, a pool
// event) to the daemon's log at debug level: the remote tier's metrics and
// its own warnings are what an operator reads.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.Debug("go-redis: " + fmt.Sprintf(format, v...))
}
