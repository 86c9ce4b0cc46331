"""The connector's KV events (kvoffload.kv_events, docs/events.md).

Unit tests of the translation into vLLM's classes, field by field in vLLM's
order (vllm/distributed/kv_events.py at 7cfb97e33791),
and, through the vLLM stand-in against the real daemon, a replay of what the
connector handed to vLLM's ``take_events`` after a random workload with
demotions, evictions from both tiers and a daemon restart equals a Lookup of
every key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import types

import pytest
import standin_vllm as sv
from standin_engine import Config, Engine, Group, Workload
from standin_run import connector_module

import kvoffload as kv
from kvoffload.kv_events import (BlockInfo, BlockInfoMap, VLLMEventTypes, default_convert, event_group_specs, remember,
                                 translate)

K = kv.EventKind
T = kv.Tier

# vLLM main's field order (kv_events.py at 7cfb97e33791): the tag, then these.
STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality"]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx", "locality"]


def layout(ev) -> list:
    """An event as vLLM's msgspec encodes it (array_like, tagged): its class
    name, then its fields in declaration order."""
    return [type(ev).__name__.removeprefix("Old")] + [getattr(ev, f.name) for f in dataclasses.fields(ev)]


def ev(kind, tier=T.NONE, h=b"", group=0, seq=0, ns=1):
    return kv.KVEvent(seq, kind, tier, ns, group, h)


def H(i: int) -> bytes:
    return hashlib.sha256(bytes([i])).digest()


def types_(convert=bytes, specs=()) -> VLLMEventTypes:
    return VLLMEventTypes(sv.BlockStored, sv.BlockRemoved, sv.AllBlocksCleared, convert, specs)


def test_the_standin_classes_are_vllms_fields_in_vllms_order():
    assert [f.name for f in dataclasses.fields(sv.BlockStored)] == STORED_FIELDS
    assert [f.name for f in dataclasses.fields(sv.BlockRemoved)] == REMOVED_FIELDS
    assert dataclasses.fields(sv.AllBlocksCleared) == ()


def test_translation_field_by_field():
    infos = BlockInfoMap()
    infos.put(0, H(1), BlockInfo((1, 2, 3, 4), None))
    infos.put(0, H(2), BlockInfo((5, 6, 7, 8), H(1)))
    infos.put(0, H(3), BlockInfo((9, 10, 11, 12), H(2), 7, "adapter", ("adapter",)))
    infos.put(1, H(2), BlockInfo((5, 6, 7, 8, 9, 10, 11, 12), None, extra_keys=("salt",)))
    raw = [
        ev(K.ALL_BLOCKS_CLEARED),
        ev(K.BLOCK_STORED, T.CPU, H(1)),
        ev(K.BLOCK_STORED, T.CPU, H(2)),  # its parent is H(1): one event
        ev(K.BLOCK_STORED, T.CPU, H(3)),  # another LoRA: a new event
        ev(K.BLOCK_STORED, T.DISK, H(9)),  # unknown: no tokens, no parent
        ev(K.CAUGHT_UP),
        ev(K.BLOCK_STORED, T.DISK, H(1)),  # a demotion: DISK first ...
        ev(K.BLOCK_REMOVED, T.CPU, H(1)),  # ... then CPU goes
        ev(K.BLOCK_REMOVED, T.CPU, H(2)),
        ev(K.BLOCK_REMOVED, T.DISK, H(2)),
        ev(K.BLOCK_STORED, T.CPU, H(2), group=1),
        ev(K.BLOCK_STORED, T.REMOTE, H(7)),  # the shared remote tier's
        ev(K.BLOCK_REMOVED, T.REMOTE, H(7)),
        ev(K.EVENTS_LOST),
        ev(K.ALL_BLOCKS_CLEARED),
    ]
    # A hybrid model: group 0 full attention, group 1 a sliding window of 128.
    specs = (("full_attention", None), ("sliding_window", 128))
    got = [layout(e) for e in translate(raw, infos, (4, 8), types_(specs=specs))]
    F, W = ["full_attention", None], ["sliding_window", 128]
    assert got == [
        ["AllBlocksCleared"],
        ["BlockStored", [H(1), H(2)], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU", None, None, 0, *F, "LOCAL"],
        ["BlockStored", [H(3)], H(2), [9, 10, 11, 12], 4, 7, "CPU", "adapter", [("adapter",)], 0, *F, "LOCAL"],
        ["BlockStored", [H(9)], None, [], 4, None, "STORAGE", None, None, 0, *F, "LOCAL"],
        ["BlockStored", [H(1)], None, [1, 2, 3, 4], 4, None, "STORAGE", None, None, 0, *F, "LOCAL"],
        ["BlockRemoved", [H(1), H(2)], "CPU", 0, "LOCAL"],
        ["BlockRemoved", [H(2)], "STORAGE", 0, "LOCAL"],
        ["BlockStored", [H(2)], None, [5, 6, 7, 8, 9, 10, 11, 12], 8, None, "CPU", None, [("salt",)], 1, *W, "LOCAL"],
        ["BlockStored", [H(7)], None, [], 4, None, "STORAGE", None, None, 0, *F, "REMOTE"],
        ["BlockRemoved", [H(7)], "STORAGE", 0, "REMOTE"],
        ["AllBlocksCleared"],
    ]


def test_hashes_as_vllm_publishes_them(monkeypatch):
    infos = BlockInfoMap()
    infos.put(0, H(2), BlockInfo((1,), H(1)))
    raw = [ev(K.BLOCK_STORED, T.CPU, H(2)), ev(K.BLOCK_REMOVED, T.DISK, H(2))]
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    want = [int.from_bytes(H(2)[-8:], "big"), int.from_bytes(H(1)[-8:], "big")]
    for conv in (default_convert, sv.maybe_convert_block_hash):
        st, rm = translate(raw, infos, (1,), types_(conv))
        assert (st.block_hashes, st.parent_block_hash, rm.block_hashes) == ([want[0]], want[1], [want[0]])
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    for conv in (default_convert, sv.maybe_convert_block_hash):
        st, _ = translate(raw, infos, (1,), types_(conv))
        assert (st.block_hashes, st.parent_block_hash) == ([H(2)], H(1))


def test_an_older_vllms_classes_get_only_their_fields():
    infos = BlockInfoMap()
    infos.put(0, H(1), BlockInfo((1, 2), None, 3, "x"))
    t = VLLMEventTypes(sv.OldBlockStored, sv.OldBlockRemoved, sv.AllBlocksCleared, bytes)
    st, rm = translate([ev(K.BLOCK_STORED, T.CPU, H(1)), ev(K.BLOCK_REMOVED, T.CPU, H(1))], infos, (2,), t)
    assert layout(st) == ["BlockStored", [H(1)], None, [1, 2], 2, 3, "CPU"]
    assert layout(rm) == ["BlockRemoved", [H(1)], "CPU"]


def test_group_kinds_as_vllm_names_them():
    """Each group's kv_cache_spec_kind and sliding window, by the spec's
    class as vLLM's get_kv_cache_spec_kind tests it (an MLA spec is a
    FullAttentionSpec subclass, and stays MLA), for a vLLM without that
    function; with it, vLLM's answer."""
    groups = [types.SimpleNamespace(kv_cache_spec=s) for s in (
        sv.FullAttentionSpec(16), sv.SlidingWindowSpec(16, 128), sv.MLAAttentionSpec(16), sv.MambaSpec(16))]
    cfg = types.SimpleNamespace(kv_cache_groups=groups)
    assert event_group_specs(cfg) == (("full_attention", None), ("sliding_window", 128), ("mla_attention", None),
                                      ("mamba", None))
    assert event_group_specs(None) == ()


