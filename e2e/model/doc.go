// Package model is the model-based randomized test of kvoffloadd
// (docs/model-test.md): a seeded generator of operation sequences across
// several clients, a runner that plays them against the real daemon binary
// over its unix socket (regions in /dev/shm, the disk tier in a temporary
// directory, restarts with SIGTERM and SIGKILL, fault plans, damage from
// outside), and a model of what the daemon may hold that every step is
// checked against. A failing run prints its seed and the shortest failing
// sequence the reducer finds.
//
// Files, in the order a run uses them: shape.go (the daemon's configuration
// and the run's universe), ops.go (the operations), generator.go,
// daemon.go (the process), runner.go (the run, connections and
// registrations), data.go (lookups, stores, loads, results, bursts),
// admin.go (invalidation, restarts, damage, refused requests, Stats),
// model.go (what the daemon may hold), content.go (the bytes of a block),
// checks.go (accounting, quiet and end checks), reduce.go.
package model
