"""A small vLLM that drives a KV connector the way vLLM does, and checks every block.

It is a stand-in for the parts of vLLM v1 between a connector and the GPU,
written from vLLM main at 003df2961dd8830c317a61f9745ccd557da9fa06
(vllm/v1/core/sched/scheduler.py, kv_cache_utils.py, the KV connector model
runner mixin, the output aggregator):

- requests hashed in chained blocks at the hash block size vLLM resolves
  (``resolve_kv_cache_block_sizes``), seeded like vLLM's NONE_HASH;
- one block pool shared by every KV cache group, with vLLM's null block 0,
  a local prefix cache, sliding-window groups that drop out-of-window blocks,
  decode context parallel (a scheduler block is ``dcp`` rank blocks, tokens
  interleaved over the DCP ranks), kernel blocks smaller than vLLM's blocks
  (FlashAttention-shaped tensors, NHD or HND) and MLA-shaped groups;
- Mamba groups in mamba_cache_mode "align" as vLLM's MambaManager at 7cfb97e
  has them (prefill chunks clipped to block boundaries, null blocks but the
  last of a chunk, the one state block of a hit, earlier state blocks freed
  and reused while the request runs), whose layers fold each token into the
  state read from the blocks and sample from it;
- vLLM's scheduling loop: running requests first (preempting the last one
  when blocks run out), then waiting ones, asking the connector
  ``get_num_new_matched_tokens`` for each (``None`` skips the request this
  step), ``update_state_after_alloc``, ``build_connector_meta``;
  asynchronous loads (WAITING_FOR_REMOTE_KVS), block-level failures
  (``_update_requests_with_invalid_blocks``, single-group as vLLM's is) and
  request-level ones, ``kv_load_failure_policy``, aborts,
  ``request_finished`` with delayed frees;
- async scheduling: step N+1 is scheduled before step N's output is
  processed, output placeholders, and frees deferred until the step that may
  still write a block is done;
- workers (one per rank) that call the connector in the model runner's
  order — handle_preemptions, bind, start_load_kv, forward, wait_for_save,
  get_transfer_results / get_finished, get_block_ids_with_load_errors,
  worker metadata, stats, clear — with a forward that writes each token's K
  and V as a pure function of the tokens before it, its position, the rank,
  group, layer and K/V.

After every step :meth:`Engine.verify` compares every computed position of
every block any request holds, on every rank, with that function: what a
run without offloading holds.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import random
import secrets
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import standin_multi
import standin_vllm as sv
from helpers import FakeTensor, wait_for

E = 2  # bytes per element
H = 2  # KV heads per rank
D = 4  # head size
DM = 8  # MLA latent size


class WrongKV(AssertionError):
    """A block holds bytes a run without offloading would not."""


# -- requests and their tokens ---------------------------------------------------


def _digest(prev: bytes, token: int) -> bytes:
    return hashlib.blake2b(prev + token.to_bytes(4, "little"), digest_size=8).digest()


class Sequence:
    """A request's tokens: the prompt, then sampled tokens, each a pure
    function of the tokens before it (so scheduler and workers agree)."""

    def __init__(self, prompt: list[int], seed: bytes):
        self.prompt = list(prompt)
        self.tokens = list(prompt)
        self.digests: list[bytes] = []
        self._seed = seed
        self.salt = b""  # the request id: what a scratch group's KV depends on besides the tokens

    def digest(self, p: int) -> bytes:
        while len(self.digests) <= p:
            i = len(self.digests)
            prev = self.digests[-1] if self.digests else self._seed
            self.digests.append(_digest(prev, self.token(i)))
        return self.digests[p]

    def token(self, p: int) -> int:
        while len(self.tokens) <= p:
            i = len(self.tokens)
            self.tokens.append(int.from_bytes(self.digest(i - 1)[:2], "little") % 5000 + 10)
        return self.tokens[p]


def _token_of(state: bytes) -> int:
    """The token sampled from a state: Sequence.token's rule (the state after
    tokens [0, p] is Sequence.digest(p))."""
    return int.from_bytes(state[:2], "little") % 5000 + 10


WAITING, RUNNING, PREEMPTED, REMOTE, FINISHED = "WAITING", "RUNNING", "PREEMPTED", "WAITING_FOR_REMOTE_KVS", "FINISHED"


class Request:
    """vllm.v1.request.Request: the fields a connector reads."""

    def __init__(self, rid: str, prompt: list[int], max_tokens: int, hasher: "Hasher", seed: bytes,
                 kv_transfer_params: dict | None = None, skip_reading_prefix_cache: bool = False):
        self.request_id = rid
        self.seq = Sequence(prompt, seed)
        self.seq.salt = rid.encode()
        self.loaded_groups: tuple[int, ...] | None = None  # what the connector's load restores
        self.num_prompt_tokens = len(prompt)
        self.all_token_ids = list(prompt)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.status = WAITING
        self.kv_transfer_params = kv_transfer_params
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self._hasher = hasher
        self.local_computed = 0
        self.done_tokens = 0  # positions whose KV the engine computed or loaded
        self.drop_until = -1  # outputs of steps up to this one are stale (preempted)
        self.last_sched = -1
        self.finish_reason = ""
        hasher.update(self)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt

    def append(self, token: int) -> None:
        assert token == self.seq.token(self.num_tokens), "sampled token disagrees with the sequence"
        self.all_token_ids.append(token)
        self._hasher.update(self)


class Hasher:
    """vLLM's request block hasher: chained hashes every ``size`` tokens."""

    def __init__(self, size: int, nbytes: int, seed: str):
        self.size, self.nbytes = size, nbytes
        self.none = hashlib.sha256(b"NONE_HASH" + seed.encode()).digest()[:nbytes]

    def update(self, req: Request) -> None:
        while (len(req.block_hashes) + 1) * self.size <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else self.none
            toks = req.all_token_ids[i * self.size:(i + 1) * self.size]
            raw = parent + b"".join(t.to_bytes(4, "little") for t in toks)
            req.block_hashes.append(hashlib.sha256(raw).digest()[:self.nbytes])


# -- the engine's configuration --------------------------------------------------


@dataclass
class Group:
    kind: str = "full"  # "full", "swa", "mla" or "mamba" (vLLM's MambaManager, mamba_cache_mode)
    block_size: int = 4  # tokens per block on one rank
    layers: int = 2
    window: int = 0  # sliding window in tokens ("swa")
    eagle: bool = False  # EAGLE/MTP draft layers (vLLM's KVCacheGroupSpec.is_eagle_group)
    # vLLM never prefix-caches it (spec.prefix_cacheable=False): per-request
    # state (DeepSeek-V4.1's bounded replay window). Its KV differs per
    # request; after an external hit the engine rebuilds it for the loaded
    # tokens unless the connector says it loaded it (get_loaded_kv_cache_group_ids).
    # The stand-in's local prefix cache does not leave such groups out, as
    # vLLM's does: run them with prefix_caching=False.
    scratch: bool = False


@dataclass
class Config:
    groups: list[Group] = field(default_factory=lambda: [Group()])
    num_blocks: int = 64
    tp: int = 1
    pcp: int = 1  # prefill context parallel: each PCP rank holds its own KV
    dcp: int = 1
    kernel_block_size: int | None = None  # None: the block size
    layout: str = "HND"
    async_scheduling: bool = False
    max_batched_tokens: int = 64
    max_seqs: int = 8
    long_prefill: int = 0
    prefix_caching: bool = True
    prefix_match_unit: int | None = None
    policy: str = "recompute"
    hash_algo: str = "sha256"
    model: str = "standin/model"
    transfer_results: bool = True  # vLLM with request-level load failures
    failed_as_dict: bool = False  # failed_recving as {request id: failure} (newer vLLM's typed failures)
    worker_meta: bool = True
    old_preemptions: bool = False  # handle_preemptions(preempted_req_ids)
    # The worker's sender thread does not pick up a step's stores before the
    # next step's handle_preemptions has run (as under vLLM, whose step loop
    # keeps the GIL): a preempted request's stores of the step before are
    # then still queued, and dropped.
    sender_lags: bool = False
    # The GPU's share of a step: vLLM's engine loop waits on the device (and
    # so releases the GIL) for at least this long each step.
    gpu_s: float = 0.0005
    extra: dict = field(default_factory=dict)
    kv_events: bool = False  # vLLM's --kv-events-config enable_kv_cache_events
    # A freed block goes to the head of the free queue (vLLM appends it to
    # the tail): the next allocation takes it, so blocks freed behind a
    # sliding window, by a preemption or a finished request are handed to
    # another request while their stores may still be in flight.
    reuse_freed_first: bool = False
    # Remember, for every block a plan stores, whose KV it should hold
    # (Engine.check_stored reads them back from the daemon).
    record_stores: bool = False
    # Mamba groups: vLLM's cache_config.mamba_cache_mode; how the model runner
    # hands each Mamba layer to register_kv_caches ("page": one int8
    # (num_blocks, 1, 1, page) view, as vLLM's V1 runner at 7cfb97e;
    # "states": a conv and an SSM state tensor viewing one page per block);
    # further MambaSpec fields.
    mamba_mode: str = "align"
    mamba_tensors: str = "page"
    mamba_spec: dict = field(default_factory=dict)
    # vLLM's MultiConnector with these children in this order ("nixl": a
    # NixlConnector-like sibling, "ours": KVOffloadConnector); () for ours alone.
    multi: tuple = ()
    sleep_mode: bool = False  # vLLM's --enable-sleep-mode (model_config.enable_sleep_mode)
    # The model runner's connector calls: "v1" (7cfb97e: start_load_kv before
    # the forward), "deferred" (#53333: on a step without synchronous loads
    # start_load_kv runs after the forward is launched), "mrv2" (V2 runner's
    # gpu/kv_connector.py at 00f4240: deferred, and finish_forward once the
    # forward no longer reads the step's KV).
    runner: str = "v1"

    def specs(self) -> list[Any]:
        out = []
        for g in self.groups:
            if g.kind == "mamba":
                out.append(sv.MambaSpec(g.block_size, mamba_cache_mode=self.mamba_mode, **self.mamba_spec))
            elif g.kind == "swa":
                out.append(sv.SlidingWindowSpec(g.block_size, g.window, num_kv_heads=H, head_size=D))
            elif g.kind == "mla":
                out.append(sv.MLAAttentionSpec(g.block_size, num_kv_heads=1, head_size=DM))
            else:
                out.append(sv.FullAttentionSpec(g.block_size, num_kv_heads=H, head_size=D))
            out[-1].prefix_cacheable = not g.scratch
        return out