def test_remember_keeps_what_vllms_block_hash_took():
    """Tokens, parent, LoRA and extra keys per block, as vLLM's
    generate_block_hash_extra_keys orders them: the LoRA name, the
    multimodal inputs the block overlaps, cache_salt on the first block."""
    mm = types.SimpleNamespace(identifier="img-1", mm_position=types.SimpleNamespace(offset=5, length=4))
    req = types.SimpleNamespace(all_token_ids=list(range(12)), lora_request=types.SimpleNamespace(adapter_id=3, name="ad"),
                                mm_features=[mm], cache_salt="salt")
    infos = BlockInfoMap()
    hashes = [H(i) for i in range(3)]
    remember(infos, req, hashes, 0, [0, 1, 2], 1, 4)
    assert infos.get(0, H(0)) == BlockInfo((0, 1, 2, 3), None, 3, "ad", ("ad", "salt"))
    assert infos.get(0, H(1)) == BlockInfo((4, 5, 6, 7), H(0), 3, "ad", ("ad", "img-1"))
    assert infos.get(0, H(2)) == BlockInfo((8, 9, 10, 11), H(1), 3, "ad", ("ad", "img-1"))
    plain = types.SimpleNamespace(all_token_ids=list(range(8)), lora_request=None)
    remember(infos, plain, [H(5), H(6)], 1, [1], 1, 4)
    assert infos.get(1, H(6)) == BlockInfo((4, 5, 6, 7), H(5), None, None, None)


