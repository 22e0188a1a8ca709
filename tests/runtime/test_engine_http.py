"""The hf engine and the client speak the engine contract over real HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rljob.engine.client import EngineClient, EngineError
from rljob.engine.hf_server import HFEngine, ServerThread
from rljob.model.tiny_model import MAX_POSITIONS, write_tiny
from rljob.weightsync.auth import bearer, peer_key
from rljob.weightsync.protocol import plan_buckets, unpack_bucket
from rljob.weightsync.wire import encode_named_tensors, flat_span
from rljob_api.spec import TinyModel
from tests.runtime.engine_progress import GenerationProgress

pytestmark = pytest.mark.runtime


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    model = write_tiny(tmp_path / "m", TinyModel(), "0123456789+=", 1, "float32")
    srv = ServerThread(HFEngine(str(model), "float32", "cpu", "0"))
    try:
        yield srv
    finally:
        srv.stop()


def test_generate_shape_seeding_and_stop(server: ServerThread) -> None:
    async def go() -> None:
        async with EngineClient(server.url) as c:
            c.wait_healthy(30)
            info = c.model_info()
            assert info["is_generation"] is True and info["weight_version"] == "0"
            params = {"max_new_tokens": 6, "sampling_seed": 11, "temperature": 1.0}
            a = await c.generate([4, 5, 6], params)
            b = await c.generate([4, 5, 6], params)
            assert a == b  # same seed, same weights → same tokens and log-probs
            meta = a["meta_info"]
            assert meta["completion_tokens"] == len(a["output_ids"])
            assert [t for _, t, _ in meta["output_token_logprobs"]] == a["output_ids"]
            assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
            assert meta["finish_reason"]["type"] in ("stop", "length")
            greedy = await c.generate([4, 5, 6], {"max_new_tokens": 3, "temperature": 0,
                                                  "ignore_eos": True})
            assert greedy["meta_info"]["finish_reason"] == {"type": "length", "length": 3}

    asyncio.run(go())


async def _until_generating(progress: GenerationProgress, task: asyncio.Task[object],
                            tokens: int) -> None:
    """Poll (deadline 30 s) until the engine's running generation has `tokens` tokens."""
    deadline = time.monotonic() + 30
    while progress.tokens < tokens:
        assert not task.done(), f"the generation ended before {tokens} tokens: {task.result()}"
        assert time.monotonic() < deadline, "the engine never started generating"
        await asyncio.sleep(0.005)


def test_abort_all_stops_a_running_generation_between_tokens(server: ServerThread) -> None:
    """SGLang's `/abort_request` with abort_all: the running generation answers at once with
    the tokens it has and finish_reason abort; a request after the abort runs normally."""
    longest = MAX_POSITIONS - 8
    progress = GenerationProgress(server.engine)
    params = {"max_new_tokens": longest, "sampling_seed": 5, "temperature": 1.0,
              "ignore_eos": True}

    async def go() -> None:
        async with EngineClient(server.url) as c:
            c.wait_healthy(30)
            running = asyncio.create_task(c.generate([4, 5, 6], params))
            await _until_generating(progress, running, 3)
            await c.abort_all()
            cut = await running
            meta = cut["meta_info"]
            assert meta["finish_reason"]["type"] == "abort"
            got = cut["output_ids"]
            assert 3 <= len(got) < longest
            assert [t for _, t, _ in meta["output_token_logprobs"]] == got
            assert meta["completion_tokens"] == len(got) and meta["weight_version"] == "0"
            # the partial answer is what the same request generates up to the cut
            again = await c.generate([4, 5, 6], dict(params, max_new_tokens=len(got) + 4))
            assert again["meta_info"]["finish_reason"] == {"type": "length",
                                                          "length": len(got) + 4}
            assert again["output_ids"][: len(got)] == got
            assert [lp for lp, _, _ in again["meta_info"]["output_token_logprobs"]][
                : len(got)] == [lp for lp, _, _ in meta["output_token_logprobs"]]
            # continuing from prompt + partial answer (what partial rollout sends) works too
            more = await c.generate([4, 5, 6, *got], dict(params, max_new_tokens=5))
            assert more["meta_info"]["finish_reason"] == {"type": "length", "length": 5}

    asyncio.run(go())
    request = urllib.request.Request(server.url + "/abort_request", method="POST",
                                     data=json.dumps({"rid": "r1"}).encode(),
                                     headers={"Content-Type": "application/json",
                                              **bearer(peer_key())})
    with pytest.raises(urllib.error.HTTPError) as refused:  # no request ids in this engine
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400 and b"abort_all" in refused.value.read()


