"""Every request rljob sends to an engine, read by SGLang's own code (the pinned release).

The bodies come from the functions `EngineClient` sends through (`rljob.engine.client`).
`tests/sglang_judge.py`, run as an engine process of its own, hands each to the request type
SGLang's route declares, validates it as FastAPI does, and runs a weight install through
SGLang's own TP worker and model runner code with its deserializer and patched torch
reductions; the tensors each rank loaded are compared with those the trainer held. Modules
that import SGLang's kernels are read with `ast` (tests/sglang_source.py), for the pinned
release and for the newest checked one.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from rljob.engine import sglang_release
from rljob.engine.client import EngineClient, generate_body, rank_tensors_body
from rljob.engine.hf_server import HFEngine, ServerThread, build_app
from rljob.engine.sglang_launcher import SGLANG_VERSION, SGLangServer, build_command
from rljob.model.tiny_model import write_tiny
from rljob.weightsync import protocol, wire
from rljob.weightsync.auth import bearer, peer_key
from rljob.weightsync.protocol import pack_bucket, plan_buckets, unpack_bucket
from rljob.weightsync.wire import FLATTENED, flat_span
from rljob_api.spec import TinyModel
from tests.sglang_source import (
    NEWEST,
    RELEASE,
    REPO,
    function,
    module_constant,
    returned_keys,
    route_table,
    server_arg_fields,
)

pytestmark = pytest.mark.unit

BOTH = pytest.mark.parametrize("release", [RELEASE, NEWEST])
# Where a release keeps its model runner's weight-update methods (file, class).
RUNNER = {RELEASE: ("srt/model_executor/model_runner.py", "ModelRunner"),
          NEWEST: ("srt/model_executor/model_runner_components/weight_updater.py",
                   "WeightUpdater")}
VERSION = "7"

# What the runtime sends to an engine: (method, route) for every EngineClient call.
CLIENT_ROUTES = {
    ("GET", "/health"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
    ("POST", "/generate"), ("POST", "/abort_request"), ("POST", "/pause_generation"),
    ("POST", "/continue_generation"), ("POST", "/update_weights_from_tensor"),
    ("POST", "/update_weights_from_disk"), ("POST", "/release_memory_occupation"),
    ("POST", "/resume_memory_occupation"),
}
# The routes the hf engine serves: every one the runtime uses, plus /get_weights_by_name,
# which tests and tools read weights back with, and /flush_cache.
HF_ROUTES = CLIENT_ROUTES | {("POST", "/get_weights_by_name"), ("POST", "/flush_cache")}


def _trainer_tensors(dtypes: list[torch.dtype]) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 6), (6,), (5, 4, 3), (16,)]
    return [(f"model.layers.{i}.w", torch.randn(shapes[i % 4], generator=gen).to(dtype))
            for i, dtype in enumerate(dtypes)]


def _staged(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The sidecar's staging of a version: buckets as views of one shared allocation, each
    tensor a view into its bucket (`Sidecar._buffers`, `unpack_bucket`)."""
    layout = plan_buckets(named, bucket_bytes=200)
    sizes = [b.nbytes for b in layout]
    staging = torch.zeros(sum(sizes), dtype=torch.uint8).share_memory_().split(sizes)
    by_name = dict(named)
    views = []
    for bucket, buf in zip(layout, staging, strict=True):
        pack_bucket(bucket, [by_name[m.name] for m in bucket.tensors], out=buf)
        views += unpack_bucket(bucket, buf)
    return views


def _layout(named: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, list[int]]]:
    return {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named}


BF16 = [torch.bfloat16] * 4
MIXED = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
# case id -> (tensor-parallel ranks, dtypes, staged as the sidecar stages)
TENSOR_CASES = {
    "tp1-flattened": (1, BF16, True),
    "tp1-direct": (1, MIXED, False),
    "tp1-staged-mixed": (1, MIXED, True),
    "tp2": (2, MIXED, True),
    "tp4": (4, BF16, True),
}


LAUNCH_KEY = "c0ffee" * 10


