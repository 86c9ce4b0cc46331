#!/usr/bin/env python3
"""Runs the whole GPU check of kvoffloadd and writes results.json and
summary.txt. scripts/gpu-check.sh calls it with the prebuilt binaries (or
the ones it just built); see docs/cuda.md. Standard library only: the torch
phase runs torch_check.py in its own process.

Phases, each with its own time limit (under 5 minutes in all):

  preflight  the GPUs, the driver's libcuda.so.1, every libcuda symbol the
             binaries import, python/torch/grpc/protobuf versions
  probe      CUDA IPC memory and event between two processes, host
             registration, device by UUID (gpucheck probe; no daemon)
  bench      daemon A: consecutive and scattered blocks, byte-exact store
             behind a writing stream and load behind a reading stream,
             throughput beside plain pinned copies (gpucheck bench)
  torch      daemon A: real torch tensors through the connector's exporter,
             IPC events, an engine killed mid-store (torch_check.py)
  shutdown   daemon A: SIGTERM, exit 0, only the expected errors logged
  sticky     daemon B (--cuda-fault-after-batches): a device fault on
             purpose; the job fails, the daemon stops serving and exits
             non-zero saying why (skipped under MPS, where a fault can reach
             other clients)
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

# libcuda symbols kvoffloadd and gpucheck call; the others the binaries
# import come from gorgonia.org/cu's wrappers and are never called.
CALLED = {
    "cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetAttribute", "cuDeviceGetName",
    "cuDeviceGetUuid_v2", "cuDeviceGetPCIBusId", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuCtxSynchronize", "cuStreamCreate", "cuStreamDestroy_v2",
    "cuStreamSynchronize", "cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventSynchronize", "cuEventDestroy_v2",
    "cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle", "cuIpcGetEventHandle", "cuIpcOpenEventHandle",
    "cuMemGetAddressRange_v2", "cuPointerGetAttribute", "cuMemHostRegister_v2", "cuMemHostUnregister",
    "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpy2DAsync_v2", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2",
    "cuMemAlloc_v2", "cuMemFree_v2", "cuMemsetD32_v2", "cuGetProcAddress", "cuGetErrorName", "cuLaunchHostFunc",
    "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel",
}

EXPECTED_ERRORS = (
    "did not complete within",  # the killed engine's store, failed at the ready timeout
)


class Check:
    def __init__(self, args):
        self.args = args
        self.out = args.out
        self.results: dict = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "host": socket.gethostname(), "phases": {}}
        self.lines: list[str] = []
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget

    def left(self, want: float) -> float:
        """want seconds, or what is left of the whole run's budget."""
        return max(1.0, min(want, self.deadline - time.monotonic()))

    def phase(self, name: str, ok: bool | None, line: str, data: dict | None = None) -> None:
        status = "ok" if ok else ("skip" if ok is None else "FAIL")
        self.results["phases"][name] = {"status": status, "summary": line, **(data or {})}
        self.lines.append(f"{name:<9} {status:<4} {line}")
        print(f"gpu-check: {name}: {status}: {line}", flush=True)

    def run(self, name: str, cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        log = open(os.path.join(self.out, f"{name}.log"), "w")
        print(f"gpu-check: {name}: {' '.join(cmd)}", flush=True)
        timeout = self.left(timeout)
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, **kw)
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            if isinstance(out, bytes):
                out = out.decode(errors="replace")
            log.write(out)
            log.close()
            return subprocess.CompletedProcess(cmd, 124, out + f"\n(killed after {timeout:.0f} s)\n")
        log.write(p.stdout)
        log.close()
        sys.stdout.write(p.stdout)
        return p


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"pass": False, "failures": [f"no result ({e})"], "data": {}}


def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({e})"


