"""Plain Python values of the kvoffload.v1 API.

The client takes and returns these instead of protobuf messages, so callers
need not know the generated code. Each mirrors one message of
rpc/kvoffload/v1/kvoffload.proto, whose comments define the semantics.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from .errors import InvalidArgument

__all__ = [
    "BlockStatus",
    "Tier",
    "Op",
    "Segment",
    "Layout",
    "Region",
    "Registration",
    "Job",
    "BlockFailure",
    "JobResult",
    "LookupResult",
    "Completions",
    "TierStats",
    "NamespaceStats",
    "Stats",
    "pack_hashes",
]


class BlockStatus(enum.IntEnum):
    """Status of one block in a finished job (kvoffload.v1.BlockStatus)."""

    OK = 0
    MISSING = 1  # not cached: never stored, evicted or invalidated
    IO_ERROR = 2  # disk I/O error or short read; slot quarantined
    CORRUPT = 3  # header or checksum verification failed
    NO_SPACE = 4  # a store found no free slot
    DMA_ERROR = 5  # the copy engine failed
    REJECTED = 6  # the admission policy kept hotter blocks
    CANCELLED = 7  # shutdown, or Unregister before the job started


class Tier(enum.IntEnum):
    """Where a ready block is (kvoffload.v1.Tier)."""

    NONE = 0
    CPU = 1
    DISK = 2
    CPU_AND_DISK = 3
    REMOTE = 4  # only in the shared remote tier (docs/remote.md): never leased, may come back MISSING at load


class EventKind(enum.IntEnum):
    """What a :class:`KVEvent` says (kvoffload.v1.EventKind; docs/events.md)."""

    UNSPECIFIED = 0
    BLOCK_STORED = 1  # the block became ready in ``tier``
    BLOCK_REMOVED = 2  # the block left ``tier``
    ALL_BLOCKS_CLEARED = 3  # forget every block of the stream; a snapshot follows
    EVENTS_LOST = 4  # the stream fell behind: a reset and a snapshot follow
    CAUGHT_UP = 5  # every change up to ``seq`` has been sent


class Op(enum.IntEnum):
    """A job's direction (kvoffload.v1.Op)."""

    UNSPECIFIED = 0
    STORE = 1
    LOAD = 2


@dataclass(frozen=True)
class Segment:
    """One piece of an engine block: the bytes of one region for one KV cache group."""

    group: int
    bytes: int


@dataclass(frozen=True)
class Layout:
    """How one engine block maps to bytes. ``segments[i]`` lives in ``regions[i]``
    of a registration. Two registrations with the same fingerprint must have
    equal layouts."""

    hash_bytes: int
    segments: tuple[Segment, ...]

    def __init__(self, hash_bytes: int, segments: Sequence[Segment]):
        object.__setattr__(self, "hash_bytes", int(hash_bytes))
        object.__setattr__(self, "segments", tuple(segments))

    @property
    def num_groups(self) -> int:
        return max((s.group for s in self.segments), default=-1) + 1

    def payload_bytes(self, group: int) -> int:
        """Bytes of one stored block of ``group``: its segments back to back."""
        return sum(s.bytes for s in self.segments if s.group == group)


@dataclass(frozen=True)
class Region:
    """A piece of engine KV memory: engine block ``b`` starts at
    ``offset + b*block_stride``. Exactly one of ``shm_path`` and ``cuda_handle``
    is set; build one with :meth:`shm` or :meth:`cuda`."""

    offset: int
    block_stride: int
    num_blocks: int
    shm_path: str | None = None
    cuda_handle: bytes | None = None
    cuda_device: int = 0
    cuda_alloc_size: int = 0
    cuda_device_uuid: bytes = b""

    @classmethod
    def shm(cls, path: str, *, offset: int = 0, block_stride: int, num_blocks: int) -> "Region":
        """A regular file under /dev/shm (the daemon maps it shared)."""
        return cls(offset=offset, block_stride=block_stride, num_blocks=num_blocks, shm_path=path)

    @classmethod
    def cuda(
        cls,
        handle: bytes,
        *,
        device: int,
        alloc_size: int,
        offset: int = 0,
        block_stride: int,
        num_blocks: int,
        device_uuid: bytes = b"",
    ) -> "Region":
        """Device memory exported as a 64-byte cudaIpcMemHandle_t (or PyTorch's
        66-byte form of it); ``offset`` is from the start of the exported
        allocation, ``alloc_size`` its size; ``device_uuid`` (16 bytes) names
        the device whatever this process's CUDA_VISIBLE_DEVICES."""
        return cls(
            offset=offset,
            block_stride=block_stride,
            num_blocks=num_blocks,
            cuda_handle=bytes(handle),
            cuda_device=device,
            cuda_alloc_size=alloc_size,
            cuda_device_uuid=bytes(device_uuid),
        )