class Judged:
    def __init__(self, answers: dict[str, Any], sent: dict[str, Any]) -> None:
        self.answers = answers
        self.sent = sent


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Judged]:
    """One SGLang engine process reads every case (about 10 s: it imports torch and SGLang)."""
    tmp = tmp_path_factory.mktemp("sglang")
    cases: list[dict[str, Any]] = []
    sent: dict[str, Any] = {}  # kept alive until SGLang has opened their shared memory
    for case, (ranks, dtypes, staged) in TENSOR_CASES.items():
        held = _trainer_tensors(dtypes)
        # Each rank's entry from memory of its own, as a sidecar's copy on each rank's GPU,
        # and of its own values (rank r's scaled by 2**r, exactly): a rank that read another
        # rank's entry would show it.
        per_rank = []
        for rank in range(ranks):
            mine = [(n, t * 2**rank) for n, t in held]
            per_rank.append(_staged(mine) if staged else mine)
        named = per_rank[0]
        body = rank_tensors_body(per_rank, VERSION)
        sent[case] = (held, named, body, per_rank)
        cases.append({"id": case, "route": "/update_weights_from_tensor", "body": body,
                      "tp_size": ranks, "layout": _layout(held)})
    for case, (route, body) in _control_bodies().items():
        cases.append({"id": case, "route": route, "body": body})
    server = SGLangServer(model_path="/models/m", host="0.0.0.0", port=30000, tp_size=2,
                          nccl_port=30100, weight_version="3", memory_saver=True,
                          api_key=LAUNCH_KEY)
    argv = build_command(server, {"mem-fraction-static": "0.7", "enable-memory-saver": "false",
                                  "disable-radix-cache": "true"})
    cases.append({"id": "launch", "argv": argv[3:]})
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, "-m", "tests.sglang_judge", str(tmp / "cases.json"),
                          str(tmp / "out.pt")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    yield Judged(torch.load(tmp / "out.pt", weights_only=False), sent)


# The sampling parameters the rollout worker sends (`RolloutWorker._sampling`), every key.
SAMPLING = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3, "stop": ["\n"]}


def _control_bodies() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every other body the runtime sends, by the function EngineClient sends it through."""
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "disk": ("/update_weights_from_disk", {"model_path": "/ckpt/v7", "weight_version": "7"}),
        "release": ("/release_memory_occupation", {}),
        "resume": ("/resume_memory_occupation", {}),
        "pause": ("/pause_generation", {}),
        "continue": ("/continue_generation", {}),
        "abort": ("/abort_request", {"rid": "", "abort_all": True}),
        "generate": ("/generate", generate_body([4, 5, 6], dict(SAMPLING, sampling_seed=1))),
        # The built-in generate's form for a group's samples on one engine.
        "generate_many": ("/generate", generate_body(
            [[4, 5, 6], [4, 5, 6, 7]],
            [dict(SAMPLING, sampling_seed=1), dict(SAMPLING, sampling_seed=2, max_new_tokens=2)])),
    }
    return bodies


# --- the pins -------------------------------------------------------------------------------


def test_the_pinned_release_is_the_rollout_images_and_the_supported_ranges_ends() -> None:
    import importlib.metadata

    dockerfile = (REPO / "images" / "Dockerfile").read_text()
    base = re.search(r"^ARG ROLLOUT_CUDA_BASE=lmsysorg/sglang:v([0-9.]+)-", dockerfile, re.M)
    assert base is not None and base.group(1) == RELEASE
    assert importlib.metadata.version("sglang") == RELEASE == SGLANG_VERSION
    assert (sglang_release.RELEASE, sglang_release.NEWEST_CHECKED) == (RELEASE, NEWEST)
    reference = (REPO / "docs" / "reference.md").read_text()
    assert f"SGLang {sglang_release.SUPPORTED_RANGE}" in reference
    # The rollout stage (which the colocated one builds on) stops unless the memory saver
    # that --enable-memory-saver loads imports.
    rollout = dockerfile[dockerfile.index("AS base-rollout-cuda"):
                         dockerfile.index("AS base-colocated-cuda")]
    assert re.search(r'python -c "import sys, sglang, torch_memory_saver;', rollout)


# --- update_weights_from_tensor ------------------------------------------------------------


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_each_rank_loads_the_trainers_tensors_through_sglangs_own_code(
        judged: Judged, case: str) -> None:
    ranks, _, _ = TENSOR_CASES[case]
    held, named, _body, _per_rank = judged.sent[case]
    answer = judged.answers[case]
    assert answer["type"] == "UpdateWeightsFromTensorReqInput"
    assert answer["unknown_fields"] == [] and answer["missing_fields"] == []
    validated = answer["validated"]
    assert validated["weight_version"] == VERSION and validated["flush_cache"] is True
    assert len(validated["serialized_named_tensors"]) == ranks
    # One flat handle only where a single rank reads one buffer of one dtype.
    expect_flat = ranks == 1 and flat_span(named) is not None
    assert validated["load_format"] == (FLATTENED if expect_flat else None)
    assert case != "tp1-flattened" or expect_flat
    assert len(answer["loaded"]) == ranks
    for rank, loaded in enumerate(answer["loaded"]):
        assert isinstance(loaded, dict), f"rank {rank}: {loaded}"
        for name, tensor in held:
            assert loaded[name].dtype == tensor.dtype, (rank, name)
            assert torch.equal(loaded[name], tensor * 2**rank), (rank, name)


@BOTH
def test_sglangs_rank_r_reads_entry_r(release: str) -> None:
    """What the client's one-entry-per-rank rule (tests/runtime/test_engine_http.py) rests
    on: SGLang's rank r reads entry r, so a list short of a rank fails in that rank alone."""
    name, read = (("update_weights_from_tensor",
                   "recv_req.serialized_named_tensors[self.tp_rank]") if release == RELEASE
                  else ("deserialize_own_rank",
                        "serialized_named_tensors[get_parallel().tp_rank]"))
    cls = "TpModelWorker" if release == RELEASE else "BaseTpWorker"
    tree = function(release, "srt/managers/tp_worker.py", cls, name)
    assert read in [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Subscript)]


