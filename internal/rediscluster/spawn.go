package rediscluster

import (
	"os/exec"
	"runtime"
	"sync"
)

// Linux sends a child's parent-death signal (Pdeathsig) when the *thread*
// that started it exits, not the process. Go retires OS threads: one whose
// goroutine exits while locked to it is terminated (the daemon does that
// for the threads it lends a client's credentials to), and with it would
// go every redis-server it happened to have started. So every node is
// started from one goroutine locked to its thread while any cluster is
// open: the nodes die with the test process, and otherwise only when
// stopped.
var spawner struct {
	mu    sync.Mutex
	users int
	reqs  chan spawnReq
	done  chan struct{}
}

type spawnReq struct {
	cmd *exec.Cmd
	err chan error
}

// acquireSpawner starts the spawner for one more cluster.
func acquireSpawner() {
	spawner.mu.Lock()
	defer spawner.mu.Unlock()
	spawner.users++
	if spawner.users > 1 {
		return
	}
	reqs, done := make(chan spawnReq), make(chan struct{})
	spawner.reqs, spawner.done = reqs, done
	go func() {
		defer close(done)
		// Never unlocked: the thread ends with the goroutine, after
		// every node it started has been stopped.
		runtime.LockOSThread()
		for r := range reqs {
			r.err <- r.cmd.Start()
		}
	}()
}

// releaseSpawner stops the spawner when its last cluster has closed.
func releaseSpawner() {
	spawner.mu.Lock()
	defer spawner.mu.Unlock()
	spawner.users--
	if spawner.users > 0 {
		return
	}
	close(spawner.reqs)
	<-spawner.done
	spawner.reqs = nil
}

// start starts cmd on the spawner's thread. A cluster is open.
func start(cmd *exec.Cmd) error {
	spawner.mu.Lock()
	reqs := spawner.reqs
	spawner.mu.Unlock()
	r := spawnReq{cmd: cmd, err: make(chan error, 1)}
	reqs <- r
	return <-r.err
}
