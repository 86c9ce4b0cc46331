"""The engine's side of the GPU check, with real torch tensors.

Run by scripts/gpucheck/run.py against a running CUDA kvoffloadd (started
with a short --cuda-ready-timeout). It plays a vLLM worker: a KV cache of
FlashAttention-shaped bf16 layers viewed from one int8 allocation, exported
with the connector's own code (regions_from_kv_caches and
kvoffload.cuda_ipc: PyTorch's handle as _share_cuda_ returns it, the
device's UUID, IPC events from the pool), and checks:

1. export: one _share_cuda_ for the one storage; the handle's form; the UUID;
2. consecutive and scattered blocks: a Store sent while the compute stream
   is still writing the blocks (a ready event recorded after the writes)
   stores the written bytes; a Load sent while the compute stream is still
   reading its destination blocks leaves what the stream read unchanged,
   then delivers the stored bytes; every byte compared;
3. an engine killed mid-store (a child process: its stream busy for a long
   time, Store sent with its ready event, then SIGKILL): the daemon fails
   that job at its ready timeout (metrics), keeps serving, and a new round
   trip works.

Writes one JSON object to --json. Exit 0 pass, 1 fail.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import urllib.request

LAYERS, NB, BS, HEADS, HEAD = 4, 256, 16, 8, 128  # 32 KiB per (layer, K/V, block)
HASH = 16


def log(msg: str) -> None:
    print(f"torch_check: {msg}", flush=True)


class Engine:
    """One worker's KV cache and compute stream."""

    def __init__(self, torch, device: int, seed: int):
        self.torch = torch
        self.dev = torch.device("cuda", device)
        torch.cuda.set_device(self.dev)
        per = 2 * NB * BS * HEADS * HEAD * 2  # bytes of one layer
        # vLLM allocates one int8 tensor per KV cache tensor and views it.
        self.raw = torch.zeros(LAYERS * per, dtype=torch.int8, device=self.dev)
        self.layers = {
            f"model.layers.{i}.self_attn.attn": self.raw[i * per:(i + 1) * per].view(torch.bfloat16).view(2, NB, BS, HEADS, HEAD)
            for i in range(LAYERS)
        }
        self.u8 = [self.raw[i * per:(i + 1) * per].view(torch.uint8).view(2, NB, BS * HEADS * HEAD * 2) for i in range(LAYERS)]
        self.gen = torch.Generator(device=self.dev)
        self.gen.manual_seed(seed)
        self.cps = self._calibrate()

    def _calibrate(self) -> float:
        t = self.torch
        a, b = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        a.record()
        t.cuda._sleep(50_000_000)
        b.record()
        b.synchronize()
        return 50_000_000 / (a.elapsed_time(b) / 1000.0)

    def busy(self, seconds: float) -> None:
        """Keeps the current stream busy that long (a long forward pass)."""
        self.torch.cuda._sleep(int(seconds * self.cps))

    def fill(self, ids: list[int]) -> None:
        idx = self.torch.tensor(ids, device=self.dev)
        for u in self.u8:
            u[:, idx] = self.torch.randint(0, 256, (2, len(ids), u.shape[2]), dtype=self.torch.uint8,
                                           device=self.dev, generator=self.gen)

    def blocks(self, ids: list[int]):
        """The bytes of blocks ids, every layer, as one tensor (a copy)."""
        idx = self.torch.tensor(ids, device=self.dev)
        return self.torch.stack([u[:, idx] for u in self.u8])


def jobs(kv, job_id: int, hashes: list[bytes], ids: list[int]):
    return [kv.Job(job_id=job_id, hashes=hashes, block_ids=ids, request_id=f"torch-check-{job_id}")]