@BOTH
def test_sglang_reads_the_flattened_bucket_by_the_keys_and_attributes_rljob_writes(
        release: str) -> None:
    runner = function(release, *RUNNER[release], "_update_weights_from_flattened_bucket")
    keys = {n.slice.value for n in ast.walk(runner) if isinstance(n, ast.Subscript)
            and isinstance(n.slice, ast.Constant)}
    attrs = {n.attr for n in ast.walk(runner) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id == "meta"}
    assert keys == {"flattened_tensor", "metadata"}
    assert attrs == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}
    # ...which is what wire.encode_flattened writes.
    flat = torch.zeros(10, dtype=torch.bfloat16)
    entry = wire._loads(wire.encode_flattened([("a", flat[:4].view(2, 2)), ("b", flat[4:])],
                                               flat))
    assert set(entry) == keys
    assert {k for m in entry["metadata"] for k in vars(m)} == attrs
    dispatch = function(release, *RUNNER[release], "update_weights_from_tensor")
    assert FLATTENED in {n.value for n in ast.walk(dispatch) if isinstance(n, ast.Constant)}


@BOTH
def test_a_gpu_handle_names_its_device_where_and_as_sglangs_patched_reductions_read_it(
        release: str) -> None:
    """Checked from the source: a CUDA IPC entry cannot be opened on a machine without a
    GPU. SGLang replaces argument 6 of torch's `rebuild_cuda_tensor` (the device) by a
    UUID it formats as `str(get_device_properties(i).uuid)`; rljob writes the same argument
    in the same form (`wire._reduce_by_uuid` with `protocol.gpu_uuid`)."""
    patch = "srt/utils/patch_torch.py"
    assert module_constant(release, patch, "_REDUCE_TENSOR_ARG_DEVICE_INDEX") == \
        wire._CUDA_DEVICE_ARG
    theirs = function(release, patch, None, "_device_to_uuid")
    ours = next(n for n in ast.parse(Path(protocol.__file__).read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name == "gpu_uuid")
    returned = [ast.unparse(n.value) for n in ast.walk(theirs)
                if isinstance(n, ast.Return) and n.value is not None]
    assert returned == ["str(torch.cuda.get_device_properties(device).uuid)"]
    assert returned[0] in [ast.unparse(n.value) for n in ast.walk(ours)
                           if isinstance(n, ast.Return) and n.value is not None]
    # And the receiver accepts a UUID there, or an index: what `_device_from_maybe_uuid` tests.
    reader = function(release, patch, None, "_device_from_maybe_uuid")
    tested = {ast.unparse(n.args[1]) for n in ast.walk(reader) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name) and n.func.id == "isinstance"}
    assert tested == {"int", "str"}