def test_block_info_map_is_bounded():
    m = BlockInfoMap(3)
    for i in range(5):
        m.put(0, H(i), BlockInfo((i,), None))
    assert len(m) == 3
    assert m.get(0, H(0)) is None and m.get(0, H(1)) is None
    assert m.get(0, H(4)) == BlockInfo((4,), None)
    m.put(0, H(2), BlockInfo((2,), None))  # recorded again: now the newest
    m.put(0, H(5), BlockInfo((5,), None))
    assert m.get(0, H(2)) is not None and m.get(0, H(3)) is None


def test_off_unless_vllm_publishes_events(daemon):
    """Without --kv-events-config (and no extra config) the connector follows
    no stream; a vLLM without vllm.distributed.kv_events gets none either."""
    from standin_engine import kv_cache_config, vllm_config

    for switches, cfg in (({}, Config()), ({"kv_events": None}, Config(kv_events=True))):
        with connector_module(**switches) as mod:
            c = mod.KVOffloadConnector(vllm_config(cfg, daemon.socket), sv.KVConnectorRole.SCHEDULER,
                                       kv_cache_config(cfg))
            try:
                c.set_xfer_handshake_metadata({0: mod.KVOffloadHandshake(rank={"tp": 0}, fingerprint=b"fp")})
                assert c._scheduler.events is None
                assert tuple(c.take_events()) == ()
            finally:
                c.shutdown()


def test_the_feed_is_bounded_and_stops_while_blocked(client, shm, fingerprint):
    """Events wait in a bounded queue: with it full the thread stops reading
    (the stream backs up to the daemon) and never reaches the end of the
    snapshot; taking lets it go on, in order; close() stops it even while it
    waits on a full queue."""
    from test_client import NBLK, fill, keys, kv_region

    from kvoffload.kv_events import EventFeed

    r, layout_, regions = kv_region(shm)
    reg = client.register(fingerprint, layout_, regions, client_name="pytest")
    hs = keys(NBLK, fingerprint)
    for b in range(NBLK):
        fill(r, b, b)
    assert client.store(reg.registration_id, [kv.Job(1, hs, list(range(NBLK)))], wait=True)[0].ok
    feed = EventFeed(client, lambda: fingerprint, max_queued=2, max_events=2)
    try:
        with feed._cond:
            assert feed._cond.wait_for(lambda: len(feed._q) > 0, timeout=30)
            # Full: the snapshot's end (CAUGHT_UP) is not read until events are taken.
            assert not feed._cond.wait_for(lambda: feed.caught_up_seq >= 0, timeout=1)
            assert 0 < len(feed._q) <= 2 + 8 + 1  # max_queued, or one reply (the daemon's floor of 8, a marker)
        got: list = []
        while not got or got[-1].kind != K.CAUGHT_UP:
            with feed._cond:
                assert feed._cond.wait_for(lambda: len(feed._q) > 0, timeout=30)
            got += feed.take()
        assert got[0].kind == K.ALL_BLOCKS_CLEARED
        assert [e.hash for e in got if e.kind == K.BLOCK_STORED] and \
            {e.hash for e in got if e.kind == K.BLOCK_STORED} == set(hs)
        # Changes after the snapshot, then a full queue again, then close.
        assert client.invalidate([reg.namespace_id], hs) == NBLK
        with feed._cond:
            assert feed._cond.wait_for(lambda: len(feed._q) > 0, timeout=30)
    finally:
        feed.close()
    assert not feed._thread.is_alive()
    assert all(e.kind in (K.BLOCK_REMOVED, K.CAUGHT_UP) for e in feed.take())