def round_trip(kv, torch, cl, reg, eng, pool, name: str, src: list[int], dst: list[int], nonce: int, job_base: int) -> dict:
    """Store src behind a writing stream, load into dst behind a reading one."""
    out = {"case": name, "blocks": len(src)}
    hashes = [nonce.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(len(src))]
    # Store: the stream is busy, then writes the blocks, then the event.
    eng.busy(0.3)
    eng.fill(src)
    ev, tok = pool.record()
    t0 = time.monotonic()
    res = cl.store(reg.registration_id, jobs(kv, job_base + 1, hashes, src), wait=True, ready_event=ev)
    out["store_ms"] = round((time.monotonic() - t0) * 1000, 1)
    pool.release(tok)
    if not res[0].ok:
        raise AssertionError(f"{name}: store failed: {res[0].failures[:3]}")
    torch.cuda.synchronize()
    want = eng.blocks(src)
    # Load: fill dst with something else, keep the stream busy, then read
    # dst (a forward still attending to those blocks), then the event.
    eng.fill(dst)
    torch.cuda.synchronize()
    old = eng.blocks(dst)
    eng.busy(0.3)
    seen = eng.blocks(dst)  # the engine's read, queued behind the busy stream
    ev, tok = pool.record()
    t0 = time.monotonic()
    res = cl.load(reg.registration_id, jobs(kv, job_base + 2, hashes, dst), wait=True, ready_event=ev)
    out["load_ms"] = round((time.monotonic() - t0) * 1000, 1)
    pool.release(tok)
    if not res[0].ok:
        raise AssertionError(f"{name}: load failed: {res[0].failures[:3]}")
    torch.cuda.synchronize()
    if not torch.equal(seen, old):
        out["load_raced_the_engine"] = True
        raise AssertionError(f"{name}: the engine's read of the destination blocks saw loaded bytes: the load did not wait for its ready event")
    got = eng.blocks(dst)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise AssertionError(f"{name}: {bad.shape[0]} bytes of the loaded blocks differ from the stored ones (first at {bad[0].tolist()})")
    out["bytes_compared"] = int(want.numel())
    log(f"{name}: store behind a writing stream {out['store_ms']} ms, load behind a reading stream {out['load_ms']} ms, "
        f"{out['bytes_compared']} bytes equal")
    return out


def metric(url: str, prefix: str) -> float:
    """The sum of the samples whose line starts with prefix (a name, or a
    name and the start of its labels)."""
    if not url:
        return -1.0
    total = 0.0
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(prefix) and line[len(prefix):len(prefix) + 1] in (" ", "{", ",", ""):
                total += float(line.rsplit(" ", 1)[1])
    return total


# A dead engine's store fails either at the ready timeout or, if the driver
# reports the dead process's event as failed, at the query: both count.
TIMEOUTS = "kvoffload_cuda_ready_timeouts_total"
EVENT_ERRORS = 'kvoffload_cuda_errors_total{call="cuEventQuery"'


def dead_store_failures(url: str) -> tuple[float, float]:
    return metric(url, TIMEOUTS), metric(url, EVENT_ERRORS)


def child_engine(args) -> int:
    """A worker that dies mid-store: its stream busy for a minute, a Store
    sent with the event recorded after the busy kernel, then killed."""
    import torch

    import kvoffload as kv
    from kvoffload.cuda_ipc import IpcEventPool
    from kvoffload.regions import regions_from_kv_caches

    eng = Engine(torch, args.device, seed=99)
    reg_kv = regions_from_kv_caches(eng.layers, [list(eng.layers)], NB, HASH)
    cl = kv.Client(args.socket)
    reg = cl.register(args.fingerprint.encode(), reg_kv.layout, reg_kv.regions, "torch_check doomed engine")
    pool = IpcEventPool()
    eng.busy(60.0)
    eng.fill(list(range(8)))
    ev, _ = pool.record()
    hashes = [b"doomed-".ljust(8, b"\0") + i.to_bytes(8, "little") for i in range(8)]
    cl.store(reg.registration_id, jobs(kv, 1, hashes, list(range(8))), wait=False, ready_event=ev)
    print("SENT", flush=True)
    time.sleep(120)  # killed long before
    return 0