def vllm_config(cfg: Config, socket: str) -> SimpleNamespace:
    ns = SimpleNamespace
    return ns(
        # vLLM's VllmConfig.instance_id: random per config (the workers get it pickled).
        instance_id=secrets.token_hex(3),
        model_config=ns(model=cfg.model, revision="main", dtype="bfloat16", quantization=None, hf_overrides=None,
                        use_mla=any(g.kind == "mla" for g in cfg.groups), enable_sleep_mode=cfg.sleep_mode),
        cache_config=ns(block_size=min(g.block_size for g in cfg.groups), cache_dtype="auto",
                        prefix_caching_hash_algo=cfg.hash_algo, enable_prefix_caching=cfg.prefix_caching,
                        prefix_match_unit=cfg.prefix_match_unit, calculate_kv_scales=False,
                        mamba_cache_mode=cfg.mamba_mode),
        parallel_config=ns(tensor_parallel_size=cfg.tp, pipeline_parallel_size=1, decode_context_parallel_size=cfg.dcp,
                           prefill_context_parallel_size=cfg.pcp),
        scheduler_config=ns(async_scheduling=cfg.async_scheduling),
        kv_events_config=ns(enable_kv_cache_events=cfg.kv_events, publisher="zmq" if cfg.kv_events else "null"),
        kv_transfer_config=(
            standin_multi.multi_transfer_config(
                {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.vllm",
                 "kv_role": "kv_both", "kv_connector_extra_config": {"socket": socket, **cfg.extra},
                 "kv_load_failure_policy": cfg.policy}, cfg.multi, engine_id="standin")
            if cfg.multi else
            ns(kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.vllm",
               kv_role="kv_both", kv_connector_extra_config={"socket": socket, **cfg.extra},
               kv_load_failure_policy=cfg.policy, is_kv_producer=True, is_kv_consumer=True,
               engine_id="standin")),
    )


def kv_cache_config(cfg: Config) -> SimpleNamespace:
    return SimpleNamespace(
        num_blocks=cfg.num_blocks,
        prefix_cacheable_group_ids=tuple(g for g, grp in enumerate(cfg.groups) if not grp.scratch),
        kv_cache_groups=[SimpleNamespace(layer_names=[f"g{g}.l{i}" for i in range(grp.layers)], kv_cache_spec=spec,
                                         is_eagle_group=grp.eagle)
                         for g, (grp, spec) in enumerate(zip(cfg.groups, cfg.specs()))],
    )


# -- one rank's KV memory -------------------------------------------------------