def _post_raw(url: str, body: bytes, key: str | None = None) -> tuple[int, dict[str, str]]:
    """POST `body` as it is, with the job's key (or `key`, "" for none); the status and the
    JSON answer, also of an error status."""
    key = peer_key() if key is None else key
    request = urllib.request.Request(url, method="POST", data=body,
                                     headers={"Content-Type": "application/json",
                                              **(bearer(key) if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")
        try:
            return err.code, json.loads(text)
        except ValueError:  # aiohttp's own error page, e.g. of a 500
            return err.code, {"error": text}


def test_a_body_that_is_not_json_is_refused_with_the_expected_body(
        server: ServerThread) -> None:
    """A malformed body is the caller's mistake: 400 naming the body to send, not a 500."""
    for body in (b"abort everything", b'{"abort_all": tru', b"\xff\xfe"):
        code, answer = _post_raw(server.url + "/abort_request", body)
        assert code == 400, (body, code, answer)
        assert '{"abort_all": true}' in answer["error"] and '{"rid": ...}' in answer["error"]
        assert "not JSON" in answer["error"]
    code, answer = _post_raw(server.url + "/generate", b"[4, 5")
    assert code == 400 and '"input_ids"' in answer["error"], answer
    code, answer = _post_raw(server.url + "/generate", b"[4, 5, 6]")
    assert code == 400 and "JSON object" in answer["error"], answer
    # the engine still serves a well-formed abort and generation afterwards
    assert _post_raw(server.url + "/abort_request", b'{"abort_all": true}')[0] == 200
    code, answer = _post_raw(server.url + "/generate", json.dumps(
        {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2}}).encode())
    assert code == 200 and len(answer["output_ids"]) >= 1


class _Touch:
    """A pickle that creates `path` when it is unpickled: what a stranger's weight update
    could do to an engine that unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


def test_an_engine_refuses_requests_without_the_jobs_key_before_reading_them(
        server: ServerThread, tmp_path: Path) -> None:
    """Without the job's key, or with another one, every route but /health answers 401 and
    the body is never read: a weight update whose unpickling would create a file creates
    none. With the key the same body is unpickled (the file appears, which is what a
    stranger could otherwise do), and the engine serves as before."""
    marker = tmp_path / "unpickled"
    evil = base64.b64encode(pickle.dumps(_Touch(marker))).decode()
    update = json.dumps({"serialized_named_tensors": [evil], "weight_version": "9"}).encode()
    generate = json.dumps({"input_ids": [4, 5, 6],
                           "sampling_params": {"max_new_tokens": 2}}).encode()
    for key in ("", "f" * 64, peer_key()[:-1]):
        for path, body in (("/update_weights_from_tensor", update), ("/generate", generate),
                           ("/update_weights_from_disk", b'{"model_path": "/"}'),
                           ("/abort_request", b'{"abort_all": true}')):
            code, answer = _post_raw(server.url + path, body, key=key)
            assert code == 401 and "Unauthorized" in answer["error"], (path, code, answer)
        for path in ("/get_model_info", "/get_server_info"):
            request = urllib.request.Request(server.url + path,
                                             headers=bearer(key) if key else {})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 401, path
    assert not marker.exists(), "an unauthenticated body was unpickled"
    assert server.engine.weight_version == "0"
    with urllib.request.urlopen(server.url + "/health", timeout=10) as answer:  # liveness only
        assert answer.status == 200
    # An EngineClient with another key is refused too, and says so.
    with pytest.raises(EngineError, match="401"):
        EngineClient(server.url, api_key="0" * 64).server_info()

    code, answer = _post_raw(server.url + "/update_weights_from_tensor", update)
    assert code == 200 and not answer["success"], answer  # not tensors: refused after...
    assert marker.exists(), "...being unpickled: the key is all that stands in the way"
    code, answer = _post_raw(server.url + "/generate", generate)
    assert code == 200 and len(answer["output_ids"]) >= 1


def test_weight_updates_are_checked_and_atomic(server: ServerThread, tmp_path: Path) -> None:
    state = server.engine.model.state_dict()
    halved = [(k, v.detach().clone() * 0.5) for k, v in state.items()]

    async def go() -> None:
        async with EngineClient(server.url) as c:
            assert c.update_from_tensor([encode_named_tensors(halved)], "1", 60).success
            assert c.weight_version() == "1"
            name = halved[0][0]
            bad = [(halved[1][0], halved[1][1] + 1),
                   (name, torch.full_like(halved[0][1], float("nan")))]
            refused = c.update_from_tensor([encode_named_tensors(bad)], "2", 60)
            assert not refused.success and "non-finite" in refused.message
            wrong = [(name, torch.zeros(2))]
            refused = c.update_from_tensor([encode_named_tensors(wrong)], "2", 60)
            assert not refused.success and "shape" in refused.message
            assert c.weight_version() == "1"
            # nothing of the rejected update was installed, not even its valid tensor
            assert torch.equal(server.engine.model.state_dict()[halved[1][0]], halved[1][1])
            disk = tmp_path / "v3"
            disk.mkdir()
            save_file({k: v * 2 for k, v in halved}, str(disk / "model.safetensors"))
            assert c.update_from_disk(str(disk), "3", 60).success
            assert c.weight_version() == "3"
            out = await c.generate([4], {"max_new_tokens": 1})
            assert out["meta_info"]["weight_version"] == "3"

    asyncio.run(go())
    assert torch.equal(server.engine.model.state_dict()[halved[0][0]], state[halved[0][0]])


def test_pause_holds_generation_until_continue(server: ServerThread) -> None:
    async def go() -> None:
        async with EngineClient(server.url) as c:
            c.pause_generation()
            pending = asyncio.ensure_future(c.generate([4], {"max_new_tokens": 1}))
            done, _ = await asyncio.wait({pending}, timeout=0.5)
            assert not done  # held while paused
            c.continue_generation()
            assert (await pending)["meta_info"]["completion_tokens"] == 1

    asyncio.run(go())


def test_weights_by_name_reads_parameters_back_exactly(server: ServerThread) -> None:
    state = server.engine.model.state_dict()
    name = next(iter(state))

    full = _post(server.url, "/get_weights_by_name", {"name": name, "truncate_size": 10**6})[1]
    head = _post(server.url, "/get_weights_by_name", {"name": name, "truncate_size": 2})[1]
    status, body = _post(server.url, "/get_weights_by_name", {"name": "no.such.weight"})
    missing = f"{status} {body}"
    assert torch.equal(torch.tensor(full, dtype=state[name].dtype), state[name])
    assert torch.equal(torch.tensor(head, dtype=state[name].dtype), state[name][:2])
    assert missing.startswith("400") and "no.such.weight" in missing


def _post(url: str, path: str, body: object) -> tuple[int, object]:
    """A plain HTTP POST, past the client's own checks, to see what the engine says."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **bearer(peer_key())})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _read_back(url: str, name: str) -> torch.Tensor:
    return torch.tensor(_post(url, "/get_weights_by_name",
                              {"name": name, "truncate_size": 10**6})[1])


def test_a_tp_engine_gives_rank_r_entry_r_as_sglang_does(tmp_path: Path) -> None:
    """`serialized_named_tensors[r]` is what TP rank r loads (SGLang's tp_worker indexes the
    list by rank); each rank keeps its own row block, so two entries of different values
    show up half and half, a list for fewer ranks is refused, and EngineClient (the sidecar's
    client) sends every rank its own entry (tests/runtime/test_tp_engine_slots.py shows why,
    across processes)."""
    model = write_tiny(tmp_path / "m", TinyModel(), "0123456789+=", 1, "float32")
    srv = ServerThread(HFEngine(str(model), "float32", "cpu", "0", tp_size=2))
    try:
        state = {k: v.detach().clone() for k, v in srv.engine.model.state_dict().items()}
        name = next(k for k, v in state.items() if v.dim() == 2 and v.shape[0] >= 2)
        half = state[name].shape[0] // 2 + state[name].shape[0] % 2  # tensor_split's first block
        low = [(k, v * 0.5) for k, v in state.items()]
        high = [(k, v * 2.0) for k, v in state.items()]
        http = EngineClient(srv.url)
        assert http.tp_size() == 2

        def raw(entries: list[str], version: str) -> None:
            status, body = _post(srv.url, "/update_weights_from_tensor", {
                "serialized_named_tensors": entries, "flush_cache": True,
                "weight_version": version})
            if status != 200 or not isinstance(body, dict) or body.get("success") is not True:
                raise EngineError(srv.url, "/update_weights_from_tensor", f"refused: {body}")

        raw([encode_named_tensors(low), encode_named_tensors(high)], "1")
        got = _read_back(srv.url, name)
        assert torch.equal(got[:half], state[name][:half] * 0.5)
        assert torch.equal(got[half:], state[name][half:] * 2.0)
        assert http.weight_version() == "1"

        with pytest.raises(EngineError, match="1 entries for 2 tensor-parallel ranks"):
            raw([encode_named_tensors(high)], "2")
        with pytest.raises(EngineError, match="rank 1 was sent other tensors than rank 0"):
            raw([encode_named_tensors(high), encode_named_tensors(high[1:])], "2")
        assert http.weight_version() == "1"
        assert torch.equal(_read_back(srv.url, name)[half:], state[name][half:] * 2.0)

        result = http.update_from_rank_tensors([low, low], "3", 60)
        assert result.success, result.message
        assert http.weight_version() == "3"
        assert torch.equal(_read_back(srv.url, name), state[name] * 0.5)
        for count in (1, 3):
            with pytest.raises(EngineError, match=f"{count} serialized_named_tensors entries "
                               "for an engine of 2 tensor-parallel ranks; send one per rank"):
                http.update_from_tensor([encode_named_tensors(high)] * count, "4", 60)
        assert http.weight_version() == "3"
    finally:
        srv.stop()


def _staging(state: dict[str, torch.Tensor], scale: float = 0.0,
             ) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """A version staged as the sidecar stages one: views of one buffer (in 1 MiB buckets),
    holding `state` times `scale`."""
    plan = plan_buckets(list(state.items()), 1 << 20)
    sizes = [b.nbytes for b in plan]
    staging = torch.zeros(sum(sizes), dtype=torch.uint8)
    views = [nt for b, buf in zip(plan, staging.split(sizes), strict=True)
             for nt in unpack_bucket(b, buf)]
    for name, view in views:
        view.copy_(state[name] * scale)
    return staging, views


def test_a_staged_version_goes_as_one_flattened_bucket_over_a_kept_connection(
    server: ServerThread,
) -> None:
    """The sidecar's staging (views of one buffer) reaches a one-rank engine as SGLang's
    flattened bucket, in full and exactly; a second version over the same staging reuses
    the connection and the engine's mapping; the engine switches to a copy of it (one
    buffer of its own); a non-finite one is refused whole."""
    state = {k: v.detach().clone() for k, v in server.engine.model.state_dict().items()}
    staging, views = _staging(state)
    assert flat_span(views) is not None
    http = EngineClient(server.url)
    for version, scale in (("1", 0.5), ("2", 2.0)):
        for name, view in views:
            view.copy_(state[name] * scale)
        result = http.update_from_rank_tensors([views], version, 60)
        assert result.success, result.message
        if version == "1":
            local = http._local.conn.sock.getsockname()
        assert http._local.conn.sock.getsockname() == local
        assert http.weight_version() == version
        got = server.engine.model.state_dict()
        assert all(torch.equal(got[name], state[name] * scale) for name in state)
        storages = {p.untyped_storage().data_ptr() for p in server.engine.model.parameters()}
        assert len(storages) == 1 and staging.data_ptr() not in storages
    views[-1][1].view(-1)[0] = float("nan")
    result = http.update_from_rank_tensors([views], "3", 60)
    assert not result.success and f"{views[-1][0]}: non-finite values" in result.message
    assert http.weight_version() == "2"
    got = server.engine.model.state_dict()
    assert all(torch.equal(got[name], state[name] * 2.0) for name in state)


def test_a_version_goes_into_the_parameters_the_model_has_now(server: ServerThread) -> None:
    """Parameters replaced after the engine started (`load_state_dict(assign=True)`) are the
    ones a version goes into: the engine looks its tensors up at every install."""
    model = server.engine.model
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _, views = _staging(state, 3.0)
    result = EngineClient(server.url).update_from_rank_tensors([views], "1", 60)
    assert result.success, result.message
    got = model.state_dict()
    assert all(torch.equal(got[name], state[name] * 3.0) for name in state)



def test_an_engine_takes_the_names_of_its_state_dict_and_no_other(
    server: ServerThread,
) -> None:
    """A version names what the model's state dict names (tied names included); a
    non-persistent buffer such as the rotary inverse frequencies is no parameter."""
    engine = server.engine
    assert set(engine.targets()) == set(engine.model.state_dict())
    extra = [n for n, _ in engine.model.named_buffers() if n not in engine.targets()]
    assert extra, "the tiny model has a non-persistent buffer to try"
    buf = torch.zeros(64)
    result = EngineClient(server.url).update_from_rank_tensors(
        [[(extra[0], buf[: dict(engine.model.named_buffers())[extra[0]].numel()])]], "1", 60)
    assert not result.success and f"unknown parameter {extra[0]}" in result.message
