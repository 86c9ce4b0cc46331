package events

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
)

// ZMQConfig is the daemon's own publisher of vLLM KV events (--events-zmq).
type ZMQConfig struct {
	// Endpoint to bind: tcp://HOST:PORT or ipc://PATH.
	Endpoint string
	// Topic is the first frame of every message (vLLM's default is "").
	Topic string
	VLLM  VLLM
	// HWM bounds the messages queued for the subscribers (default
	// DefaultZMQHWM); past it messages are dropped, as a ZeroMQ PUB
	// socket does, and a subscriber sees a gap in the sequence numbers.
	HWM int
	// ReplayEndpoint, when set, binds vLLM's replay socket there
	// (tcp://HOST:PORT or ipc://PATH): a subscriber that sees a gap in
	// the sequence numbers asks for the batches it missed (replay.go).
	ReplayEndpoint string
	// ReplayBatches and ReplayBytes bound the batches kept for replay
	// (defaults DefaultReplayBatches, DefaultReplayBytes).
	ReplayBatches int
	ReplayBytes   int64
	Logger        *slog.Logger
}

// DefaultZMQHWM: at most this many batches (of up to zmqBatch events,
// about 40 KiB with int hashes, 140 KiB with 32-byte hashes) wait for the
// subscribers: a snapshot of a million blocks fits.
const DefaultZMQHWM = 256

// zmqBatch bounds the events of one message.
const zmqBatch = 4096

// Publisher publishes every change the hub sees, over ZeroMQ, in vLLM's
// format: frames [topic, seq (8 bytes, big-endian), msgpack KVEventBatch],
// seq counting the messages from 0 as vLLM's ZmqEventPublisher does. It
// starts with AllBlocksCleared and a snapshot of every block (so a restart
// reads as a reset, then the recovered blocks), and says AllBlocksCleared
// again, then a snapshot, whenever its subscription lost changes.
type Publisher struct {
	sock   zmq4.Socket
	sub    *Sub
	cfg    ZMQConfig
	cancel context.CancelFunc
	done   chan struct{}
	// The replay socket and what it serves; nil without ReplayEndpoint.
	replay *replayServer
	buf    *replayBuf
}

// NewPublisher binds the endpoint and starts publishing; Close stops it.
func NewPublisher(h *Hub, cfg ZMQConfig) (*Publisher, error) {
	if !strings.HasPrefix(cfg.Endpoint, "tcp://") && !strings.HasPrefix(cfg.Endpoint, "ipc://") {
		return nil, fmt.Errorf("--events-zmq %q: want tcp://HOST:PORT or ipc://PATH", cfg.Endpoint)
	}
	if cfg.HWM <= 0 {
		cfg.HWM = DefaultZMQHWM
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ctx, cancel := context.WithCancel(context.Background())
	sock := zmq4.NewPub(ctx)
	if err := sock.SetOption(zmq4.OptionHWM, cfg.HWM); err != nil {
		cancel()
		sock.Close()
		return nil, fmt.Errorf("--events-zmq: %w", err)
	}
	if err := sock.Listen(guardEndpoint(cfg.Endpoint)); err != nil {
		cancel()
		sock.Close()
		return nil, fmt.Errorf("--events-zmq %s: %w", cfg.Endpoint, err)
	}
	p := &Publisher{sock: sock, cfg: cfg, cancel: cancel, done: make(chan struct{})}
	if cfg.ReplayEndpoint != "" {
		if cfg.ReplayBatches <= 0 {
			cfg.ReplayBatches = DefaultReplayBatches
		}
		if cfg.ReplayBytes <= 0 {
			cfg.ReplayBytes = DefaultReplayBytes
		}
		lis, err := listenReplay(cfg.ReplayEndpoint)
		if err != nil {
			cancel()
			sock.Close()
			return nil, fmt.Errorf("--events-zmq-replay %s: %w", cfg.ReplayEndpoint, err)
		}
		p.buf = newReplayBuf(cfg.ReplayBatches, cfg.ReplayBytes)
		p.replay = newReplayServer(lis, p.buf, cfg.Logger)
	}
	sub, err := h.Subscribe(nil, true)
	if err != nil {
		cancel()
		sock.Close()
		if p.replay != nil {
			p.replay.close()
		}
		return nil, fmt.Errorf("--events-zmq: %w", err)
	}
	p.sub = sub
	go p.run(ctx)
	return p, nil
}

// Addr is the bound address (a tcp port of 0 is resolved).
func (p *Publisher) Addr() string {
	a := p.sock.Addr()
	if a == nil || strings.HasPrefix(p.cfg.Endpoint, "ipc://") {
		return p.cfg.Endpoint
	}
	return a.Network() + "://" + a.String()
}

func (p *Publisher) run(ctx context.Context) {
	defer close(p.done)
	buf := make([]Event, 0, zmqBatch)
	var payload []byte
	var seq uint64
	topic := []byte(p.cfg.Topic)
	for ctx.Err() == nil {
		evs, err := p.sub.Next(ctx, nil, buf)
		if err != nil {
			return
		}
		if evs[0].Kind == Lost {
			p.cfg.Logger.Warn("events: the ZeroMQ publisher fell behind; publishing AllBlocksCleared and a snapshot")
		}
		var n int
		ts := float64(time.Now().UnixNano()) / 1e9
		if payload, n = p.cfg.VLLM.AppendBatch(payload[:0], ts, evs); n == 0 {
			continue
		}
		// The socket keeps the frames until they are sent, and the replay
		// buffer keeps the payload: fresh ones. Buffered first, so a
		// batch a subscriber has seen can always be asked for again.
		fresh := append([]byte(nil), payload...)
		if p.buf != nil {
			p.buf.add(seq, fresh)
		}
		msg := zmq4.NewMsgFrom(topic, binary.BigEndian.AppendUint64(nil, seq), fresh)
		if err := p.sock.Send(msg); err != nil {
			if ctx.Err() == nil {
				p.cfg.Logger.Error("events: ZeroMQ publish failed", "err", err)
			}
			return
		}
		seq++
	}
}

// ReplayAddr is the replay socket's bound address ("" without one).
func (p *Publisher) ReplayAddr() string {
	if p.replay == nil {
		return ""
	}
	if strings.HasPrefix(p.cfg.ReplayEndpoint, "ipc://") {
		return p.cfg.ReplayEndpoint
	}
	return "tcp://" + p.replay.lis.Addr().String()
}

// ReplayStats is what the replay socket did (zero without one).
func (p *Publisher) ReplayStats() ReplayStats {
	if p.replay == nil {
		return ReplayStats{}
	}
	return p.replay.stats()
}

// Close stops publishing and closes the sockets.
func (p *Publisher) Close() error {
	p.cancel()
	<-p.done
	p.sub.Close()
	var rerr error
	if p.replay != nil {
		rerr = p.replay.close()
	}
	return errors.Join(p.sock.Close(), rerr)
}
