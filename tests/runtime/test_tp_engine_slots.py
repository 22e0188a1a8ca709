"""An engine of several slots, placed as the driver places it: the engine actor on its first
slot, a SlotHolder holding each further one, and the `hf` engine keeping SGLang's
weight-update contract for as many tensor-parallel ranks as it holds slots, fed from another
process as the sidecar feeds it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rljob.engine.client import EngineClient
from rljob.engine.launcher import EngineProcess
from rljob.engine.sglang_launcher import EngineStartError
from rljob.engine.slots import SlotHolder
from rljob.model.tiny_model import write_tiny
from rljob.reporting import metrics_log
from rljob_api.exits import OK as EXIT_OK
from rljob_api.spec import TinyModel
from tests.polling import wait_for
from tests.processes import reap
from tests.runtime.jobs import job_file
from tests.runtime.test_engine_http import _read_back

pytestmark = pytest.mark.runtime


def test_a_two_slot_engine_holds_both_and_serves_two_ranks(
    ray_local: None, tmp_path: Path
) -> None:
    model = write_tiny(tmp_path / "m", TinyModel(), "0123456789+=", 1, "float32")
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    second = f"CPU_group_1_{pg.id.hex()}"  # what Ray still has free of slot 1

    def at(slot: int) -> dict[str, Any]:
        return {"num_cpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=slot)}

    try:
        wait_for(lambda: ray.available_resources().get(second) == 1.0, timeout=30,
                 what="slot 1 free before its holder exists")
        holder: Any = ray.remote(SlotHolder).options(**at(1)).remote()
        further = ray.get(holder.where.remote(), timeout=60)
        wait_for(lambda: ray.available_resources().get(second, 0.0) == 0.0, timeout=30,
                 what="slot 1 held by the engine's SlotHolder")
        engine: Any = ray.remote(EngineProcess).options(**at(0)).remote(
            "hf", str(model), "float32", "cpu", "0", 2, {}, "127.0.0.1", 0, [further])
        url = ray.get(engine.address.remote(), timeout=120)
        http = EngineClient(url, timeout_s=30)
        assert http.tp_size() == 2
        names = ["model.embed_tokens.weight", "lm_head.weight"]
        before = {n: _read_back(url, n) for n in names}
        # Staging buffers reused version after version, as the sidecar keeps them: each rank
        # must get its own pickle, or the first unpickling frees the shared memory twice
        # and the next version's buffers cannot be opened by the engine.
        staging = [(n, before[n].clone()) for n in names]
        for version, scale in (("1", 0.25), ("2", 0.5), ("3", 2.0)):
            for n, buf in staging:
                buf.copy_(before[n] * scale)
            # Both ranks read the same staging, as on the CPU (`rank_devices.entry_devices`).
            result = http.update_from_rank_tensors([staging, staging], version, 60)
            assert result.success, result.message
            assert http.weight_version() == version
            for n in names:
                assert torch.equal(_read_back(url, n), before[n] * scale)
        ray.get(engine.stop.remote(), timeout=60)
    finally:
        remove_placement_group(pg)


def test_rljob_run_with_two_slot_engines_syncs_every_version(tmp_path: Path) -> None:
    """The driver places each engine of `gpusPerEngine: 2` on two slots, and every weight
    version reaches both engines' two ranks through the sidecar (an entry short of a rank
    would be refused, and the run would fail on the missing acknowledgement)."""
    path = job_file(tmp_path, {"rollout": {"engines": 2, "gpusPerEngine": 2},
                               "algorithm": {"totalSteps": 2}})
    workdir = tmp_path / "w"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rljob.cli", "run", str(path), "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        reap(proc)
    text = out.decode(errors="replace")
    assert proc.returncode == EXIT_OK, text[-4000:]
    assert "engine-1" in text  # two engines were placed
    rows = metrics_log.read(workdir / "metrics.jsonl")
    assert [r["weight_version"] for r in rows] == [1, 2]
    synced = metrics_log.read(workdir / "weight_sync.jsonl")
    assert [(r["version"], sorted(r["acked"])) for r in synced] == [
        (v, ["engine-0", "engine-1"]) for v in range(3)]


def test_sglang_is_not_started_on_fewer_gpus_than_its_tp_size(ray_local: None) -> None:
    """SGLang runs rank r on the r-th of CUDA_VISIBLE_DEVICES: an engine whose slots hold
    fewer GPUs than gpusPerEngine stops before any server starts, saying what Ray gave."""
    node = str(ray.get_runtime_context().get_node_id())
    with pytest.raises(EngineStartError, match=r"tp-size 2 \(spec.rollout.gpusPerEngine\) "
                       r"needs 2 GPUs; Ray gave this engine's slots none"):
        EngineProcess("sglang", "/no/model", "bfloat16", "cuda", "0", 2, {}, "127.0.0.1", 0,
                      [(node, [])])