# --- the other bodies ------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["disk", "release", "resume", "abort", "generate",
                                  "generate_many"])
def test_sglangs_request_type_takes_every_field_as_sent(judged: Judged, case: str) -> None:
    answer = judged.answers[case]
    assert answer["type"] not in (None, "absent"), answer
    assert "invalid" not in answer, answer.get("invalid")
    assert answer["unknown_fields"] == [] and answer["missing_fields"] == []


def test_sglang_splits_a_batch_into_one_request_per_prompt_with_its_own_parameters(
        judged: Judged) -> None:
    """The built-in generate's batch (a group's samples on one engine) is n requests to
    SGLang, each with its prompt and its own seed and limit, as n single requests were."""
    _, body = _control_bodies()["generate_many"]
    rows = judged.answers["generate_many"]["rows"]
    assert [r["input_ids"] for r in rows] == body["input_ids"]
    assert [r["sampling_params"] for r in rows] == body["sampling_params"]
    (single,) = judged.answers["generate"]["rows"]
    assert single["sampling_params"] == _control_bodies()["generate"][1]["sampling_params"]


@BOTH
def test_release_and_resume_without_tags_free_the_releases_default_set(release: str) -> None:
    """rljob sends `{}`: tags None, which SGLang reads as its own default set. 0.5.3 frees
    weights and KV cache (it has no CUDA-graph tag); later releases everything they tag."""
    mixin, cls = (("srt/managers/scheduler_update_weights_mixin.py",
                   "SchedulerUpdateWeightsMixin") if release == RELEASE
                  else ("srt/managers/scheduler_components/weight_updater.py",
                        "SchedulerWeightUpdaterManager"))
    for name in ("release_memory_occupation", "resume_memory_occupation"):
        fn = function(release, mixin, cls, name)
        defaults = [ast.unparse(n.body[0].value) for n in ast.walk(fn) if isinstance(n, ast.If)
                    and isinstance(n.body[0], ast.Assign)
                    and ast.unparse(n.test) == "tags is None or len(tags) == 0"]
        expected = ("[GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE]" if release == RELEASE
                    else "GPU_MEMORY_ALL_TYPES")
        assert defaults == [expected], (release, name, defaults)


def test_release_resume_and_pause_bodies_read_as_sglang_reads_them(judged: Judged) -> None:
    for case in ("release", "resume"):
        assert judged.answers[case]["validated"]["tags"] is None
    # 0.5.3's pause and continue read no body; its pause aborts what runs (below).
    assert judged.answers["pause"]["type"] is None
    assert judged.answers["continue"]["type"] is None
    pause = function(RELEASE, "srt/managers/tokenizer_manager.py", "TokenizerManager",
                     "pause_generation")
    assert "self.abort_request(abort_all=True)" in ast.unparse(pause)


def test_the_launch_command_parses_with_sglangs_own_arguments(judged: Judged) -> None:
    args = judged.answers["launch"]
    assert args["enable_memory_saver"] is True  # colocated: release/resume can free memory
    assert (args["tensor_parallel_size"], args["port"], args["nccl_port"]) == (2, 30000, 30100)
    assert (args["model_path"], args["weight_version"]) == ("/models/m", "3")
    assert args["mem_fraction_static"] == 0.7 and args["disable_radix_cache"] is True
    assert args["api_key"] == LAUNCH_KEY  # every route but /health needs the job's key