@dataclass(frozen=True)
class Registration:
    """The answer to Register."""

    registration_id: int
    namespace_id: int
    joined_existing: bool
    # The daemon's release and the API protocol it answered in ("" and 1
    # from a daemon older than the numbers).
    daemon_version: str = ""
    protocol_version: int = 1


@dataclass
class Job:
    """One request's blocks of one group: ``hashes[i]`` moves to or from engine
    block ``block_ids[i]``. ``job_id`` must be unique among the registration's
    unfinished jobs."""

    job_id: int
    hashes: Sequence[bytes]
    block_ids: Sequence[int]
    group: int = 0
    request_id: str = ""
    lease_id: int = 0


@dataclass(frozen=True)
class BlockFailure:
    """A block of a job that did not succeed."""

    index: int  # position of the block in its job
    block_id: int  # the engine block id
    hash: bytes
    status: BlockStatus


@dataclass(frozen=True)
class JobResult:
    """A finished job. ``ok`` is True when every block succeeded (for a store:
    is now cached, or already was)."""

    job_id: int
    request_id: str
    op: Op
    ok: bool
    failures: tuple[BlockFailure, ...]
    blocks: int
    bytes: int
    # Place in the registration's queue of results (docs/api.md, the
    # cursor); 0 on a result returned with wait.
    seq: int = 0

    @property
    def failed_block_ids(self) -> list[int]:
        """The engine block ids of the failed blocks, in job order."""
        return [f.block_id for f in self.failures]


@dataclass(frozen=True)
class LookupResult:
    """How many leading keys are ready in every named namespace; ``tiers[i]`` is
    the slowest tier of key i across namespaces; ``lease_id`` is non-zero when a
    lease was asked for and taken."""

    ready: int
    tiers: tuple[Tier, ...] = ()
    lease_id: int = 0


@dataclass(frozen=True)
class Completions:
    """Jobs finished since the last call, how many are still running, and
    whether more results are queued (call again without waiting)."""

    results: tuple[JobResult, ...]
    pending: int
    more: bool = False


@dataclass(frozen=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int


@dataclass(frozen=True)
class NamespaceStats:
    namespace_id: int
    fingerprint: bytes
    registrations: int
    blocks: int


class RecoveryState(enum.IntEnum):
    """Where the disk tier's background recovery is (kvoffload.v1.RecoveryState)."""

    NONE = 0  # no disk tier, or not started
    RUNNING = 1  # scanning; blocks come online as their chunks are verified
    DONE = 2
    STOPPED = 3  # shutdown came first; the rest is scanned at the next start


@dataclass(frozen=True)
class DiskRecovery:
    """The disk tier's recovery of its slot files after a start (Stats)."""

    state: RecoveryState = RecoveryState.NONE
    slots_total: int = 0
    slots_scanned: int = 0
    bytes_total: int = 0
    bytes_scanned: int = 0
    blocks_recovered: int = 0
    bad_slots: int = 0
    elapsed_ms: int = 0


@dataclass(frozen=True)
class Stats:
    tiers: tuple[TierStats, ...] = ()
    namespaces: tuple[NamespaceStats, ...] = ()
    lookups: int = 0
    lookup_hits: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    blocks_failed: int = 0
    evictions: int = 0
    version: str = ""
    # The API protocols the daemon speaks (0 from a daemon older than the
    # numbers).
    protocol_version: int = 0
    min_protocol_version: int = 0
    extra: dict = field(default_factory=dict)
    disk_recovery: DiskRecovery = DiskRecovery()

    def namespace_for(self, fingerprint: bytes) -> int | None:
        """The id of the namespace registered under ``fingerprint``, if any."""
        for ns in self.namespaces:
            if ns.fingerprint == fingerprint:
                return ns.namespace_id
        return None


def pack_hashes(hashes: Sequence[bytes], hash_bytes: int | None = None) -> bytes:
    """Packs block hashes back to back, as KeyList.hashes wants them.

    Every hash must have the same length (``hash_bytes`` when given); the
    client refuses anything else before sending, like the Go client's Keys.
    Whether that length is the namespace's is the daemon's to check.
    """
    hs = [bytes(h) for h in hashes]
    if not hs:
        return b""
    want = len(hs[0]) if hash_bytes is None else int(hash_bytes)
    for i, h in enumerate(hs):
        if len(h) != want:
            raise InvalidArgument(None, f"hash {i} is {len(h)} bytes, want {want}", from_daemon=False)
    return b"".join(hs)


@dataclass(frozen=True)
class KVEvent:
    """One change of one block's tiers, or a marker (no block): an element of
    :meth:`kvoffload.Client.watch_events`. ``seq`` is the change's place in
    the daemon's sequence; along one stream it never decreases."""

    seq: int
    kind: EventKind
    tier: Tier = Tier.NONE
    namespace_id: int = 0
    group: int = 0
    hash: bytes = b""
