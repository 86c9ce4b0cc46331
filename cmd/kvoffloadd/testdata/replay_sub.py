"""A router that follows vLLM KV events and fills gaps with vLLM's replay.

Written to vLLM's protocol (vllm/distributed/kv_events.py,
ZmqEventPublisher): live messages are [topic, seq (8 bytes, big-endian),
msgpack KVEventBatch] on a SUB socket, seq counting from 0; a replay is
asked on a DEALER connected to the publisher's ROUTER replay_endpoint with
the frames ["", start_seq (8 bytes, big-endian)], and answered with
["", seq, payload] for each buffered batch from start_seq on, then
["", END_SEQ (-1, 8 bytes signed), ""]. As llm-d's and Mooncake's
subscribers do, it expects seq 0 first and each next seq after; a message
past the expected one is a gap: it asks for a replay from the expected
seq, applies the replayed batches, then the live ones past them. A replay
that starts past what it asked for cannot fill the gap: it says so.

Batches are decoded as map-format events (the daemon's default, vLLM main);
hashes are ints. The view is {(namespace_id, hash): set of (medium,
locality)}.

Commands on stdin, one a line: "drop" closes the SUB socket (a router that
lost its connection), "connect" opens a new one, "view" prints the view.
Prints JSON lines: {"subscribed": true} at start, {"gap": ...} and
{"replayed": ...} as they happen, {"view": ..., ...} on "view", and
{"error": ...} before exiting 1 on anything vLLM's protocol does not allow.
Usage: replay_sub.py ENDPOINT REPLAY_ENDPOINT TOPIC; it stops when its
stdin closes.
"""

import json
import os
import sys

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def out(obj):
    print(json.dumps(obj), flush=True)


def fail(msg):
    out({"error": msg})
    sys.exit(1)


class Router:
    def __init__(self, endpoint, replay_endpoint, topic):
        self.ctx = zmq.Context()
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(replay_endpoint)
        self.sub = None
        self.expected = 0  # the next seq to apply
        self.view = {}
        self.gaps = 0
        self.replays = 0
        self.batches = 0

    def connect(self):
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def drop(self):
        self.sub.close()
        self.sub = None

    def apply(self, seq, payload):
        if seq != self.expected:
            fail(f"applying seq {seq}, expected {self.expected}")
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            fail(f"batch {seq} is not [ts, events, ...]")
        for ev in batch[1]:
            kind = ev.get("type") if isinstance(ev, dict) else None
            if kind == "AllBlocksCleared":
                self.view = {}
                continue
            if kind not in ("BlockStored", "BlockRemoved"):
                fail(f"event {ev!r}")
            where = (ev.get("medium"), ev.get("locality"))
            for h in ev["block_hashes"]:
                key = (ev["namespace_id"], h.to_bytes(8, "big").hex())
                held = self.view.setdefault(key, set())
                if kind == "BlockStored":
                    held.add(where)
                else:
                    held.discard(where)
                    if not held:
                        del self.view[key]
        self.expected = seq + 1
        self.batches += 1

    def replay(self, start):
        """Asks for every batch from start; returns them, in order."""
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            if not self.dealer.poll(30000):
                fail(f"no replay answer from seq {start} in 30 s")
            frames = self.dealer.recv_multipart()
            if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                fail(f"replay reply of {len(frames)} frames {frames[:2]!r}")
            if frames[1] == END_SEQ:
                if frames[2] != b"":
                    fail("END_SEQ with a payload")
                return got
            seq = int.from_bytes(frames[1], "big")
            if got and seq != got[-1][0] + 1:
                fail(f"replay skipped from {got[-1][0]} to {seq}")
            got.append((seq, frames[2]))

    def live(self, frames):
        if len(frames) != 3 or frames[0] != self.topic or len(frames[1]) != 8:
            fail(f"live message of {len(frames)} frames")
        seq = int.from_bytes(frames[1], "big")
        if seq < self.expected:
            return  # already applied from a replay
        if seq > self.expected:
            self.gaps += 1
            out({"gap": [self.expected, seq]})
            got = self.replay(self.expected)
            self.replays += 1
            if not got or got[0][0] != self.expected:
                out({"unrecoverable": [self.expected, got[0][0] if got else None]})
                fail(f"replay from {self.expected} started at {got[0][0] if got else 'nothing'}")
            for q, p in got:
                if q >= self.expected:
                    self.apply(q, p)
            out({"replayed": [got[0][0], got[-1][0]]})
            if seq < self.expected:
                return
            if seq > self.expected:
                fail(f"live seq {seq} past the replay's last {self.expected - 1}")
        self.apply(seq, frames[2])

    def dump(self):
        view = sorted([ns, h, m, l] for (ns, h), held in self.view.items() for (m, l) in held)
        out({"view": view, "expected": self.expected, "gaps": self.gaps, "replays": self.replays, "batches": self.batches})


def main():
    if len(sys.argv) != 4:
        fail("usage: replay_sub.py ENDPOINT REPLAY_ENDPOINT TOPIC")
    r = Router(*sys.argv[1:])
    r.connect()
    out({"subscribed": True})
    stdin = sys.stdin.fileno()
    buf = b""
    while True:
        poller = zmq.Poller()
        poller.register(stdin, zmq.POLLIN)
        if r.sub is not None:
            poller.register(r.sub, zmq.POLLIN)
        ready = dict(poller.poll(1000))
        if r.sub is not None and ready.get(r.sub):
            while True:
                try:
                    frames = r.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                r.live(frames)
        if ready.get(stdin):
            chunk = os.read(stdin, 4096)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = line.decode().strip()
                if cmd == "drop":
                    r.drop()
                    out({"dropped": True})
                elif cmd == "connect":
                    r.connect()
                    out({"connected": True})
                elif cmd == "view":
                    r.dump()
                else:
                    fail(f"command {cmd!r}")


if __name__ == "__main__":
    main()
