"""A kvoffloadd that accepts jobs and finishes them only when the test says.

The real daemon finishes a copy in microseconds, so "a store the daemon
accepted and is still reading" cannot be held open on purpose. This one
speaks the same gRPC API on a unix socket: Register, Store and Load accept
every job, and Completions reports a job only once ``finish`` was called for
it. Everything else answers as an empty daemon would.
"""

from __future__ import annotations

import os
import threading
from concurrent import futures

import grpc
import tmpdirs

from kvoffload._proto.kvoffload.v1 import kvoffload_pb2 as pb
from kvoffload._proto.kvoffload.v1 import kvoffload_pb2_grpc as pb_grpc


class FakeDaemon(pb_grpc.KVOffloadServicer):
    def __init__(self):
        self.dir = tmpdirs.make("fake-")
        self.socket = os.path.join(self.dir, "kv.sock")
        self._cv = threading.Condition()
        self.accepted: dict[int, pb.Job] = {}
        self.calls: list[tuple[str, pb.TransferRequest]] = []
        self.hit = False
        # piggyback: answer a Store or Load with ack_seq as the daemon does
        # (nothing finished yet, the accepted jobs pending); else as a
        # daemon from before results rode on the reply (an empty reply).
        self.piggyback = False
        self.leases = 0
        self.done: list[pb.JobResult] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_KVOffloadServicer_to_server(self, self.server)
        self.server.add_generic_rpc_handlers([_Health()])
        self.server.add_insecure_port("unix:" + self.socket)
        self.server.start()

    def finish(self, job_ids=None) -> None:
        """Reports the accepted jobs (all, or ``job_ids``) finished."""
        with self._cv:
            for jid in list(job_ids if job_ids is not None else self.accepted):
                j = self.accepted.pop(jid, None)
                if j is not None:
                    self.done.append(pb.JobResult(job_id=jid, request_id=j.request_id, ok=True,
                                                  blocks=len(j.block_ids)))
            self._cv.notify_all()

    def pending(self) -> list[int]:
        with self._cv:
            return sorted(self.accepted)

    def stop(self) -> None:
        try:
            self.server.stop(0).wait()
        finally:
            tmpdirs.remove(self.dir)

    # -- the API ----------------------------------------------------------

    def Register(self, request, context):
        return pb.RegisterResponse(registration_id=1, namespace_id=1)

    def Unregister(self, request, context):
        return pb.UnregisterResponse()

    def Resolve(self, request, context):
        return pb.ResolveResponse(namespace_ids=[1] * len(request.fingerprints))

    def Lookup(self, request, context):
        """Everything is cached (``hit=True``), with a lease when one is asked."""
        if not self.hit:
            return pb.LookupResponse(ready=0)
        n = len(request.keys.hashes) // 32
        self.leases += 1 if request.lease_ms else 0
        return pb.LookupResponse(ready=n, lease_id=1000 + self.leases if request.lease_ms else 0)

    def _accept(self, request):
        with self._cv:
            for j in request.jobs:
                self.accepted[j.job_id] = j
            if self.piggyback and request.HasField("ack_seq"):
                return pb.TransferResponse(pending=len(self.accepted))
        return pb.TransferResponse()

    def Store(self, request, context):
        self.calls.append(("Store", request))
        return self._accept(request)

    def Load(self, request, context):
        self.calls.append(("Load", request))
        return self._accept(request)

    def Completions(self, request, context):
        with self._cv:
            self._cv.wait_for(lambda: self.done, timeout=min(request.wait_ms, 10_000) / 1000.0)
            out, self.done = self.done, []
            return pb.CompletionsResponse(results=out, pending=len(self.accepted))

    def Invalidate(self, request, context):
        return pb.InvalidateResponse()

    def Stats(self, request, context):
        return pb.StatsResponse()


class _Health(grpc.GenericRpcHandler):
    def service(self, details):
        if details.method != "/grpc.health.v1.Health/Check":
            return None
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"\x08\x01")