def preflight(c: Check) -> bool:
    a = c.args
    data: dict = {}
    data["nvidia_smi"] = sh(["nvidia-smi", "--query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total,compute_mode",
                             "--format=csv,noheader"])
    data["mps"] = bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) or os.path.exists("/tmp/nvidia-mps/control")
    data["libcuda"] = a.libcuda
    data["python"] = sys.version.split()[0]
    versions = sh([a.python, "-c", "import torch, grpc, google.protobuf as p; "
                   "print(torch.__version__, torch.version.cuda, grpc.__version__, p.__version__, torch.cuda.is_available(), torch.cuda.device_count())"])
    data["torch_grpc_protobuf"] = versions
    versions = versions.splitlines()[-1] if versions else ""
    for f in ("BUNDLE", "VERSION"):
        p = os.path.join(a.bundle, f)
        if os.path.exists(p):
            data[f.lower()] = open(p).read().strip()
    problems = []
    try:
        lib = ctypes.CDLL(a.libcuda)
        ver = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(ver))
        data["driver_api_version"] = ver.value
    except OSError as e:
        problems.append(f"cannot load {a.libcuda}: {e}")
        lib = None
    missing_called, missing_other, imported = [], [], []
    sym_file = os.path.join(a.bin, "cuda-symbols.txt")
    if lib is not None and os.path.exists(sym_file):
        imported = [s.strip() for s in open(sym_file) if s.strip()]
        for s in imported:
            if not hasattr(lib, s):
                (missing_called if s in CALLED else missing_other).append(s)
    data["symbols_imported"] = len(imported)
    data["symbols_missing_called"] = missing_called
    data["symbols_missing_uncalled"] = missing_other
    if missing_called:
        problems.append(f"the driver lacks {missing_called}, which the binaries call")
    if not versions or "True" not in versions.split():
        problems.append(f"torch cannot see a GPU or is missing: {versions!r}")
    if "stubs" in a.libcuda:
        problems.append(f"{a.libcuda} is the toolkit's link stub, not the driver")
    gpus = [l for l in data["nvidia_smi"].splitlines() if l.strip()]
    line = (f"{len(gpus)} GPU(s): {gpus[0] if gpus else data['nvidia_smi']}; libcuda {a.libcuda} "
            f"(driver API {data.get('driver_api_version')}); {len(imported)} cu* symbols imported, "
            f"{len(missing_called)} called ones missing, {len(missing_other)} uncalled ones missing; "
            f"torch/CUDA/grpc/protobuf: {versions}")
    if problems:
        line += "; " + "; ".join(problems)
    c.phase("preflight", not problems, line, data)
    c.results["mps"] = data["mps"]
    return not problems


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Daemon:
    def __init__(self, c: Check, name: str, extra: list[str]):
        self.c, self.name = c, name
        self.dir = tempfile.mkdtemp(prefix="kvoffloadd-gpucheck-")  # 0700: the daemon wants a private directory
        self.socket = os.path.join(self.dir, "kvoffloadd.sock")
        self.port = free_port()
        self.metrics = f"http://127.0.0.1:{self.port}/metrics"
        self.log_path = os.path.join(c.out, f"daemon-{name}.log")
        self.log = open(self.log_path, "w")
        cmd = [os.path.join(c.args.bin, "kvoffloadd"), "--socket", self.socket, "--cpu-bytes", c.args.cpu_bytes,
               "--metrics-addr", f"127.0.0.1:{self.port}", "--log-format", "json", "--shutdown-timeout", "20s"] + extra
        print(f"gpu-check: daemon {name}: {' '.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_socket(self, timeout: float = 60) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            if os.path.exists(self.socket):
                return True
            time.sleep(0.05)
        return False

    def scrape(self) -> dict:
        out = {}
        try:
            with urllib.request.urlopen(self.metrics, timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("kvoffload_cuda") or line.startswith("kvoffload_dma"):
                        k, _, v = line.rpartition(" ")
                        out[k] = float(v)
        except OSError as e:
            out["error"] = str(e)
        return out

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, and the exit status (killed after timeout: -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.exited(timeout)

    def exited(self, timeout: float) -> int | None:
        """Waits for the daemon to exit by itself; None if it did not (it is
        killed then)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def last_line(self) -> str:
        try:
            lines = [l.strip() for l in open(self.log_path) if l.strip()]
        except OSError:
            return "no log"
        return (lines[-1] if lines else "empty log") + f" ({self.log_path})"

    def records(self) -> list[dict]:
        recs = []
        with open(self.log_path) as f:
            for line in f:
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    recs.append({"level": "RAW", "msg": line.strip()})
        return recs


def bench_line(r: dict) -> str:
    parts = []
    for cs in r.get("data", {}).get("cases", []) or []:
        name = cs.get("case", {}).get("name", "?")
        if "store_ratio" not in cs:
            parts.append(f"{name}: correct={cs.get('correct')}")
            continue
        s = (f"{name}: store {cs['daemon_store_gbps']:.1f} GB/s = {cs['store_ratio']:.2f} of plain "
             f"({cs['plain_d2h_gbps']:.1f}), load {cs['daemon_load_gbps']:.1f} = {cs['load_ratio']:.2f} of plain ({cs['plain_h2d_gbps']:.1f})")
        if "contiguous_d2h_gbps" in cs:
            s += f", store {cs['store_of_contiguous']:.2f} of contiguous ({cs['contiguous_d2h_gbps']:.1f})"
        s += f", byte-exact {cs.get('correct')}"
        parts.append(s)
    return "; ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True, help="directory of kvoffloadd, gpucheck and cuda-symbols.txt")
    p.add_argument("--bundle", default="", help="the bundle's directory (BUNDLE, VERSION)")
    p.add_argument("--pythonpath", required=True, help="directory holding the kvoffload package")
    p.add_argument("--libcuda", required=True, help="the driver's libcuda.so.1")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", default="")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--min-ratio", type=float, default=0.9)
    p.add_argument("--cpu-bytes", default="4GiB")
    p.add_argument("--skip-sticky", action="store_true")
    p.add_argument("--budget", type=float, default=285, help="seconds for the whole run; phases are cut short to fit")
    a = p.parse_args()
    if not a.out:
        a.out = os.path.abspath(f"gpu-check-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(a.out, exist_ok=True)
    c = Check(a)
    env = dict(os.environ, PYTHONPATH=a.pythonpath + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if not env["CUDA_VISIBLE_DEVICES"]:
        del env["CUDA_VISIBLE_DEVICES"]
    gc = os.path.join(a.bin, "gpucheck")

    preflight(c)

    r = c.run("probe", [gc, "probe", "--device", str(a.device), "--json", os.path.join(a.out, "probe.json")], 90, env=env)
    pr = read_json(os.path.join(a.out, "probe.json"))
    if not os.path.exists(os.path.join(a.out, "probe.json")):
        pr["failures"] = [f"exit {r.returncode}: " + (r.stdout.strip().splitlines() or ["no output"])[-1]]
    d = pr.get("data", {})
    c.phase("probe", r.returncode == 0 and pr.get("pass"),
            f"IPC memory+event across processes, host registration, device by UUID: {'ok' if pr.get('pass') else pr.get('failures')}; "
            f"driver {d.get('driver_version')}, cuMemcpyBatchAsync {d.get('memcpy_batch')}", pr)

    da = Daemon(c, "a", ["--cuda-ready-timeout", "3s"])
    if not da.wait_socket():
        da.stop()
        c.phase("bench", False, f"daemon A did not start (exit {da.proc.poll()}): {da.last_line()}")
    else:
        r = c.run("bench", [gc, "bench", "--socket", da.socket, "--device", str(a.device), "--min-ratio", str(a.min_ratio),
                            "--json", os.path.join(a.out, "bench.json")], 180, env=env)
        br = read_json(os.path.join(a.out, "bench.json"))
        br["metrics_after"] = da.scrape()
        ratio_only = r.returncode == 2
        c.phase("bench", r.returncode == 0, bench_line(br) + (f"; below --min-ratio {a.min_ratio}" if ratio_only else "")
                + ("" if r.returncode in (0, 2) else f"; {br.get('failures')}"), br)
        c.results["ratio_only_failure"] = ratio_only

        r = c.run("torch", [a.python, os.path.join(HERE, "torch_check.py"), "--socket", da.socket, "--device", str(a.device),
                            "--metrics", da.metrics, "--ready-timeout", "3", "--json", os.path.join(a.out, "torch.json")], 150, env=env)
        tr = read_json(os.path.join(a.out, "torch.json"))
        td = tr.get("data", {})
        ex, kd = td.get("export", {}), td.get("killed_engine", {})
        line = (f"torch {td.get('torch')}: handle {ex.get('handle_bytes')} bytes ({ex.get('handle_form')}), "
                f"{ex.get('share_cuda_calls')} _share_cuda_ for {ex.get('regions')} regions; "
                f"round trips {[x.get('case') for x in td.get('round_trips', [])]} byte-exact behind writing/reading streams; "
                f"killed engine: store failed by {kd.get('failed_by')} after {kd.get('failed_after_s')} s, "
                f"{kd.get('killed_engine_blocks_ready')} blocks ready")
        if not tr.get("pass"):
            line += f"; {tr.get('failures')}"
        tr["metrics_after"] = da.scrape()
        c.phase("torch", r.returncode == 0 and tr.get("pass"), line, tr)

        code = da.stop(c.left(60))
        errors = [x for x in da.records() if x.get("level") == "ERROR"]
        unexpected = [x for x in errors if not any(e in json.dumps(x) for e in EXPECTED_ERRORS)]
        c.phase("shutdown", code == 0 and not unexpected,
                f"daemon A exit {code} on SIGTERM; {len(errors)} ERROR lines, {len(unexpected)} unexpected"
                + (f": {[u.get('msg') for u in unexpected[:3]]}" if unexpected else ""),
                {"exit": code, "errors": errors[:20]})

    if a.skip_sticky or c.results.get("mps") or c.deadline - time.monotonic() < 60:
        why = ("--skip-sticky" if a.skip_sticky else "MPS is active: a fault could reach other clients" if c.results.get("mps")
               else "less than a minute of the budget left")
        c.phase("sticky", None, f"skipped ({why})")
    else:
        db = Daemon(c, "b", ["--cuda-fault-after-batches", "2"])
        if not db.wait_socket():
            db.stop()
            c.phase("sticky", False, f"daemon B did not start (exit {db.proc.poll()}): {db.last_line()}")
        else:
            r = c.run("sticky", [gc, "sticky", "--socket", db.socket, "--device", str(a.device),
                                 "--json", os.path.join(a.out, "sticky.json")], 90, env=env)
            sr = read_json(os.path.join(a.out, "sticky.json"))
            code = db.exited(c.left(40))  # it must exit by itself
            recs = db.records()
            text = "\n".join(json.dumps(x) for x in recs)
            lost = "CUDA context lost" in text
            said = "copy engine failed" in text
            ok = r.returncode == 0 and sr.get("pass") and code not in (0, None) and lost and said
            sd = sr.get("data", {})
            c.phase("sticky", ok, f"store {sd.get('failed_store')} failed ({sd.get('failure')}); health after: {sd.get('health_after')}; "
                    f"daemon B exit {code}; log says context lost: {lost}, engine failed: {said}"
                    + ("" if sr.get("pass") else f"; {sr.get('failures')}"), {**sr, "exit": code})

    phases = c.results["phases"]
    failed = [n for n, v in phases.items() if v["status"] == "FAIL"]
    c.results["pass"] = not failed
    c.results["seconds"] = round(time.monotonic() - c.t0, 1)
    head = (f"kvoffloadd GPU check: {'PASS' if not failed else 'FAIL (' + ', '.join(failed) + ')'} "
            f"in {c.results['seconds']} s on {c.results['host']} at {c.results['started']}")
    summary = head + "\n" + "\n".join(c.lines) + f"\nfull results: {os.path.join(a.out, 'results.json')}\n"
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(c.results, f, indent=2, default=str)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(summary)
    print("\n" + summary)
    if not failed:
        return 0
    return 2 if failed == ["bench"] and c.results.get("ratio_only_failure") else 1


if __name__ == "__main__":
    sys.exit(main())