def test_sglangs_own_key_check_lets_in_what_the_client_sends_and_nothing_else(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's `--api-key` middleware (the pinned release's own function) on a server with
    its guarded routes: the header EngineClient sends passes, none or another key gets 401
    before the route runs, and /health (which start-up polls without a key) stays open."""
    from fastapi import FastAPI
    from sglang.srt.utils import common
    from sglang.srt.utils.common import add_api_key_middleware
    from starlette.responses import JSONResponse
    from starlette.testclient import TestClient

    # Its 401 is an ORJSONResponse, which needs orjson (in the rollout image, not here).
    monkeypatch.setattr(common, "ORJSONResponse", JSONResponse)

    reached: list[str] = []
    app = FastAPI()

    @app.post("/update_weights_from_tensor")
    async def update() -> dict[str, bool]:
        reached.append("update")
        return {"success": True}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    add_api_key_middleware(app, LAUNCH_KEY)
    client = EngineClient("http://127.0.0.1:1", api_key=LAUNCH_KEY)
    with TestClient(app) as http:
        for headers in ({}, bearer("0" * 64), {"Authorization": LAUNCH_KEY}):
            assert http.post("/update_weights_from_tensor", json={},
                             headers=headers).status_code == 401
        assert reached == []
        assert http.get("/health").status_code == 200
        answer = http.post("/update_weights_from_tensor", json={}, headers=client._auth)
        assert answer.status_code == 200 and reached == ["update"]


# --- routes ----------------------------------------------------------------------------------


@BOTH
def test_every_route_the_runtime_uses_is_served_with_its_method(release: str) -> None:
    table = route_table(release)
    missing = sorted((m, p) for m, p in CLIENT_ROUTES
                     if p not in table or m not in table[p].methods)
    assert missing == []


@BOTH
def test_the_answers_carry_the_fields_the_runtime_reads(release: str) -> None:
    table = route_table(release)
    # get_model_info is an alias of model_info in later releases.
    info = table.get("/model_info", table["/get_model_info"]).handler
    assert "weight_version" in returned_keys(info)
    server_info = table.get("/server_info", table["/get_server_info"]).handler
    assert "version" in returned_keys(server_info)
    # /get_server_info carries every server argument; the launch sets these.
    owned = {"model_path", "tokenizer_path", "host", "port", "tp_size", "nccl_port",
             "base_gpu_id", "weight_version", "enable_memory_saver", "dtype", "api_key"}
    assert owned - server_arg_fields(release) == set()
    for path in ("/update_weights_from_tensor", "/update_weights_from_disk"):
        assert {"success", "message"} <= returned_keys(table[path].handler)


def test_the_newest_release_dropped_the_weight_version_route_rljob_does_not_use() -> None:
    assert "/get_weight_version" in route_table(RELEASE)
    assert "/get_weight_version" not in route_table(NEWEST)
    assert ("GET", "/get_weight_version") not in CLIENT_ROUTES


@pytest.fixture(scope="module")
def hf_app(tmp_path_factory: pytest.TempPathFactory) -> web.Application:
    model = write_tiny(tmp_path_factory.mktemp("m") / "m", TinyModel(), "0123", 1, "float32")
    return build_app(HFEngine(str(model), "float32", "cpu", "0", tp_size=2), peer_key())


def test_the_hf_engine_serves_sglangs_routes_with_sglangs_methods(
        hf_app: web.Application) -> None:
    served: dict[str, set[str]] = {}
    for route in hf_app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        served.setdefault(path, set()).add(route.method)
    table = route_table(RELEASE)
    for method, path in HF_ROUTES:
        assert method in served.get(path, set()), (method, path)
    # No route of its own: everything it serves SGLang serves, with that method.
    for path, methods in served.items():
        assert path in table and methods - {"HEAD"} <= table[path].methods, (path, methods)


@pytest.fixture
def hf_server(tmp_path: Path) -> Iterator[ServerThread]:
    model = write_tiny(tmp_path / "m", TinyModel(), "0123", 1, "float32")
    srv = ServerThread(HFEngine(str(model), "float32", "cpu", "0", tp_size=2))
    try:
        yield srv
    finally:
        srv.stop()


def test_the_hf_engine_answers_with_the_fields_sglang_answers_with(
        hf_server: ServerThread) -> None:
    client = EngineClient(hf_server.url)
    assert client.check_version() == RELEASE and client.tp_size() == 2
    assert client.weight_version() == "0"
    assert set(client.model_info()) <= returned_keys(route_table(RELEASE)["/get_model_info"]
                                                     .handler)


# --- the release check at connect ---------------------------------------------------------


@pytest.mark.parametrize(("version", "refused"), [
    (RELEASE, False), (NEWEST, False), ("0.5.10", False), (f"{RELEASE}.post1", False),
    ("0.5.2", True), ("0.5.24", True), ("0.6.0", True), ("banana", True), (None, True),
])
def test_a_release_outside_the_range_is_refused_naming_it_and_the_range(
        version: str | None, refused: bool) -> None:
    why = sglang_release.unsupported(version)
    assert bool(why) == refused
    if refused:
        assert sglang_release.SUPPORTED_RANGE in why
        assert version is None or str(version) in why
