package events

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// The --events-zmq PUB socket is go-zeromq/zmq4's, which trusts its peers:
// it allocates whatever frame size a subscriber announces (a 2^62-byte
// header ends the process), performs each handshake inline in its accept
// loop without a deadline (one silent peer stops every later subscriber
// from connecting), and writes to its subscribers without a deadline. The
// publisher binds through the transports below instead (guardtcp://,
// guardipc://), whose connections read the peer's ZMTP stream as it
// passes and fail it past these bounds, so zmq4 drops that peer alone.
const (
	// pubMaxConns bounds the subscribers connected at once; past it a
	// connection is closed at accept.
	pubMaxConns = 256
	// pubMaxFrame bounds a frame or command a subscriber sends (its
	// READY, its subscriptions: a topic each).
	pubMaxFrame = 4096
	// pubWriteTimeout cuts off a subscriber that stops reading, rather
	// than letting it stall the others for good.
	pubWriteTimeout = 10 * time.Second
)

// pubHandshake bounds a subscriber's greeting and READY (a variable for
// the tests).
var pubHandshake = 10 * time.Second

var registerGuard sync.Once

// guardEndpoint is ep (tcp://... or ipc://...) through the guarded
// transport.
func guardEndpoint(ep string) string {
	registerGuard.Do(func() {
		zmq4.RegisterTransport("guardtcp", guardTransport{transport.New("tcp"), "tcp"})
		zmq4.RegisterTransport("guardipc", guardTransport{transport.New("unix"), "unix"})
	})
	if rest, ok := strings.CutPrefix(ep, "ipc://"); ok {
		return "guardipc://" + rest
	}
	return "guard" + ep
}

type guardTransport struct {
	transport.Transport
	network string
}

func (g guardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := net.Listen(g.network, addr)
	if err != nil {
		return nil, err
	}
	return &guardListener{Listener: l}, nil
}

// guardListener bounds the connections, each a guardConn.
type guardListener struct {
	net.Listener
	open    atomic.Int32
	refused atomic.Uint64
}

// Accept returns the next connection within the bound; those past it are
// closed here (zmq4 retries a failed Accept at once, so it never sees one
// but the listener's own).
func (l *guardListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.open.Add(1) > pubMaxConns {
			l.open.Add(-1)
			l.refused.Add(1)
			c.Close()
			continue
		}
		c.SetDeadline(time.Now().Add(pubHandshake))
		return &guardConn{Conn: c, l: l, greeting: 64, sizeBuf: make([]byte, 0, 8)}, nil
	}
}

// guardConn follows the ZMTP stream a peer sends: its 64-byte greeting,
// then frames (flags, a size of 1 or 8 bytes, the body). A frame past
// pubMaxFrame fails the read before zmq4 sees its size. The handshake's
// deadline is lifted once the peer's first command (its READY) is in.
type guardConn struct {
	net.Conn
	l      *guardListener
	closed atomic.Bool

	// The reader's own.
	greeting int    // greeting bytes still to pass
	state    int    // 0: flags next, 1: size bytes, 2: body
	flags    byte   // the frame's
	sizeBuf  []byte // size bytes read so far
	body     uint64 // body bytes still to pass
	ready    bool   // the handshake is done
}

func (c *guardConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if ferr := c.follow(p[:n]); ferr != nil {
		c.Close()
		return 0, ferr
	}
	if err != nil && !c.ready {
		c.Close() // zmq4 does not close a connection whose handshake failed
	}
	return n, err
}

func (c *guardConn) Write(p []byte) (int, error) {
	c.Conn.SetWriteDeadline(time.Now().Add(pubWriteTimeout))
	n, err := c.Conn.Write(p)
	if err != nil {
		// zmq4 keeps a connection whose write timed out: closed, its
		// next write fails for good and zmq4 drops it.
		c.Close()
	}
	return n, err
}

func (c *guardConn) Close() error {
	if c.closed.CompareAndSwap(false, true) {
		c.l.open.Add(-1)
	}
	return c.Conn.Close()
}

// follow advances the parser over b.
func (c *guardConn) follow(b []byte) error {
	for len(b) > 0 {
		if c.greeting > 0 {
			k := min(c.greeting, len(b))
			c.greeting -= k
			b = b[k:]
			continue
		}
		switch c.state {
		case 0:
			c.flags, b = b[0], b[1:]
			if c.flags&^(flagMore|flagLong|flagCommand) != 0 {
				return fmt.Errorf("events: ZMTP frame flags %#x from a subscriber", c.flags)
			}
			c.sizeBuf, c.state = c.sizeBuf[:0], 1
		case 1:
			want := 1
			if c.flags&flagLong != 0 {
				want = 8
			}
			k := min(want-len(c.sizeBuf), len(b))
			c.sizeBuf, b = append(c.sizeBuf, b[:k]...), b[k:]
			if len(c.sizeBuf) < want {
				continue
			}
			if want == 1 {
				c.body = uint64(c.sizeBuf[0])
			} else {
				c.body = binary.BigEndian.Uint64(c.sizeBuf)
			}
			if c.body > pubMaxFrame {
				return fmt.Errorf("events: a ZMTP frame of %d bytes from a subscriber, at most %d", c.body, pubMaxFrame)
			}
			c.state = 2
			if c.body == 0 {
				c.endFrame()
			}
		case 2:
			k := int(min(c.body, uint64(len(b))))
			c.body -= uint64(k)
			b = b[k:]
			if c.body == 0 {
				c.endFrame()
			}
		}
	}
	return nil
}

func (c *guardConn) endFrame() {
	c.state = 0
	if !c.ready && c.flags&flagCommand != 0 {
		c.ready = true
		c.Conn.SetReadDeadline(time.Time{})
	}
}
