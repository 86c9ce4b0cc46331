"""A router's consumer of vLLM KV events, reading the daemon's --events-zmq.

It decodes every message as msgspec decodes one into vLLM's structs
(vllm/distributed/kv_events.py at vLLM main 7cfb97e33791, the declarations
below: field names, order, defaults and types), with msgspec's rules: the
KVEventBatch is an array (array_like), each event a map tagged by "type"
(or, with format "array", vLLM up to 0.23, an array starting with its
class name); a field without a default must be there; a missing one with a
default takes it; a key the struct does not declare is skipped, as are
extra trailing elements of an array; a value of the wrong type fails.

Then it keys blocks as a router keyed on vLLM's constants does: ``medium``
must be one of MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE, ``locality`` LOCAL,
REMOTE or unset. Beyond vLLM's schema it reads the daemon's
``namespace_id`` (docs/events.md), the engine identity a block belongs to.

Prints each event as a JSON line; exits 1 on the first message vLLM's
structs would not take. Usage: vllm_schema_sub.py ENDPOINT TOPIC FORMAT;
it stops when its stdin closes.
"""

import json
import sys

import msgpack
import zmq

REQUIRED = object()

# vLLM's declarations: (field, type, default).
EVENT_BATCH = [("ts", "float", REQUIRED), ("events", "list", REQUIRED), ("data_parallel_rank", "int?", None)]
BLOCK_STORED = [
    ("block_hashes", "hashes", REQUIRED),
    ("parent_block_hash", "hash?", REQUIRED),
    ("token_ids", "ints", REQUIRED),
    ("block_size", "int", REQUIRED),
    ("lora_id", "int?", REQUIRED),
    ("medium", "str?", REQUIRED),
    ("lora_name", "str?", REQUIRED),
    ("extra_keys", "list?", None),
    ("group_idx", "int?", None),
    ("kv_cache_spec_kind", "str?", None),
    ("kv_cache_spec_sliding_window", "int?", None),
    ("locality", "str?", None),
]
BLOCK_REMOVED = [
    ("block_hashes", "hashes", REQUIRED),
    ("medium", "str?", REQUIRED),
    ("group_idx", "int?", None),
    ("locality", "str?", None),
]
EVENTS = {"BlockStored": BLOCK_STORED, "BlockRemoved": BLOCK_REMOVED, "AllBlocksCleared": []}

# vllm/distributed/kv_events.py's media; vllm/v1/kv_offload/base.py's Locality.
MEDIA = {"GPU", "CPU", "STORAGE"}
LOCALITIES = {None, "LOCAL", "REMOTE"}


def fail(msg):
    print(json.dumps({"error": msg}), flush=True)
    sys.exit(1)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check(name, typ, v):
    """msgspec's type check of one field."""
    if typ.endswith("?"):
        if v is None:
            return
        typ = typ[:-1]
    ok = {
        "float": lambda: isinstance(v, float) or is_int(v),
        "int": lambda: is_int(v),
        "str": lambda: isinstance(v, str),
        "list": lambda: isinstance(v, list),
        "ints": lambda: isinstance(v, list) and all(is_int(x) for x in v),
        "hash": lambda: isinstance(v, bytes) or is_int(v),  # ExternalBlockHash = bytes | int
        "hashes": lambda: isinstance(v, list) and all(isinstance(x, bytes) or is_int(x) for x in v),
    }[typ]()
    if not ok:
        fail(f"{name}: {v!r} is not {typ}")


def decode_struct(cls, fields, obj, as_array):
    """What msgspec makes of obj as struct cls: a dict of every field, and
    what it skipped (unknown keys, or extra trailing elements)."""
    out, extra = {}, {}
    if as_array:
        if not isinstance(obj, list):
            fail(f"{cls}: {obj!r} is not an array")
        for i, (name, typ, default) in enumerate(fields):
            if i < len(obj):
                check(f"{cls}.{name}", typ, obj[i])
                out[name] = obj[i]
            elif default is REQUIRED:
                fail(f"{cls}: {len(obj)} elements, field {name} has no default")
            else:
                out[name] = default
        extra = {"trailing": obj[len(fields):]}
        return out, extra
    if not isinstance(obj, dict):
        fail(f"{cls}: {obj!r} is not a map")
    names = {f[0] for f in fields}
    for name, typ, default in fields:
        if name in obj:
            check(f"{cls}.{name}", typ, obj[name])
            out[name] = obj[name]
        elif default is REQUIRED:
            fail(f"{cls}: no {name}, which has no default")
        else:
            out[name] = default
    extra = {k: v for k, v in obj.items() if k not in names}
    return out, extra


def decode_event(ev, fmt):
    if fmt == "map":
        if not isinstance(ev, dict) or ev.get("type") not in EVENTS:
            fail(f"event {ev!r}: no tag vLLM's union knows")
        cls = ev["type"]
        body = {k: v for k, v in ev.items() if k != "type"}
        fields, skipped = decode_struct(cls, EVENTS[cls], body, False)
        ns = skipped.get("namespace_id")
    else:
        if not isinstance(ev, list) or not ev or ev[0] not in EVENTS:
            fail(f"event {ev!r}: no tag vLLM's union knows")
        cls = ev[0]
        fields, skipped = decode_struct(cls, EVENTS[cls], ev[1:], True)
        trailing = skipped["trailing"]
        ns = trailing[0] if trailing else None
    if cls == "AllBlocksCleared":
        return {"type": cls}
    if fields["medium"] not in MEDIA:
        fail(f"{cls}: medium {fields['medium']!r} is none of vLLM's {sorted(MEDIA)}")
    if fields["locality"] not in LOCALITIES:
        fail(f"{cls}: locality {fields['locality']!r} is none of vLLM's")
    hashes = []
    for h in fields["block_hashes"]:
        hashes.append(h.to_bytes(8, "big").hex() if is_int(h) else h.hex())
    out = {"type": cls, "hashes": hashes, "medium": fields["medium"], "locality": fields["locality"],
           "group": fields["group_idx"], "namespace": ns if is_int(ns) else -1}
    if cls == "BlockStored":
        out["kind"] = fields["kv_cache_spec_kind"]
    return out


def main():
    endpoint, topic, fmt = sys.argv[1:4]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    print(json.dumps({"subscribed": True}), flush=True)
    while True:
        ready = dict(poller.poll())
        if sys.stdin.fileno() in ready and not sys.stdin.buffer.read1(1):
            return
        if sub not in ready:
            continue
        # vLLM's ZmqEventPublisher: (topic, seq as 8 bytes big-endian, payload).
        frames = sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            fail(f"frames {[len(f) for f in frames]}: want topic, 8-byte seq, payload")
        seq = int.from_bytes(frames[1], "big")
        batch, _ = decode_struct("KVEventBatch", EVENT_BATCH, msgpack.unpackb(frames[2], raw=False), True)
        for ev in batch["events"]:
            out = decode_event(ev, fmt)
            out["seq"] = seq
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
