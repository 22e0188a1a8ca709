"""Starts one rollout engine inside a Ray actor: the built-in hf server or SGLang.

SGLang is started through `sglang_launcher`, the one place that owns its command line and
its process: the server dies with this actor's process, however that dies, and `stop` ends
every process the server started.
The engine binds `bind_host:port` (port 0 picks a free one); in a pod the port is the one
the pod's weight-sync sidecar is told about, so the sidecar finds its engine on localhost.
Either engine serves only requests carrying the job's peer key (`rljob.weightsync.auth`).
An engine of `tp` slots gets the devices of its further slots (`rljob.engine.slots`): SGLang
runs on all of them, and the `hf` engine keeps the weight-update contract of `tp` ranks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from rljob.engine.client import EngineClient
from rljob.engine.sglang_launcher import EngineStartError, SGLangServer, launch
from rljob.engine.sglang_launcher import stop as stop_server
from rljob.engine.slots import SlotDevices, engine_gpus, here
from rljob.reporting import worker_metrics
from rljob.reporting.locatable import Locatable
from rljob.weightsync.auth import peer_key

if TYPE_CHECKING:
    from rljob.engine.hf_server import ServerThread

STARTUP_TIMEOUT_S = 900.0
# What `EngineProcess.serving` finds.
SERVING, EXITED, SILENT = "serving", "exited", "silent"
# Releasing or resuming an engine's memory moves at most its weights and KV cache.
OCCUPATION_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Locality:
    """An engine's Ray node and its GPUs: Ray's ids of every slot's GPU, first slot first,
    comma-separated as CUDA_VISIBLE_DEVICES takes them ("" on CPU)."""

    node_id: str
    gpus: str


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineProcess(Locatable):
    def __init__(
        self, backend: str, model_dir: str, dtype: str, device: str, weight_version: str,
        tp: int, sglang_args: dict[str, str], bind_host: str, port: int = 0,
        further_slots: list[SlotDevices] | list[ray.ObjectRef[SlotDevices]] | None = None,
        offload: bool = False,
    ) -> None:
        # Where the engine's further slots are, or the slot holders' answers to come: the
        # driver does not wait for them, since a replacement's slots wait for its new pod.
        further: list[SlotDevices] = [
            ray.get(s) if isinstance(s, ray.ObjectRef) else s for s in further_slots or []]
        self.device = device
        self.backend = backend
        self.server: ServerThread | None = None  # the `hf` engine's
        self.proc: subprocess.Popen[bytes] | None = None
        # Loopback stays loopback (a laptop run); otherwise peers reach us on the node's IP.
        advertise = bind_host if bind_host == "127.0.0.1" else ray.util.get_node_ip_address()
        gpus = engine_gpus(here(), further)
        # The GPUs its ranks compute on, rank r on the r-th: SGLang's on every slot, the
        # `hf` engine's all on its first (it keeps the contract of `tp` ranks in one process).
        self.gpus = (gpus if backend != "hf" else gpus[:1]) if device.startswith("cuda") else []
        if backend == "hf":
            # Imported here: the driver creates engines without importing torch.
            from rljob.engine.hf_server import HFEngine, ServerThread

            self.server = ServerThread(HFEngine(model_dir, dtype, device, weight_version, tp),
                                       bind_host, port)
            port = self.server.port
            # The release check every engine gets at connect (SGLang's is in `launch`).
            EngineClient(self.server.url).check_version()
        else:
            if len(gpus) != tp:
                raise EngineStartError(
                    f"SGLang with tp-size {tp} (spec.rollout.gpusPerEngine) needs {tp} GPUs; "
                    f"Ray gave this engine's slots {gpus or 'none'}")
            port = port or _free_port(bind_host)
            server = SGLangServer(
                model_path=model_dir, host=bind_host, port=port, tp_size=tp,
                nccl_port=_free_port(bind_host), weight_version=weight_version,
                python=sys.executable, memory_saver=offload, api_key=peer_key())
            # dtype follows spec.model.dtype unless the user passed one through. Ray showed
            # this actor its first GPU only; the server gets every slot's (rank r on the r-th).
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
            self.proc = launch(server, {"dtype": dtype, **sglang_args}, env=env,
                               startup_deadline_s=STARTUP_TIMEOUT_S)
        self.url = f"http://{advertise}:{port}"
        self.local_url = f"http://{'127.0.0.1' if bind_host == '0.0.0.0' else bind_host}:{port}"
        self.metrics_port = worker_metrics.serve()

    def address(self) -> str:
        return self.url

    def serving(self) -> str:
        """SERVING when the server runs and answers /health; EXITED when it stopped for good
        (SGLang is a process of its own that can die while this actor lives on); SILENT
        when it runs but did not answer (a loaded engine can be slow)."""
        if self.server is not None and not self.server.thread.is_alive():
            return EXITED
        if self.proc is not None and self.proc.poll() is not None:
            return EXITED
        return SERVING if EngineClient(self.local_url).healthy(timeout_s=5.0) else SILENT

    def locality(self) -> Locality:
        """Where this engine runs: its sidecar must run there too (shared memory, the same
        GPUs)."""
        return Locality(str(ray.get_runtime_context().get_node_id()), ",".join(self.gpus))

    def release_memory(self) -> None:
        """Give the GPU to a colocated trainer: weights (and SGLang's KV cache and CUDA
        graphs) leave it until `resume_memory`."""
        if self.server is not None:
            self.server.engine.release_memory()
        else:
            EngineClient(self.local_url).release_memory(OCCUPATION_TIMEOUT_S)

    def resume_memory(self) -> bool:
        """Take the GPU back; True when the weights came back too (the `hf` engine keeps a
        host copy), False when a version must be installed before generating (SGLang
        discards released weights)."""
        if self.server is not None:
            self.server.engine.resume_memory()
            return True
        EngineClient(self.local_url).resume_memory(OCCUPATION_TIMEOUT_S)
        return False

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.proc is not None:
            stop_server(self.proc)