def killed_engine(args, kv, cl, out: dict) -> None:
    fp = f"torch-check-doomed-{os.getpid()}"
    before = dead_store_failures(args.metrics)
    child = subprocess.Popen([sys.executable, __file__, "--child-engine", "--socket", args.socket, "--device", str(args.device),
                              "--fingerprint", fp], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().strip()
        if line != "SENT":
            raise AssertionError(f"the doomed engine did not send its store (said {line!r}, exit {child.poll()})")
        time.sleep(0.2)  # let the daemon take the Store
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    killed = time.monotonic()
    log("killed the engine with a store waiting for its ready event")
    # The daemon must fail that job at its ready timeout, and keep serving.
    deadline = killed + args.ready_timeout + 20
    after = before
    while time.monotonic() < deadline:
        if not cl.healthy(timeout=2):
            raise AssertionError("the daemon stopped serving after an engine died mid-store")
        after = dead_store_failures(args.metrics)
        if after != before:
            break
        time.sleep(0.2)
    out["ready_timeouts"] = [before[0], after[0]]
    out["event_query_errors"] = [before[1], after[1]]
    out["failed_by"] = "ready timeout" if after[0] > before[0] else ("event query error" if after[1] > before[1] else "nothing")
    out["failed_after_s"] = round(time.monotonic() - killed, 1)
    ns = cl.resolve([fp.encode()])[0]
    ready = -1
    if ns:
        hashes = [b"doomed-".ljust(8, b"\0") + i.to_bytes(8, "little") for i in range(8)]
        ready = cl.lookup([ns], hashes).ready
    out["killed_engine_blocks_ready"] = ready
    if args.metrics and after == before:
        raise AssertionError(f"neither a ready timeout nor an event error counted {out['failed_after_s']} s after the engine died "
                             f"(its store completed or is still waiting; {ready} of its blocks ready)")
    if ready > 0:
        raise AssertionError(f"{ready} blocks of the killed engine's store are ready: bytes of a dead engine were stored")
    log(f"the daemon failed the dead engine's store ({out['failed_by']}) after {out['failed_after_s']} s and kept serving")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--json", default="")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--metrics", default="", help="the daemon's /metrics URL")
    p.add_argument("--ready-timeout", type=float, default=3.0, help="the daemon's --cuda-ready-timeout, seconds")
    p.add_argument("--child-engine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fingerprint", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_engine:
        return child_engine(args)

    result = {"check": "torch", "pass": False, "failures": [], "data": {}}
    start = time.monotonic()
    data = result["data"]
    try:
        import torch

        import kvoffload as kv
        from kvoffload.cuda_ipc import IpcEventPool, TorchCudaExporter, torch_handle_kind
        from kvoffload.regions import regions_from_kv_caches

        data["torch"] = torch.__version__
        data["torch_cuda"] = torch.version.cuda
        data["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        eng = Engine(torch, args.device, seed=1)
        exp = TorchCudaExporter()
        reg_kv = regions_from_kv_caches(eng.layers, [list(eng.layers)], NB, HASH, cuda_exporter=exp)
        r0 = reg_kv.regions[0]
        data["export"] = {
            "share_cuda_calls": exp.share_calls, "regions": len(reg_kv.regions), "handle_bytes": len(r0.cuda_handle),
            "handle_form": torch_handle_kind(r0.cuda_handle), "device_uuid": r0.cuda_device_uuid.hex(),
            "alloc_size": r0.cuda_alloc_size,
        }
        log(f"torch {torch.__version__} (CUDA {torch.version.cuda}): {len(reg_kv.regions)} regions from one storage, "
            f"{exp.share_calls} _share_cuda_ call(s), handle {len(r0.cuda_handle)} bytes ({torch_handle_kind(r0.cuda_handle)}), "
            f"device uuid {r0.cuda_device_uuid.hex()}")
        if exp.share_calls != 1:
            raise AssertionError(f"{exp.share_calls} _share_cuda_ calls for one storage")
        if len(r0.cuda_device_uuid) != 16:
            raise AssertionError("no device UUID from torch")
        cl = kv.Client(args.socket, timeout=60)
        cl.wait_ready(30)
        reg = cl.register(f"torch-check-{os.getpid()}".encode(), reg_kv.layout, reg_kv.regions, "torch_check")
        pool = IpcEventPool()
        import random

        rnd = random.Random(7)
        cases = [
            round_trip(kv, torch, cl, reg, eng, pool, "consecutive", list(range(64)), list(range(128, 192)), 1, 100),
            round_trip(kv, torch, cl, reg, eng, pool, "scattered", rnd.sample(range(0, 128), 48), rnd.sample(range(128, 256), 48), 2, 200),
        ]
        data["round_trips"] = cases
        data["ipc_events_made"] = pool.created
        killed = {}
        data["killed_engine"] = killed
        killed_engine(args, kv, cl, killed)
        # And the daemon still works for a live engine.
        data["after_kill"] = round_trip(kv, torch, cl, reg, eng, pool, "after the kill", list(range(64, 80)), list(range(200, 216)), 3, 300)
        cl.unregister(reg.registration_id)
        cl.close()
    except Exception as e:  # noqa: BLE001 - every failure goes into the report
        result["failures"].append(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    result["pass"] = not result["failures"]
    result["seconds"] = round(time.monotonic() - start, 1)
    for f in result["failures"]:
        log(f"FAIL {f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    log("PASS" if result["pass"] else "FAIL")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