class RankMemory:
    """One worker's KV tensors in one /dev/shm file, shaped like vLLM's
    backends lay them out: per layer, (2, K, kbs, H, D) for attention (NHD or
    HND physical order), (K, kbs, DM) for MLA, with K = num_blocks * r
    kernel blocks of kbs = block_size / r tokens."""

    def __init__(self, shm_factory, cfg: Config, rank: int):
        self.cfg, self.rank = cfg, rank
        self.weights = 0  # the model's weights version: a weight update changes every token's KV
        self.layers: list[tuple[int, int, str, int, tuple, tuple]] = []  # (group, layer, name, base, shape, strides)
        geo = []
        off = 0
        for g, grp in enumerate(cfg.groups):
            kbs = cfg.kernel_block_size or grp.block_size
            if grp.block_size % kbs:
                kbs = grp.block_size
            r = grp.block_size // kbs
            K = cfg.num_blocks * r
            for li in range(grp.layers):
                if grp.kind == "mamba":
                    P = cfg.specs()[g].page_size_bytes
                    geo.append((g, li, f"g{g}.l{li}", off, (cfg.num_blocks, P), (P, 1)))
                    off += cfg.num_blocks * P
                    continue
                if grp.kind == "mla":
                    shape = (K, kbs, DM)
                    strides = (kbs * DM, DM, 1)
                    size = K * kbs * DM * E
                elif cfg.layout == "NHD":
                    shape = (2, K, kbs, H, D)
                    strides = (K * kbs * H * D, kbs * H * D, H * D, D, 1)
                    size = 2 * K * kbs * H * D * E
                else:  # HND: heads outermost within a kernel block
                    shape = (2, K, kbs, H, D)
                    strides = (K * H * kbs * D, H * kbs * D, D, kbs * D, 1)
                    size = 2 * K * kbs * H * D * E
                geo.append((g, li, f"g{g}.l{li}", off, shape, strides))
                off += size
        self.shm = shm_factory(off)
        self.layers = geo
        self.kv_caches = {name: FakeTensor(self.shm.address + base, shape, strides, element_size=E)
                          if cfg.groups[g].kind != "mamba" else self._mamba_tensors(base, cfg.specs()[g])
                          for g, _, name, base, shape, strides in geo}

    # -- Mamba state (align mode): one page of state per block and layer --------

    def _mamba_tensors(self, base: int, spec: Any) -> Any:
        """What vLLM's model runner hands register_kv_caches for one Mamba layer."""
        NB, P, addr = self.cfg.num_blocks, spec.page_size_bytes, self.shm.address + base
        if self.cfg.mamba_tensors == "page":
            return FakeTensor(addr, (NB, 1, 1, P), (P, P, P, 1), element_size=1)
        out, off = [], 0
        for shape, dtype in zip(spec.shapes, spec.dtypes):
            es = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
            inner = [math.prod(shape[i + 1:]) for i in range(len(shape))]
            out.append(FakeTensor(addr + off, (NB, *shape), (P // es, *inner), element_size=es))
            off += math.prod(shape) * es
        return out

    def _mamba_page(self, g: int, li: int, state: bytes) -> bytes:
        P = self.layers[self._index(g, li)][4][1]
        tag = bytes([(self.rank * 31 + g * 7 + li * 3 + self.weights * 101) & 0xFF])
        raw = state + tag * 8
        return (raw * (P // len(raw) + 1))[:P]

    def mamba_write(self, g: int, block_id: int, state: bytes) -> None:
        for li in range(self.cfg.groups[g].layers):
            _, _, _, base, (_, P), _ = self.layers[self._index(g, li)]
            off = base + block_id * P
            self.shm.buf[off:off + P] = self._mamba_page(g, li, state)

    def mamba_read(self, g: int, block_id: int) -> bytes:
        """The state a forward starts from: what the block holds (layer 0)."""
        _, _, _, base, (_, P), _ = self.layers[self._index(g, 0)]
        off = base + block_id * P
        return bytes(self.shm.buf[off:off + 8])

    def mamba_check(self, g: int, block_id: int, state: bytes) -> bool:
        for li in range(self.cfg.groups[g].layers):
            _, _, _, base, (_, P), _ = self.layers[self._index(g, li)]
            off = base + block_id * P
            if bytes(self.shm.buf[off:off + P]) != self._mamba_page(g, li, state):
                return False
        return True

    def _slots(self, g: int, p: int) -> tuple[int, int] | None:
        """(rank-block index within the scheduler block, slot) of position p on
        this rank, or None when another DCP rank holds p."""
        cfg = self.cfg
        grp = cfg.groups[g]
        dcp = cfg.dcp if grp.kind != "swa" else 1
        if dcp > 1 and p % dcp != self.rank % dcp:
            return None
        bv = grp.block_size * dcp
        return p // bv, (p % bv) // dcp

    def _runs(self, g: int, li: int, block: int, slot: int, content: bytes):
        """(byte offset, bytes) runs of one token's K and V (or MLA latent)."""
        grp = self.cfg.groups[g]
        _, _, _, base, shape, strides = self.layers[self._index(g, li)]
        kbs = shape[-2] if grp.kind == "mla" else shape[2]
        r = grp.block_size // kbs
        kb, ks = block * r + slot // kbs, slot % kbs
        if grp.kind == "mla":
            yield base + (kb * strides[0] + ks * strides[1]) * E, content[: DM * E]
            return
        for kv in range(2):
            tag = bytes([kv])
            for h in range(H):
                el = kv * strides[0] + kb * strides[1] + ks * strides[2] + h * strides[3]
                chunk = content[h * D * E:(h + 1) * D * E]
                yield base + el * E, bytes(a ^ tag[0] for a in chunk) if kv else chunk

    def _index(self, g: int, li: int) -> int:
        i = 0
        for gg, grp in enumerate(self.cfg.groups):
            if gg == g:
                return i + li
            i += grp.layers
        raise IndexError(g)

    def content(self, seq: Sequence, p: int, g: int, li: int) -> bytes:
        tag = bytes([(self.rank * 31 + g * 7 + li * 3 + self.weights * 101) & 0xFF])
        d = seq.digest(p)
        if self.cfg.groups[g].scratch:
            d = hashlib.blake2b(d + seq.salt, digest_size=8).digest()
        raw = (d + tag * 8)
        return (raw * ((H * D * E) // len(raw) + 2))[: max(H * D * E, DM * E)]

    def write(self, seq: Sequence, p: int, g: int, block_id: int) -> None:
        sl = self._slots(g, p)
        if sl is None:
            return
        for li in range(self.cfg.groups[g].layers):
            for off, data in self._runs(g, li, block_id, sl[1], self.content(seq, p, g, li)):
                self.shm.buf[off:off + len(data)] = data

    def check(self, seq: Sequence, p: int, g: int, block_id: int) -> bool:
        sl = self._slots(g, p)
        if sl is None:
            return True
        for li in range(self.cfg.groups[g].layers):
            for off, data in self._runs(g, li, block_id, sl[1], self.content(seq, p, g, li)):
                if bytes(self.shm.buf[off:off + len(data)]) != data:
                    return False
        return True


# -- the block pool and KV cache manager ------------------------------------------


class KVCacheBlock:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash: tuple | None = None
        self.is_null = block_id == 0


class KVCacheBlocks:
    def __init__(self, blocks: tuple[list[KVCacheBlock], ...]):
        self.blocks = blocks

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g] for g in self.blocks)


class KVCacheManager:
    """One pool of blocks for every group, vLLM's null block 0, an LRU free
    queue whose blocks keep their hash until reused (the local prefix cache)."""

    def __init__(self, cfg: Config, group_sizes: list[int], hash_size: int, unit: int):
        self.cfg = cfg
        self.group_sizes = group_sizes  # tokens per scheduler block, per group
        self.factors = [s // hash_size for s in group_sizes]
        self.unit = unit
        self.pool = [KVCacheBlock(i) for i in range(cfg.num_blocks)]
        self.null = self.pool[0]
        self.free: deque[KVCacheBlock] = deque(self.pool[1:])
        self.cached: dict[tuple, KVCacheBlock] = {}
        self.tables: dict[str, list[list[KVCacheBlock]]] = {}
        self.mamba = [g.kind == "mamba" for g in cfg.groups]
        # Mamba blocks cached in this step: their state is written by this
        # step's forward, so no other request may start from it before the
        # next (vLLM's MambaManager.cached_blocks_this_step).
        self.cached_this_step: set[tuple] = set()

    def _key(self, req: Request, g: int, i: int) -> tuple | None:
        n = (i + 1) * self.factors[g]
        return (g, req.block_hashes[n - 1]) if len(req.block_hashes) >= n else None

    def get_blocks(self, rid: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(self.tables.get(rid, [[] for _ in self.group_sizes])))

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return self.get_blocks(rid).get_block_ids()

    def get_computed_blocks(self, req: Request) -> tuple[list[list[KVCacheBlock]], int]:
        if not self.cfg.prefix_caching or req.skip_reading_prefix_cache:
            return [[] for _ in self.group_sizes], 0
        max_units = (req.num_tokens - 1) // self.unit
        units = 0
        while units < max_units:
            ok = True
            for g, s in enumerate(self.group_sizes):
                if self.mamba[g]:
                    continue
                per = self.unit // s
                for i in range(units * per, (units + 1) * per):
                    k = self._key(req, g, i)
                    if k is None or k not in self.cached:
                        ok = False
            if not ok:
                break
            units += 1
        units = self._mamba_hit_units(req, units)
        hit = [[self.cached[self._key(req, g, i)] for i in range(units * (self.unit // s))]
               if not self.mamba[g] else self._mamba_hit_blocks(req, g, units)
               for g, s in enumerate(self.group_sizes)]
        return hit, units * self.unit

    # -- Mamba groups in align mode (vLLM's MambaManager at 7cfb97e) -------------

    def _mamba_state_key(self, req: Request, g: int, units: int) -> tuple | None:
        return self._key(req, g, units * (self.unit // self.group_sizes[g]) - 1)

    def _mamba_hit_units(self, req: Request, units: int) -> int:
        """find_longest_cache_hit: the longest hit of at most ``units`` whose
        end state is cached in every Mamba group (right to left)."""
        if not any(self.mamba):
            return units
        while units > 0:
            keys = [self._mamba_state_key(req, g, units) for g in range(len(self.group_sizes)) if self.mamba[g]]
            if all(k is not None and k in self.cached and k not in self.cached_this_step for k in keys):
                return units
            units -= 1
        return 0

    def _mamba_hit_blocks(self, req: Request, g: int, units: int) -> list[KVCacheBlock]:
        """The hit of a Mamba group: null blocks, then the state block at its end."""
        if units <= 0:
            return []
        n = units * (self.unit // self.group_sizes[g])
        return [self.null] * (n - 1) + [self.cached[self._mamba_state_key(req, g, units)]]

    def _mamba_new(self, table_g: list, total: int, bs: int) -> list:
        """allocate_new_blocks in align mode (no speculative blocks): nulls up
        to the block that will hold the running state at ``total``, then one
        new block (None here)."""
        required = -(-total // bs)
        if required <= len(table_g):
            return []
        return [self.null] * (required - 1 - len(table_g)) + [None]

    def _mamba_free(self, req: Request, processed: int) -> None:
        """remove_skipped_blocks: a Mamba group keeps only the state of the last
        processed token (get_num_skipped_tokens = processed - 1); earlier state
        blocks go back to the pool and are reused while the request runs."""
        table = self.tables.get(req.request_id)
        if table is None or processed <= 0:
            return
        freed = []
        for g, s in enumerate(self.group_sizes):
            if not self.mamba[g]:
                continue
            for i in range(min((processed - 1) // s, len(table[g]))):
                if not table[g][i].is_null:
                    freed.append(table[g][i])
                    table[g][i] = self.null
        self._release(freed)

    def mamba_state_live(self, req: Request) -> bool:
        """Whether every Mamba group still holds the state at the request's
        computed tokens (a recompute can start from it)."""
        table = self.tables.get(req.request_id)
        n = req.num_computed_tokens
        if n <= 0 or not any(self.mamba):
            return True
        for g, s in enumerate(self.group_sizes):
            if self.mamba[g] and (table is None or len(table[g]) < -(-n // s) or table[g][-(-n // s) - 1].is_null):
                return False
        return True

    def _skip(self, g: int, i: int, computed: int) -> bool:
        grp = self.cfg.groups[g]
        return grp.kind == "swa" and (i + 1) * self.group_sizes[g] <= computed - grp.window

    def allocate_slots(self, req: Request, num_new: int, computed_blocks: list | None = None,
                       num_local: int = 0, num_external: int = 0, delay_cache: bool = False,
                       reserved: int = 0) -> KVCacheBlocks | None:
        rid = req.request_id
        table = self.tables.get(rid)
        fresh_table = table is None
        if table is None:
            table = [list(b) for b in (computed_blocks or [[] for _ in self.group_sizes])]
        computed = req.num_computed_tokens if not fresh_table else num_local + num_external
        total = computed + num_new
        if not fresh_table:
            self._mamba_free(req, min(computed, req.done_tokens))
        elif num_external > 0:
            for g, s in enumerate(self.group_sizes):
                if self.mamba[g]:
                    # add_local_computed_blocks drops the local hit below the
                    # last computed token; allocate_external_computed_blocks
                    # gives the state block at the external hit's end.
                    skipped = (computed - 1) // s
                    table[g] = [self.null] * skipped + table[g][skipped:]
                    table[g] += [None] * max(0, -(-computed // s) - len(table[g]))
        mamba_new = {g: self._mamba_new(table[g], total, s) for g, s in enumerate(self.group_sizes) if self.mamba[g]}
        need = sum(1 for g, t in enumerate(table) if self.mamba[g] for b in t if b is None)
        need += sum(1 for new in mamba_new.values() for b in new if b is None)
        for g, s in enumerate(self.group_sizes):
            if self.mamba[g]:
                continue
            for i in range(len(table[g]), -(-total // s)):
                if not self._skip(g, i, computed):
                    need += 1
        touch = [b for grp in (computed_blocks or []) for b in grp if b.ref_cnt == 0] if fresh_table else []
        if need + reserved > len(self.free) - sum(1 for b in touch if b in self.free):
            return None
        if fresh_table:
            for grp in table:
                for b in grp:
                    if b is None:
                        continue
                    if b.ref_cnt == 0 and b in self.free:
                        self.free.remove(b)
                    b.ref_cnt += 1
            self.tables[rid] = table
        new: list[list[KVCacheBlock]] = [[] for _ in self.group_sizes]
        for g, s in enumerate(self.group_sizes):
            if self.mamba[g]:
                table[g] = [self._take() if b is None else b for b in table[g]]
                for b in mamba_new[g]:
                    table[g].append(self._take() if b is None else b)
                if fresh_table:
                    new[g] = list(table[g])
                else:
                    new[g] = table[g][len(table[g]) - len(mamba_new[g]):]
                continue
            for i in range(len(table[g]), -(-total // s)):
                if self._skip(g, i, computed):
                    b = self.null
                else:
                    b = self.free.popleft()
                    if b.hash is not None:
                        self.cached.pop(b.hash, None)
                        b.hash = None
                    b.ref_cnt += 1
                table[g].append(b)
                new[g].append(b)
        self.remove_skipped(req, computed)
        if not delay_cache:
            self.cache_blocks(req, total)
        return KVCacheBlocks(tuple(new))

    def _take(self) -> KVCacheBlock:
        b = self.free.popleft()
        if b.hash is not None:
            self.cached.pop(b.hash, None)
            b.hash = None
        b.ref_cnt += 1
        return b

    def remove_skipped(self, req: Request, computed: int) -> list[KVCacheBlock]:
        table = self.tables.get(req.request_id)
        freed = []
        if table is None:
            return freed
        for g in range(len(self.group_sizes)):
            for i, b in enumerate(table[g]):
                if not b.is_null and self._skip(g, i, computed):
                    table[g][i] = self.null
                    freed.append(b)
        self._release(freed)
        return freed

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        table = self.tables.get(req.request_id)
        if table is None or not self.cfg.prefix_caching:
            return
        for g, s in enumerate(self.group_sizes):
            for i in range(min(num_tokens, req.num_tokens) // s):
                if i >= len(table[g]):
                    break
                b = table[g][i]
                k = self._key(req, g, i)
                if b.is_null or b.hash is not None or k is None or k in self.cached:
                    continue
                b.hash = k
                self.cached[k] = b
                if self.mamba[g]:
                    self.cached_this_step.add(k)

    def uncache(self, blocks: list[KVCacheBlock]) -> None:
        for b in blocks:
            if b.hash is not None:
                self.cached.pop(b.hash, None)
                b.hash = None

    def pop_for_free(self, rid: str) -> list[KVCacheBlock]:
        table = self.tables.pop(rid, None)
        if not table:
            return []
        return [b for grp in table for b in reversed(grp) if not b.is_null]

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0
            if b.ref_cnt == 0:
                if self.cfg.reuse_freed_first:
                    self.free.appendleft(b)
                else:
                    self.free.append(b)


# -- scheduler output -----------------------------------------------------------


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    seq: int
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None
    samples: set[str] = field(default_factory=set)  # requests whose step samples a token


@dataclass
class KVConnectorOutput:
    finished_sending: set | None = None
    finished_recving: set | None = None
    failed_recving: set = field(default_factory=set)
    invalid_block_ids: set = field(default_factory=set)
    kv_connector_worker_meta: Any = None
    kv_connector_stats: Any = None


class EngineCrash(RuntimeError):
    """What would have killed vLLM's engine core."""


# -- the engine -----------------------------------------------------------------


class Engine:
    """One scheduler and ``cfg.tp`` workers, each with its connector."""

    def __init__(self, cfg: Config, mod: Any, socket: str, shm_factory, *, seed: str = "0", timing: bool = True):
        self.cfg = cfg
        vcfg = vllm_config(cfg, socket)
        kcc = kv_cache_config(cfg)
        sched_bs, hash_bs = sv.resolve_kv_cache_block_sizes(kcc, vcfg)
        self.hash_block_size = hash_bs
        self.block_size = sched_bs
        self.group_sizes = [g.block_size * (cfg.dcp if g.kind not in ("swa", "mamba") else 1) for g in cfg.groups]
        self.hasher = Hasher(hash_bs, 16 if cfg.hash_algo.startswith("xxhash") else 32, seed)
        self.seed = hashlib.sha256(seed.encode()).digest()[:8]
        self.kvm = KVCacheManager(cfg, self.group_sizes, hash_bs, sched_bs)
        Role = sv.KVConnectorRole
        # vLLM's KVConnectorFactory.create_connector: the configured class
        # (MultiConnector from the registry; ours by its module path).
        if cfg.multi:
            standin_multi.register_builtins()
            connector_cls = standin_multi.factory().get_connector_class(vcfg.kv_transfer_config)
        else:
            connector_cls = mod.KVOffloadConnector
        # The API server's stats logging (where the factory is installed).
        self.stats_logging = (standin_multi.KVConnectorLogging(vcfg.kv_transfer_config)
                              if standin_multi.FACTORY in sys.modules else None)
        self.workers: list[Any] = []
        self.memory: list[RankMemory] = []
        for r in range(cfg.tp * cfg.pcp):
            sv.set_rank(tp=r % cfg.tp, pcp=r // cfg.tp, dcp=(r % cfg.tp) % cfg.dcp)
            w = connector_cls(vcfg, Role.WORKER, kcc)
            mem = RankMemory(shm_factory, cfg, r)
            w.register_kv_caches(mem.kv_caches)
            self.workers.append(w)
            self.memory.append(mem)
        sv.set_rank()
        # vLLM's EngineCore registers the workers' KV caches
        # (_initialize_kv_caches) before it builds the scheduler.
        self.sched_conn = connector_cls(vcfg, Role.SCHEDULER, kcc)
        # vLLM's gpu_worker returns {(pp_rank, tp_rank): metadata} and
        # EngineCore merges the workers' dicts with dict.update: prefill
        # context parallel ranks of one tp rank overwrite each other.
        hs: dict = {}
        for r, w in enumerate(self.workers):
            md = w.get_handshake_metadata()
            if md is not None:
                hs.update({(0, r % cfg.tp): md})
        if hs:
            self.sched_conn.set_xfer_handshake_metadata_pp_aware(hs)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.skipped: deque[Request] = deque()  # vLLM's skipped_waiting
        self.running: list[Request] = []
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.finished_ids: set[str] = set()
        self.deferred: deque[tuple[int, list[KVCacheBlock]]] = deque()
        self.step_seq = 0
        self.processed_seq = 0
        self.in_flight: deque[tuple[SchedulerOutput, Any]] = deque()
        self.reset_preempted: set[str] = set()  # preempted by reset_prefix_cache, told in the next step
        self._held: dict[int, Any] = {}  # rank -> its WorkerSide whose lock this thread holds (cfg.sender_lags)
        self.paused = False  # vLLM's pause_generation: no waiting request is admitted
        self.worker_tables: list[dict[str, list[list[int]]]] = [{} for _ in range(cfg.tp * cfg.pcp)]
        self.worker_seqs: dict[str, Sequence] = {}
        self.timing = timing
        self.step_conn_s: list[float] = []
        self._sched_t = 0.0
        self.kv_events: list = []  # what the connector's take_events handed to vLLM's publisher, in order
        self.planned_keys: set[tuple[int, bytes]] = set()  # (group, key) of every store or load planned
        # cfg.record_stores: (group, key) -> (sequence, block index, weights) of every block a plan stored
        self.stored: dict[tuple[int, bytes], tuple[Sequence, int, int]] = {}
        self.admit_waits: list[tuple[bool, int, float]] = []  # (hit, steps, ms) from arrival to admission
        self.admitted: dict[str, tuple[bool, int]] = {}  # request -> (hit, steps from arrival to admission)
        self.lookup_call_s: list[float] = []  # each get_num_new_matched_tokens call's time
        self.deferred_rids: set[str] = set()  # requests the connector answered None at least once
        self.none_answers: dict[str, int] = {}  # request -> how many times (steps it waited for the connector)
        self.counters = {"finished": 0, "errored": 0, "aborted": 0, "preempted": 0, "hit_tokens": 0,
                         "deferred_lookups": 0, "deferred_loads": 0, "positions_checked": 0, "loads_finished": 0, "load_failures": 0}

    # -- helpers --------------------------------------------------------------

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._sched_t += time.perf_counter() - t0

    def max_model_len(self) -> int:
        """The longest request that fits in half the pool (vLLM refuses
        requests longer than its max_model_len)."""
        per_token = sum(1 / s for s in self.group_sizes)
        return int((self.cfg.num_blocks - 1) / 2 / per_token) - max(self.group_sizes)

    def add_request(self, rid: str, prompt: list[int], max_tokens: int, **kw) -> Request:
        if len(prompt) + max_tokens > self.max_model_len():
            raise ValueError(f"{rid}: {len(prompt) + max_tokens} tokens exceed max_model_len {self.max_model_len()}")
        req = Request(rid, prompt, max_tokens, self.hasher, self.seed, **kw)
        req.arrived = (self.step_seq, time.perf_counter())
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def _free_blocks(self, req: Request) -> None:
        blocks = self.kvm.pop_for_free(req.request_id)
        if self.cfg.async_scheduling and req.last_sched > self.processed_seq:
            self.deferred.append((self.step_seq, blocks))
        else:
            self.kvm._release(blocks)

    def _finish(self, req: Request, reason: str) -> None:
        """vLLM's _free_request: the connector decides whether blocks wait."""
        was_remote = req.status == REMOTE
        req.status, req.finish_reason = FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        for q in (self.waiting, self.skipped):
            if req in q:
                q.remove(req)
        delay = was_remote and req.request_id not in self.finished_recving
        self.finished_recving.discard(req.request_id)
        self.failed_recving.discard(req.request_id)
        block_ids = self.kvm.get_block_ids(req.request_id)
        d, _ = self._timed(self.sched_conn.request_finished_all_groups, req, block_ids)
        self.finished_ids.add(req.request_id)
        if not (d or delay):
            self._free_blocks(req)
            del self.requests[req.request_id]
        self.counters["errored" if reason == "error" else "aborted" if reason == "abort" else "finished"] += 1

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None and req.status != FINISHED:
            self._finish(req, "abort")

    def _preempt(self, req: Request) -> None:
        self._free_blocks(req)
        req.status = PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.done_tokens = 0
        req.drop_until = self.step_seq
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.counters["preempted"] += 1

    # -- the scheduler -------------------------------------------------------

    def _mamba_split(self, req: Request, start: int, n: int) -> int:
        """vLLM's _mamba_block_aligned_split (scheduler.py:374 at 7cfb97e,
        without EAGLE, partial tails or shared-prefix junctions): a prefill
        chunk ends on a block boundary of the Mamba groups (where their
        state is committed), except the prompt's last chunk, and never runs
        past the last block boundary of the request's tokens."""
        bss = [s for g, s in enumerate(self.group_sizes) if self.kvm.mamba[g]]
        if not bss or n <= 0:
            return n
        bs = bss[0]
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if start >= prefill_end:
            return n
        last_cache = req.num_tokens - req.num_tokens % bs
        end = start + n
        if end < prefill_end:
            limit = min(self.cfg.max_batched_tokens, self.cfg.long_prefill or self.cfg.max_batched_tokens)
            aligned = end // bs * bs
            if aligned > start or bs <= limit:
                end = aligned
        stops = ((start // bs + 1) * bs if start % bs else 0, last_cache)
        end = min((x for x in stops if start < x < end), default=end)
        return max(end - start, 0)

    def schedule(self) -> SchedulerOutput:
        self.step_seq += 1
        self.kvm.cached_this_step.clear()
        cfg = self.cfg
        out = SchedulerOutput(seq=self.step_seq)
        budget = cfg.max_batched_tokens
        new_blocks: dict[str, KVCacheBlocks] = {}
        preempted: list[Request] = []
        resumed: list[Request] = []
        running_sched: list[Request] = []
        new_sched: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            end = req.num_prompt_tokens + req.max_tokens - 1
            n = min(req.num_tokens + req.num_output_placeholders, end) - req.num_computed_tokens
            if cfg.long_prefill:
                n = min(n, cfg.long_prefill)
            n = min(n, budget)
            n = self._mamba_split(req, req.num_computed_tokens, n)
            if n <= 0:
                i += 1
                continue
            blocks = None
            while True:
                blocks = self.kvm.allocate_slots(req, n)
                if blocks is not None:
                    break
                victim = self.running.pop()
                if victim in running_sched:
                    running_sched.remove(victim)
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
                    new_blocks.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if blocks is None:
                break
            running_sched.append(req)
            new_blocks[req.request_id] = blocks
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n
            i += 1
        if not preempted and not self.paused:
            # vLLM's two queues (FCFS): blocked or deferred requests
            # (skipped_waiting) go first, then the waiting queue.
            step_skipped: list[Request] = []
            while (self.skipped or self.waiting) and budget > 0 and len(self.running) < cfg.max_seqs:
                queue = self.skipped if self.skipped else self.waiting
                req = queue[0]
                rid = req.request_id
                if req.status == REMOTE:
                    if rid not in self.finished_recving:
                        step_skipped.append(queue.popleft())
                        continue
                    self._update_waiting_for_remote_kv(req)
                ext, load_async, local_blocks, local = 0, False, None, 0
                if req.num_computed_tokens == 0:
                    local_blocks, local = self.kvm.get_computed_blocks(req)
                    t0 = time.perf_counter()
                    ext, load_async = self._timed(self.sched_conn.get_num_new_matched_tokens, req, local)
                    self.lookup_call_s.append(time.perf_counter() - t0)
                    if ext is None:
                        self.deferred_rids.add(rid)
                        self.none_answers[rid] = self.none_answers.get(rid, 0) + 1
                        self.counters["deferred_lookups"] += 1
                        step_skipped.append(queue.popleft())
                        continue
                    assert ext % self.block_size == 0 and local + ext < req.num_tokens, (local, ext, req.num_tokens)
                    computed = local + ext
                else:
                    computed = req.num_computed_tokens
                if load_async:
                    n = 0
                else:
                    n = req.num_tokens - computed
                    if cfg.long_prefill:
                        n = min(n, cfg.long_prefill)
                    n = min(n, budget)
                    n = self._mamba_split(req, computed, n)
                    if n <= 0:
                        break
                # An async load holds its blocks with no progress: admit it
                # only if the in-flight prefills can still finish (vLLM's
                # _inflight_prefill_reserved_blocks), or loads deadlock.
                reserved = self._reserved_blocks() if load_async else 0
                blocks = self.kvm.allocate_slots(req, n, local_blocks, local, ext, delay_cache=load_async,
                                                 reserved=reserved)
                if blocks is None and load_async and self.skipped and queue is self.skipped:
                    # The reservation keeps this load out; the loads it
                    # reserves for may be finished behind it in the queue:
                    # let them go first, or nothing is ever scheduled.
                    self.counters["deferred_loads"] += 1
                    step_skipped.append(queue.popleft())
                    continue
                if blocks is None:
                    break
                self._timed(self.sched_conn.update_state_after_alloc, req, self.kvm.get_blocks(rid), ext)
                if ext > 0:
                    # Newer vLLM: the groups the load restores (the base
                    # class says the prefix-cacheable ones); the others it
                    # rebuilds itself once the load is done.
                    get = getattr(self.sched_conn, "get_loaded_kv_cache_group_ids", None)
                    req.loaded_groups = tuple(get(req)) if get is not None else tuple(range(len(cfg.groups)))
                queue.popleft()
                if local_blocks is not None:
                    req.local_computed = local
                    self.counters["hit_tokens"] += ext
                    if ext and hasattr(self.sched_conn, "get_external_cache_hit_sources"):
                        # vLLM's prefix cache stats by source
                        for src, n in self.sched_conn.get_external_cache_hit_sources(req, ext).items():
                            key = f"hit_{src.value}"
                            self.counters[key] = self.counters.get(key, 0) + n
                    if req.num_preemptions == 0 and getattr(req, "arrived", None) is not None:
                        s0, t0 = req.arrived
                        self.admit_waits.append((ext > 0, self.step_seq - 1 - s0, (time.perf_counter() - t0) * 1000))
                        self.admitted[rid] = (ext > 0, self.step_seq - 1 - s0)
                        req.arrived = None
                if load_async:
                    req.status = REMOTE
                    req.num_computed_tokens = computed
                    req.last_sched = self.step_seq
                    step_skipped.append(req)
                    continue
                (resumed if req.status == PREEMPTED else new_sched).append(req)
                req.status = RUNNING
                req.num_computed_tokens = computed
                self.running.append(req)
                new_blocks[rid] = blocks
                out.num_scheduled_tokens[rid] = n
                budget -= n
            self.skipped.extendleft(reversed(step_skipped))
        for req in new_sched:
            out.scheduled_new_reqs.append(NewRequestData(req.request_id, list(req.seq.prompt),
                                                         self.kvm.get_block_ids(req.request_id), req.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for req in running_sched + resumed:
            cached.req_ids.append(req.request_id)
            if req in resumed:
                cached.resumed_req_ids.add(req.request_id)
                cached.new_block_ids.append(self.kvm.get_block_ids(req.request_id))
            else:
                cached.new_block_ids.append(new_blocks[req.request_id].get_block_ids())
            cached.num_computed_tokens.append(req.num_computed_tokens)
        out.preempted_req_ids = {r.request_id for r in preempted} | self.reset_preempted
        self.reset_preempted = set()
        out.finished_req_ids, self.finished_ids = self.finished_ids, set()
        out.kv_connector_metadata = self._timed(self.sched_conn.build_connector_meta, out)
        plan = getattr(out.kv_connector_metadata, "plan", None)
        if self.cfg.record_stores and plan is not None:
            for rid, jobs in plan.stores.items():
                req = self.requests[rid]
                for j in jobs:
                    f = self.group_sizes[j.group] // self.hash_block_size
                    for h in j.hashes:
                        i = (req.block_hashes.index(h) + 1) // f - 1
                        self.stored[(j.group, bytes(h))] = (req.seq, i, self.memory[0].weights)
        if (self.cfg.kv_events or self.cfg.record_stores) and plan is not None:
            for jobs in list(plan.stores.values()) + list(plan.loads.values()):
                for j in jobs:
                    self.planned_keys.update((j.group, bytes(h)) for h in j.hashes)
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            req.last_sched = self.step_seq
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1
                out.samples.add(rid)
        return out

    def _reserved_blocks(self) -> int:
        """Blocks the in-flight prefills (async loads, and running requests
        still in their prompt) need to reach the end of their prompt."""
        n = 0
        for r in self.requests.values():
            table = self.kvm.tables.get(r.request_id)
            if r.status == FINISHED or table is None or r.num_computed_tokens >= r.num_tokens:
                continue
            have = [len(g) for g in table] if table else [0] * len(self.group_sizes)
            n += sum(max(0, -(-r.num_tokens // s) - h) for s, h in zip(self.group_sizes, have))
        return n

    def _update_waiting_for_remote_kv(self, req: Request) -> None:
        rid = req.request_id
        if rid in self.failed_recving:
            if req.num_computed_tokens:
                self.kvm.cache_blocks(req, req.num_computed_tokens)
            else:
                self._free_blocks(req)
            self.failed_recving.discard(rid)
        else:
            self._rebuild_unloaded_groups(req)
            self.kvm.cache_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                req.num_computed_tokens -= 1
        req.done_tokens = req.num_computed_tokens
        self.finished_recving.discard(rid)
        req.status = PREEMPTED if req.num_preemptions else WAITING
        self.counters["loads_finished"] += 1

    def _rebuild_unloaded_groups(self, req: Request) -> None:
        """The groups a finished load did not restore (vLLM's replay of a
        per-request group): their KV of the loaded tokens is computed again,
        on every rank."""
        if req.loaded_groups is None:
            return
        table = self.kvm.tables.get(req.request_id) or []
        for g, s in enumerate(self.group_sizes):
            if g in req.loaded_groups or self.kvm.mamba[g] or g >= len(table):
                continue
            for p in range(req.local_computed, min(req.num_computed_tokens, len(table[g]) * s)):
                b = table[g][p // s]
                if not b.is_null:
                    for mem in self.memory:
                        mem.write(req.seq, p, g, b.block_id)
        req.loaded_groups = None

    def _update_requests_with_invalid_blocks(self, reqs, invalid: set[int], num_sched: dict[str, int]) -> set[str]:
        """vLLM's, single group as vLLM's is (it unpacks one group)."""
        affected = set()
        for req in reqs:
            (block_ids,) = self.kvm.get_block_ids(req.request_id)
            computed = req.num_computed_tokens - num_sched.get(req.request_id, 0)
            nblocks = -(-computed // self.block_size)
            for idx, bid in zip(range(nblocks), block_ids):
                if bid in invalid:
                    req.num_computed_tokens = idx * self.block_size
                    affected.add(req.request_id)
                    break
        return affected

    def update_from_output(self, out: SchedulerOutput, result: dict) -> None:
        self.processed_seq = out.seq
        while self.deferred and self.deferred[0][0] <= self.processed_seq:
            self.kvm._release(self.deferred.popleft()[1])
        kv: KVConnectorOutput = result["kv"]
        if self.stats_logging is not None and kv.kv_connector_stats is not None:
            # The engine core sends the stats' data to the API server, whose
            # output handler rebuilds them (an exception there fails every
            # request of `vllm serve`).
            self.stats_logging.observe(standin_multi.serialize_stats(kv.kv_connector_stats))
            if out.seq % 16 == 0:
                self.stats_logging.log()
        failed: set[str] = set()
        if kv.invalid_block_ids:
            self.counters["load_failures"] += 1
            if self.cfg.transfer_results and len(self.cfg.groups) > 1:
                raise EngineCrash("A KV connector reported block-level load failures (invalid_block_ids) on a "
                                  "layout with multiple KV cache groups")
            try:
                async_failed = self._update_requests_with_invalid_blocks(
                    [r for r in self.skipped if r.status == REMOTE], kv.invalid_block_ids, out.num_scheduled_tokens)
                sync_failed = self._update_requests_with_invalid_blocks(
                    self.running, kv.invalid_block_ids, out.num_scheduled_tokens)
            except ValueError as e:
                raise EngineCrash(f"scheduler: {e}") from e
            if self.cfg.policy == "fail":
                for rid in async_failed | sync_failed:
                    self._finish(self.requests[rid], "error")
            else:
                self.failed_recving |= async_failed
                failed = sync_failed
        for rid in kv.failed_recving or ():
            req = self.requests.get(rid)
            if req is None or req.status != REMOTE:
                continue
            self.counters["load_failures"] += 1
            if self.cfg.policy == "fail":
                self._finish(req, "error")
                continue
            req.num_computed_tokens = req.local_computed
            if not self.kvm.mamba_state_live(req):
                # The local hit's state block was dropped for the external hit
                # (add_local_computed_blocks): nothing to recompute from.
                req.num_computed_tokens = 0
            self.failed_recving.add(rid)
        live = []
        for rid in out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status == FINISHED or rid in failed or out.seq <= req.drop_until:
                continue
            req.done_tokens = max(req.done_tokens, min(req.num_computed_tokens, result["done"].get(rid, 0)))
            live.append(req)
        # The step ran: check every block before any request of it finishes.
        self.verify()
        for req in live:
            rid = req.request_id
            if rid in out.samples and result["sampled"][rid] != req.seq.token(req.num_tokens):
                self.counters["wrong_outputs"] = self.counters.get("wrong_outputs", 0) + 1
                raise WrongKV(f"request {rid}: sampled token {result['sampled'][rid]} at position {req.num_tokens}, "
                              f"a run without offloading samples {req.seq.token(req.num_tokens)}")
            if rid in out.samples:
                req.num_output_placeholders -= 1
                req.append(result["sampled"][rid])
                if req.num_tokens - req.num_prompt_tokens >= req.max_tokens:
                    self._finish(req, "length")
        self._timed(self.sched_conn.update_connector_output, kv)
        for rid in kv.finished_recving or ():
            req = self.requests[rid]
            if req.status == REMOTE:
                self.finished_recving.add(rid)
            else:
                assert req.status == FINISHED, (rid, req.status)
                self._free_blocks(req)
                del self.requests[rid]
        for rid in kv.finished_sending or ():
            req = self.requests[rid]
            assert req.status == FINISHED, (rid, req.status)
            self._free_blocks(req)
            del self.requests[rid]
        self.take_kv_events()

    def take_kv_events(self) -> None:
        """vLLM's update_from_output ends with this: the KV cache manager's
        events and the connector's ``take_events`` go to the publisher."""
        evs = self._timed(self.sched_conn.take_events) if hasattr(self.sched_conn, "take_events") else ()
        if evs:
            self.kv_events.extend(evs)

    # -- the workers ---------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> dict:
        """Every worker runs the step; their outputs are aggregated like vLLM's
        KVOutputAggregator (a request is finished once every rank says so)."""
        meta = pickle.loads(pickle.dumps(out.kv_connector_metadata))
        outs = []
        worst = 0.0
        sampled: dict[str, int] = {}
        done: dict[str, int] = {}
        for r, (w, mem) in enumerate(zip(self.workers, self.memory)):
            tables = self.worker_tables[r]
            t = 0.0
            t0 = time.perf_counter()
            # vLLM at 7cfb97e calls handle_preemptions(metadata) every step
            # before the forward (gpu_model_runner.py:4316-4319); older
            # vLLM called it with the ids, on preemptions only.
            if self.cfg.old_preemptions:
                if out.preempted_req_ids:
                    w.handle_preemptions(set(out.preempted_req_ids))
            else:
                w.handle_preemptions(meta)
            self._let_sender_run(r)
            w.bind_connector_metadata(meta)
            deferred = self.cfg.runner != "v1" and not getattr(out, "has_sync_kv_loads", False)
            if not deferred:
                w.start_load_kv(None)
            t += time.perf_counter() - t0
            for nr in out.scheduled_new_reqs:
                tables[nr.req_id] = [list(g) for g in nr.block_ids]
            c = out.scheduled_cached_reqs
            for rid, ids in zip(c.req_ids, c.new_block_ids):
                if rid in c.resumed_req_ids:
                    tables[rid] = [list(g) for g in ids]
                else:
                    for g, grp in enumerate(ids):
                        tables[rid][g].extend(grp)
            starts = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
            starts.update(zip(c.req_ids, c.num_computed_tokens))
            for nr in out.scheduled_new_reqs:
                # The worker's own copy of the request (vLLM's persistent
                # batch): it runs the step even if the scheduler has since
                # aborted the request.
                self.worker_seqs.setdefault(nr.req_id, Sequence(nr.prompt_token_ids, self.seed))
                self.worker_seqs[nr.req_id].salt = nr.req_id.encode()
            for rid, n in out.num_scheduled_tokens.items():
                seq = self.worker_seqs[rid]
                c0 = starts[rid]
                for p in range(c0, c0 + n):
                    for g, s in enumerate(self.group_sizes):
                        if not self.kvm.mamba[g]:
                            mem.write(seq, p, g, tables[rid][g][p // s])
                state = self._mamba_forward(mem, seq, tables[rid], c0, n)
                done[rid] = c0 + n
                if rid in out.samples:
                    # A model with Mamba layers samples from their state: a
                    # wrong or stale state is a wrong token.
                    sampled[rid] = seq.token(c0 + n) if state is None else _token_of(state)
            t0 = time.perf_counter()
            for layer in mem.kv_caches:
                w.wait_for_layer_load(layer)
                w.save_kv_layer(layer, mem.kv_caches[layer], None)
            if self.cfg.runner == "mrv2":
                w.finish_forward()
            if deferred:
                w.start_load_kv(None)
            w.wait_for_save()
            if self.cfg.sender_lags and getattr(w, "_worker", None) is not None and r not in self._held:
                w._worker._cv.acquire()  # the sender cannot take the queued Store until released
                self._held[r] = w._worker
            if hasattr(w, "get_transfer_results"):
                tr = w.get_transfer_results(out.finished_req_ids)
                ko = KVConnectorOutput(tr.finished_sending or None, tr.finished_recving or None,
                                       set(tr.failed_recving or ()))
                assert ko.failed_recving <= set(ko.finished_recving or ()), "a failed receive must also be finished"
            else:
                s_, r_ = w.get_finished(out.finished_req_ids)
                ko = KVConnectorOutput(s_, r_)
            ko.invalid_block_ids = set(w.get_block_ids_with_load_errors() or ())
            if hasattr(w, "build_connector_worker_meta"):
                ko.kv_connector_worker_meta = w.build_connector_worker_meta()
            ko.kv_connector_stats = w.get_kv_connector_stats() if hasattr(w, "get_kv_connector_stats") else None
            w.clear_connector_metadata()
            t += time.perf_counter() - t0
            worst = max(worst, t)
            for rid in list(tables):
                if rid in out.finished_req_ids:
                    tables.pop(rid, None)
            outs.append(ko)
        for rid in out.finished_req_ids:
            self.worker_seqs.pop(rid, None)
        kv = self._aggregate(outs)
        if self.cfg.gpu_s:
            time.sleep(self.cfg.gpu_s)
        return {"kv": kv, "sampled": sampled, "done": done, "worker_s": worst}

    def _mamba_forward(self, mem: "RankMemory", seq: Sequence, table: list[list[int]], c0: int, n: int) -> bytes | None:
        """The Mamba layers of one request's step in align mode: start from the
        state in the block holding token c0's state (a loaded, cached or the
        running block), fold in each scheduled token, write the state into
        the block of the step's last token. None without Mamba groups."""
        state = None
        for g, s in enumerate(self.group_sizes):
            if not self.kvm.mamba[g]:
                continue
            st = self.seed if c0 == 0 else mem.mamba_read(g, table[g][-(-c0 // s) - 1])
            for p in range(c0, c0 + n):
                st = _digest(st, seq.token(p))
            dst = table[g][-(-(c0 + n) // s) - 1]
            assert dst != 0, f"the running state block of tokens up to {c0 + n} is vLLM's null block"
            mem.mamba_write(g, dst, st)
            state = st if state is None else state
        return state

    def _let_sender_run(self, r: int) -> None:
        """cfg.sender_lags: after handle_preemptions, the sender takes what is queued."""
        ws = self._held.pop(r, None)
        if ws is None:
            return
        ws._cv.release()
        assert wait_for(lambda: not ws._queue or ws.suspect()), "the sender never took the queued jobs"

    def _aggregate(self, outs: list[KVConnectorOutput]) -> KVConnectorOutput:
        assert len(outs) == len(self.workers), (len(outs), len(self.workers))
        agg = KVConnectorOutput(set(), set())
        if not hasattr(self, "_send_count"):
            self._send_count: dict[str, int] = {}
            self._recv_count: dict[str, int] = {}
            self._failed_pending: set[str] = set()
        n = len(outs)
        for ko in outs:
            for rid in ko.finished_sending or ():
                self._send_count[rid] = self._send_count.get(rid, 0) + 1
                if self._send_count[rid] == n:
                    agg.finished_sending.add(rid)
                    del self._send_count[rid]
            for rid in ko.finished_recving or ():
                self._recv_count[rid] = self._recv_count.get(rid, 0) + 1
                if self._recv_count[rid] == n:
                    agg.finished_recving.add(rid)
                    del self._recv_count[rid]
            self._failed_pending |= ko.failed_recving
            agg.invalid_block_ids |= ko.invalid_block_ids
            st = ko.kv_connector_stats
            if st is not None:  # vLLM's KVOutputAggregator, on the copies the workers' outputs arrive as
                st = pickle.loads(pickle.dumps(st))
                agg.kv_connector_stats = st if agg.kv_connector_stats is None else agg.kv_connector_stats.aggregate(st)
            m = ko.kv_connector_worker_meta
            if m is not None:
                agg.kv_connector_worker_meta = m if agg.kv_connector_worker_meta is None else \
                    agg.kv_connector_worker_meta.aggregate(m)
        agg.failed_recving = self._failed_pending & agg.finished_recving
        self._failed_pending -= agg.failed_recving
        if self.cfg.failed_as_dict:
            agg.failed_recving = {rid: "LOAD_FAILED" for rid in agg.failed_recving}
        return agg

    # -- one engine step --------------------------------------------------------

    def step(self) -> None:
        """vLLM's engine loop. Synchronous: schedule, execute, process. Async:
        schedule the next step before processing the one in flight."""
        self._sched_t = 0.0
        out = self.schedule()
        if self.cfg.async_scheduling:
            self.in_flight.append((out, None))
            if len(self.in_flight) < 2:
                self.step_conn_s.append(self._sched_t)
                return
            prev, _ = self.in_flight.popleft()
            res = self.execute(prev)
        else:
            prev = out
            res = self.execute(out)
        self.update_from_output(prev, res)
        self.step_conn_s.append(self._sched_t + res["worker_s"])

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = True) -> bool:
        """vLLM's Scheduler.reset_prefix_cache (at 7cfb97e): preempts the
        running requests if asked, resets the local prefix cache (only when
        no request holds a block), then the connector's (``reset_cache``;
        None counts as success)."""
        if reset_running_requests:
            while self.running:
                victim = self.running.pop()
                self._preempt(victim)
                self.reset_preempted.add(victim.request_id)
        ok = all(b.ref_cnt == 0 for b in self.kvm.pool[1:])
        # (The stand-in's deferred frees of async scheduling are freed in
        # vLLM at preemption; blocks a request still holds are not.)
        if reset_running_requests and any(any(g) for g in self.kvm.tables.values()):
            held = [(rid, getattr(self.requests.get(rid), "status", None)) for rid, t in self.kvm.tables.items() if any(t)]
            raise EngineCrash("Failed to reset KV cache even when all the running requests are preempted and moved "
                              f"to the waiting queue (vLLM's scheduler.py:2574-2580): blocks held by {held[:6]}")
        if ok:
            self.kvm.uncache(list(self.kvm.cached.values()))
        if reset_connector and hasattr(self.sched_conn, "reset_cache"):
            ok = self.sched_conn.reset_cache() is not False and ok
        return ok

    def update_weights(self, drain: bool = True) -> bool:
        """An RL trainer's weight update: pause (the steps in flight finish
        when ``drain``; requests waiting for their KV or loaded and not yet
        scheduled are aborted, as vLLM refuses a reset while they hold
        blocks), reset every cache with the
        running requests preempted (the local prefix cache is emptied as the
        trainer's retried resets would), load new weights (every token's KV
        changes from here)."""
        self.paused = True
        if drain:
            self.drain()
        for req in [r for r in self.requests.values()
                    if r.status == REMOTE or (r.status in (WAITING, PREEMPTED) and r.request_id in self.kvm.tables)]:
            # Waiting for their KV, or loaded and not yet scheduled: they
            # hold blocks (of the old weights) that a preemption would not
            # free, and vLLM refuses the reset.
            self._finish(req, "abort")
        # Finished requests keep their blocks while a load or a store of
        # theirs is in flight; vLLM's reset raises meanwhile
        # (scheduler.py:2574-2580): the trainer waits (docs/vllm.md, Limits).
        for _ in range(20000):
            if drain:
                self.drain()
            held = [rid for rid, t in self.kvm.tables.items()
                    if any(t) and self.requests.get(rid) is not None and self.requests[rid].status == FINISHED]
            if not held:
                break
            self.step()
            if not self.running:
                time.sleep(0.0005)
        self.paused = False
        ok = self.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        self.kvm.uncache(list(self.kvm.cached.values()))
        for req in self.requests.values():
            # Finished requests whose blocks wait for their stores hold the
            # old weights' KV: nothing to check them against any more.
            req.done_tokens = 0
        for m in self.memory:
            m.weights += 1
        self.counters["weight_updates"] = self.counters.get("weight_updates", 0) + 1
        return ok

    def drain(self) -> None:
        while self.in_flight:
            prev, _ = self.in_flight.popleft()
            self._sched_t = 0.0
            self.update_from_output(prev, self.execute(prev))

    def describe(self) -> str:
        """Where requests are stuck, for a failure message."""
        from collections import Counter

        st = Counter(r.status for r in self.requests.values())
        sc = getattr(self.sched_conn, "_scheduler", None)
        workers = [getattr(w, "_worker", None) for w in self.workers]
        return (f"{dict(st)}; free blocks {len(self.kvm.free)}/{self.cfg.num_blocks - 1}; deferred frees "
                f"{len(self.deferred)}; running {len(self.running)}; waiting {[r.request_id for r in self.skipped + self.waiting][:6]}; "
                f"finished_recving {sorted(self.finished_recving)[:6]}; worker jobs "
                f"{[w.pending() if w is not None else None for w in workers]}; scheduler lookups pending "
                f"{sc.pending_lookups() if sc is not None else None}, disabled {getattr(sc, 'disabled', None)}, "
                f"healthy {sc.healthy() if sc is not None else None}, namespaces {getattr(sc, '_ns_ids', None)}, "
                f"lookups {[(rid, r.key[:2], r.done, round(time.monotonic() - r.submitted, 3) if r.submitted else 0, r.answered_at) for rid, r in list(getattr(sc, '_lookups', {}).items())[:4]]}, "
                f"io queue {len(sc._io._queue) if sc is not None else None}, io down {sc._io._down if sc is not None else None}; "
                f"held {[(r.request_id, r.status) for r in self.requests.values() if r.status in (FINISHED, REMOTE)][:8]}; "
                f"worker await_send {[sorted(w._await_send)[:6] for w in workers if w is not None]}, "
                f"finished_seen {[sorted(w._finished_seen)[:6] for w in workers if w is not None]}, "
                f"pending stores {[dict(w._pending_stores) for w in workers if w is not None]}, "
                f"pending loads {[dict(w._pending_loads) for w in workers if w is not None]}, "
                f"recv_done {[sorted(w._recv_done)[:6] for w in workers if w is not None]}")

    def idle(self) -> bool:
        """No request holds anything (a step still in flight only holds
        finished requests' tokens; ``drain`` processes it), and no worker
        has a store or load in flight (a finished request's blocks go back
        to vLLM at once; its stores may still be landing)."""
        if self.requests:
            return False
        return not any(getattr(w, "_worker", None) is not None and w._worker.pending() for w in self.workers)

    # -- the check ----------------------------------------------------------------

    def verify(self) -> None:
        """Every computed position of every block any request holds, on every
        rank, holds exactly what the forward pass would have written."""
        checked = 0
        for req in self.requests.values():
            table = self.kvm.tables.get(req.request_id)
            if not table or req.done_tokens <= 0:
                continue
            checked += self._verify_mamba(req, table)
            for g, s in enumerate(self.group_sizes):
                if self.kvm.mamba[g]:
                    continue
                for p in range(min(req.done_tokens, len(table[g]) * s)):
                    b = table[g][p // s]
                    if b.is_null:
                        continue
                    for mem in self.memory:
                        if not mem.check(req.seq, p, g, b.block_id):
                            raise WrongKV(f"request {req.request_id} position {p} group {g} block {b.block_id} rank "
                                          f"{mem.rank}: wrong KV (status {req.status}, done {req.done_tokens}, "
                                          f"computed {req.num_computed_tokens}, local {req.local_computed})")
                    checked += 1
        self.counters["positions_checked"] += checked

    def check_stored(self) -> dict[str, int]:
        """Reads back, on every rank, every block a plan stored
        (cfg.record_stores), each into a free engine block with a load of
        its own, and compares it with what the block held when its request
        computed it. Needs an idle engine (no request holds a block). A
        block the daemon no longer holds (never stored: left out at a
        fence, dropped; or evicted) is ``missing``; one whose bytes differ
        is ``wrong``."""
        from kvoffload.plan import GroupJob, StepPlan

        self.drain()
        while self.deferred:
            self.kvm._release(self.deferred.popleft()[1])
        assert self.idle() and not self.kvm.tables, "check_stored needs an idle engine"
        out = {"checked": 0, "missing": 0, "wrong": 0}
        items = sorted(self.stored.items(), key=lambda kv: (kv[0][0], kv[0][1]))
        scratch = [b.block_id for b in self.kvm.pool[1:]]
        for r, (w, mem) in enumerate(zip(self.workers, self.memory)):
            ws = w._worker
            for at in range(0, len(items), len(scratch)):
                batch = items[at:at + len(scratch)]
                loads = {f"chk{r}.{at + n}": [GroupJob(g, [h], [scratch[n]])] for n, ((g, h), _) in enumerate(batch)}
                ws.start_load_kv(StepPlan(loads=loads))
                assert wait_for(lambda: ws.pending() == 0), "check_stored: loads never finished"
                ws.get_finished(set())
                failed_blocks = set(ws.get_block_ids_with_load_errors())
                failed_reqs = ws.take_failed_requests()
                for n, ((g, h), (seq, i, weights)) in enumerate(batch):
                    if scratch[n] in failed_blocks or f"chk{r}.{at + n}" in failed_reqs:
                        out["missing"] += 1
                        continue
                    saved, mem.weights = mem.weights, weights
                    try:
                        s = self.group_sizes[g]
                        ok = all(mem.check(seq, p, g, scratch[n]) for p in range(i * s, (i + 1) * s))
                    finally:
                        mem.weights = saved
                    out["checked"] += 1
                    out["wrong"] += 0 if ok else 1
        # The scratch blocks' bytes are no longer what the local prefix
        # cache says they hold.
        self.kvm.uncache(list(self.kvm.cached.values()))
        return out

    def _verify_mamba(self, req: Request, table: list[list[KVCacheBlock]]) -> int:
        """Every Mamba state block a request holds: the running block (the one
        of its last computed token) holds the state after its computed tokens,
        every earlier real block the state committed at its boundary."""
        checked = 0
        for g, s in enumerate(self.group_sizes):
            if not self.kvm.mamba[g]:
                continue
            last = -(-req.done_tokens // s) - 1
            for i, b in enumerate(table[g][:last + 1]):
                if b.is_null:
                    continue
                n = req.done_tokens if i == last else (i + 1) * s
                wants = [req.seq.digest(n - 1)]
                c = int(req.num_computed_tokens)
                if req.status == FINISHED and i == last and c > n and -(-c // s) - 1 == i:
                    # Under async scheduling a finished request's last
                    # scheduled step still runs (vLLM discards its token):
                    # the running block then holds the state after it.
                    wants.append(req.seq.digest(c - 1))
                for mem in self.memory:
                    if not any(mem.mamba_check(g, b.block_id, w) for w in wants):
                        raise WrongKV(f"request {req.request_id} Mamba group {g} block {b.block_id} (index {i}) rank "
                                      f"{mem.rank}: not the state after {n} tokens (status {req.status}, done "
                                      f"{req.done_tokens}, computed {req.num_computed_tokens}, local {req.local_computed})")
                checked += 1
        return checked

    def close(self) -> None:
        for r in list(self._held):
            self._held.pop(r)._cv.release()
        for w in self.workers:
            w.shutdown()
        self.sched_conn.shutdown()
        for m in self.memory:
            m.shm.close()


# -- workloads ------------------------------------------------------------------


@dataclass
class Workload:
    """Seeded requests: shared prefixes (so there are hits), random suffixes,
    lengths, outputs, controls and aborts."""

    seed: int
    unit: int
    prefixes: int = 4
    arrival: float = 0.6
    max_prompt_units: int = 6
    max_output: int = 10
    abort_rate: float = 0.02
    control_rate: float = 0.05

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.shared = [[self.rng.randrange(10, 5000) for _ in range(self.rng.randint(1, 4) * self.unit)]
                       for _ in range(self.prefixes)]
        self.n = 0

    def tick(self, eng: Engine, stop_arrivals: bool = False) -> None:
        rng = self.rng
        if not stop_arrivals:
            while rng.random() < self.arrival:
                self.n += 1
                base = list(rng.choice(self.shared)) if rng.random() < 0.8 else []
                tail = [rng.randrange(10, 5000) for _ in range(rng.randint(1, self.max_prompt_units * self.unit))]
                if rng.random() < 0.3 and eng.requests:  # a prompt that extends an earlier one
                    other = rng.choice(list(eng.requests.values()))
                    base = list(other.all_token_ids[: (other.num_tokens // self.unit) * self.unit])
                max_tokens = rng.randint(1, self.max_output)
                prompt = (base + tail)[: eng.max_model_len() - max_tokens]
                kw: dict[str, Any] = {}
                x = rng.random()
                if x < self.control_rate:
                    kw["skip_reading_prefix_cache"] = True
                elif x < 2 * self.control_rate:
                    kw["kv_transfer_params"] = {"kvoffload_store": rng.choice(["none", "prompt"])}
                eng.add_request(f"r{self.seed}-{self.n}", prompt, max_tokens, **kw)
        if eng.requests and rng.random() < self.abort_rate:
            eng.abort(rng.choice(list(eng.requests)))


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def lcm(*xs: int) -> int:
    return math.lcm(*xs)
