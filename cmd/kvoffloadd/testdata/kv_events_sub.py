"""An independent decoder of the daemon's --events-zmq messages.

Written from vLLM's kv_events.py (main, 7cfb97e33791) and docs/events.md: a
message is the frames [topic, seq as 8 bytes big-endian, msgpack
KVEventBatch]; a batch is the array [ts, events, data_parallel_rank]; an
event is a map with its class under "type" and its fields in declaration
order, then the daemon's namespace_id (format "map", vLLM main), or a
positional array (format "array", vLLM up to 0.23).

It checks every message's layout field by field, exits 1 on the first
departure, and prints each event as a JSON line for the Go test to replay.
vllm_schema_sub.py reads the same stream as vLLM's own structs would.
Usage: kv_events_sub.py ENDPOINT TOPIC FORMAT HASHES BLOCK_SIZE; it stops
when its stdin closes.
"""

import json
import sys

import msgpack
import zmq

STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
               "lora_id", "medium", "lora_name", "group_idx", "locality", "namespace_id"]
REMOVED_KEYS = ["type", "block_hashes", "medium", "group_idx", "locality", "namespace_id"]
# The tiers as vLLM's media and localities: the CPU tier, the disk tier.
MEDIA = {("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")}


def fail(msg):
    print(json.dumps({"error": msg}), flush=True)
    sys.exit(1)


def check_hashes(hs, kind):
    if not isinstance(hs, list) or not hs:
        fail(f"block_hashes {hs!r}")
    out = []
    for h in hs:
        if kind == "int":
            if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < 1 << 64:
                fail(f"hash {h!r} is not a uint64")
            out.append(h.to_bytes(8, "big").hex())
        else:
            if not isinstance(h, bytes) or len(h) not in (16, 32):
                fail(f"hash {h!r} is not 16 or 32 bytes")
            out.append(h.hex())
    return out


def decode_event(ev, fmt, hashes, block_size):
    if fmt == "map":
        if not isinstance(ev, dict):
            fail(f"event {ev!r} is not a map")
        keys = list(ev.keys())
        kind = ev.get("type")
        want = {"BlockStored": STORED_KEYS, "BlockRemoved": REMOVED_KEYS, "AllBlocksCleared": ["type"]}.get(kind)
        if want is None or keys != want:
            fail(f"event keys {keys}, want {want} for {kind!r}")
        fields = [ev[k] for k in keys]
    else:
        if not isinstance(ev, list) or not ev:
            fail(f"event {ev!r} is not an array")
        kind = ev[0]
        n = {"BlockStored": 14, "BlockRemoved": 6, "AllBlocksCleared": 1}.get(kind)
        if n is None or len(ev) != n:
            fail(f"{kind!r} has {len(ev)} fields, want {n}")
        fields = ev
    if kind == "AllBlocksCleared":
        return {"type": kind}
    if kind == "BlockStored":
        if fmt == "map":
            _, hs, parent, tokens, bs, lora_id, medium, lora_name, group, locality, ns = fields
        else:
            _, hs, parent, tokens, bs, lora_id, medium, lora_name, extra, group, kind_, window, locality, ns = fields
            if extra is not None or kind_ is not None or window is not None:
                fail(f"extra_keys {extra!r}, kv_cache_spec_kind {kind_!r}, kv_cache_spec_sliding_window {window!r}")
        if parent is not None or tokens != [] or lora_id is not None or lora_name is not None:
            fail(f"BlockStored fields {fields!r}")
        if bs != block_size:
            fail(f"block_size {bs!r}, want {block_size}")
    else:
        _, hs, medium, group, locality, ns = fields
    if (medium, locality) not in MEDIA:
        fail(f"medium {medium!r}, locality {locality!r}")
    if not isinstance(group, int) or group < 0:
        fail(f"group_idx {group!r}")
    if not isinstance(ns, int) or isinstance(ns, bool) or not 0 < ns < 1 << 32:
        fail(f"namespace_id {ns!r}")
    return {"type": kind, "hashes": check_hashes(hs, hashes), "medium": medium, "locality": locality, "group": group,
            "namespace": ns}


def main():
    endpoint, topic, fmt, hashes, block_size = sys.argv[1:6]
    block_size = int(block_size)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    print(json.dumps({"subscribed": True}), flush=True)
    last = None
    while True:
        ready = dict(poller.poll())
        if sys.stdin.fileno() in ready and not sys.stdin.buffer.read1(1):
            return
        if sub not in ready:
            continue
        frames = sub.recv_multipart()
        if len(frames) != 3:
            fail(f"{len(frames)} frames, want 3")
        if frames[0] != topic.encode():
            fail(f"topic {frames[0]!r}")
        if len(frames[1]) != 8:
            fail(f"seq frame of {len(frames[1])} bytes")
        seq = int.from_bytes(frames[1], "big")
        if last is not None and seq != last + 1:
            fail(f"seq {seq} after {last}")
        last = seq
        batch = msgpack.unpackb(frames[2], raw=False)
        if not isinstance(batch, list) or len(batch) != 3:
            fail(f"batch {batch!r} is not [ts, events, data_parallel_rank]")
        ts, evs, rank = batch
        if not isinstance(ts, float) or not isinstance(evs, list) or not evs or rank != 0:
            fail(f"batch header ts={ts!r} rank={rank!r}")
        for ev in evs:
            out = decode_event(ev, fmt, hashes, block_size)
            out["seq"] = seq
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