# -- through the stand-in, against the real daemon ----------------------------------


def replay(events, held: set) -> None:
    """What a router does with vLLM's events: a set of (group, hash, medium)."""
    for e in events:
        name = type(e).__name__
        if name == "AllBlocksCleared":
            held.clear()
        elif name == "BlockStored":
            held.update((e.group_idx, h, e.medium) for h in e.block_hashes)
        elif name == "BlockRemoved":
            held.difference_update((e.group_idx, h, e.medium) for h in e.block_hashes)


def lookup_all(client, ns: int, keys) -> set:
    """What the daemon says it holds of every key, as (group, hash, medium)."""
    out = set()
    keys = sorted(keys)
    for (g, h), r in zip(keys, client.lookup_many([([ns], [h], g, 0, True) for g, h in keys], timeout=30)):
        if isinstance(r, Exception):
            raise r
        if r.ready:
            t = r.tiers[0]
            if t in (T.CPU, T.CPU_AND_DISK):
                out.add((g, h, "CPU"))
            if t in (T.DISK, T.CPU_AND_DISK):
                out.add((g, h, "STORAGE"))
    return out


def check_payloads(eng: Engine, events) -> int:
    """Every BlockStored the connector reports for this engine's blocks
    carries the tokens and parent its hashes were computed from: vLLM's
    chained hash of (parent, tokens) gives each hash back."""
    checked = 0
    for e in events:
        if type(e).__name__ != "BlockStored":
            continue
        assert e.block_size == eng.block_size and e.group_idx == 0 and e.lora_id is None
        assert e.medium in ("CPU", "STORAGE") and e.locality == "LOCAL" and e.kv_cache_spec_kind == "full_attention"
        assert len(e.token_ids) == e.block_size * len(e.block_hashes), "a block of this engine without its tokens"
        parent = e.parent_block_hash if e.parent_block_hash is not None else eng.hasher.none
        for i, h in enumerate(e.block_hashes):
            toks = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
            raw = parent + b"".join(t.to_bytes(4, "little") for t in toks)
            assert hashlib.sha256(raw).digest()[:eng.hasher.nbytes] == h, "token ids or parent do not hash to the block"
            parent = h
            checked += 1
    return checked


STEPS = 150


def converge(eng: Engine, d) -> set:
    """Replays everything the connector handed to vLLM so far and compares it
    with a Lookup of every key the engine planned. The daemon may still be
    finishing stores and disk writes: compare again as events arrive, until
    they agree or a minute has passed. Returns what the daemon holds."""
    c = d.client()
    (ns,) = c.resolve([eng.sched_conn._scheduler._events_fp])
    deadline = time.monotonic() + 60
    while True:
        eng.take_kv_events()
        held: set = set()
        replay(eng.kv_events, held)
        want = lookup_all(c, ns, eng.planned_keys)
        if held == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert held == want, (f"{len(held - want)} reported but not held, e.g. {sorted(held - want)[:3]}; "
                          f"{len(want - held)} held but not reported, e.g. {sorted(want - held)[:3]}")
    return want


def test_replay_of_the_connectors_events_equals_lookup(fresh_daemon, shm, monkeypatch):
    # Bytes hashes, so the test can recompute each hash from the event's
    # parent and tokens (the int form is the same hash's low 64 bits).
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    # 16-token blocks of 128 layers: 64 KiB, so a 4 MiB CPU tier holds 64
    # and a 16 MiB disk tier ~240: the workload demotes and evicts from both,
    # before the restart and after it.
    d = fresh_daemon("--disk-dir", "{dir}/disk", "--disk-bytes", "16MiB", "--disk-chunk-bytes", "1MiB",
                     "--cpu-chunk-bytes", "1MiB", cpu_bytes="4MiB", log_level="warn")
    cfg = Config(groups=[Group("full", 16, 128)], num_blocks=160, max_batched_tokens=512, max_seqs=16, model="kv-events",
                 kv_events=True)
    with connector_module() as mod:
        eng = Engine(cfg, mod, d.socket, shm)
        # Large blocks make the stand-in's check of every position slow; the
        # KV it holds is checked by test_vllm_connector.py, events here.
        eng.verify = lambda: None
        for m in eng.memory:
            m.write = lambda *a: None
        try:
            wl = Workload(11, eng.block_size, prefixes=3, arrival=0.9, max_prompt_units=8, max_output=6)
            feed = eng.sched_conn._scheduler.events
            assert feed is not None
            for i in range(STEPS):
                if i == STEPS // 2:
                    # Before the restart resets everything: what the evictions
                    # so far left, then with some blocks invalidated (the disk
                    # tier does not always evict: when full it may refuse).
                    held = converge(eng, d)
                    c = d.client()
                    (ns,) = c.resolve([eng.sched_conn._scheduler._events_fp])
                    gone = sorted({h for g, h, m in held if m == "STORAGE"})[:16]
                    assert gone and c.invalidate([ns], gone) == len(gone)
                    converge(eng, d)
                    d.restart()
                wl.tick(eng)
                eng.step()
            for rid in list(eng.requests):  # the backlog adds nothing new here
                eng.abort(rid)
            while not eng.idle():
                eng.step()
            eng.drain()

            want = converge(eng, d)
            names = [type(e).__name__ for e in eng.kv_events]
            removed = {e.medium for e in eng.kv_events if type(e).__name__ == "BlockRemoved"}
            stored = {e.medium for e in eng.kv_events if type(e).__name__ == "BlockStored"}
            assert removed == {"CPU", "STORAGE"} and stored == {"CPU", "STORAGE"}, (removed, stored)
            # A reset at the start, one after the restart.
            assert names.count("AllBlocksCleared") >= 2 and names[0] == "AllBlocksCleared"
            # ... and after the restart's reset, the blocks recovered from disk.
            after = eng.kv_events[names.index("AllBlocksCleared", 1) + 1:]
            assert any(type(e).__name__ == "BlockStored" and e.medium == "STORAGE" for e in after)
            # How many blocks the daemon holds at the end is not checked: it
            # depends on how many steps requests spent waiting for lookups and
            # loads, on stores refused while the CPU tier's slots wait for disk
            # writes, and on how many of the steps after the restart run once
            # the daemon is back (the engine does not wait for it: 75 steps
            # can end 1.3s after the restart, before the workers re-register,
            # and store nothing), all of which vary with the machine's load (beside
            # three busy loops: 26 to 296 blocks here; 78 to 288 at 8f6d10d,
            # whose half-way count went down to 23). What is checked is that the
            # replay equals the Lookup (converge), over a run that stored,
            # demoted and removed on both tiers, recovered from disk, and
            # stored more blocks (each checked against its tokens) than the
            # CPU tier holds.
            assert any(m == "STORAGE" for _, _, m in want), len(want)
            assert check_payloads(eng, eng.kv_events) > 64
            assert feed.streams >= 2
        finally:
            eng.close()
    assert not feed._thread.is_alive()
