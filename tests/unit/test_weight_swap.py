"""`stage_version`: a version is copied and checked beside the served tensors, then switched to;
a refused one leaves them as they were."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rljob.engine.weight_swap import flat_version, stage_version

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def _flat(parts: dict[str, torch.Tensor], gap: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Views of one buffer holding `parts` in order, `gap` NaN elements before each."""
    sizes = [gap + t.numel() for t in parts.values()]
    buf = torch.full((sum(sizes),), float("nan"))
    out, at = [], 0
    for (name, tensor), size in zip(parts.items(), sizes, strict=True):
        view = buf[at + gap: at + size].view(tensor.shape)
        view.copy_(tensor)
        out.append((name, view))
        at += size
    return out


def _install(params: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]]) -> list[str]:
    flat = flat_version(params, named)
    assert flat is not None
    staged = stage_version(params, named, flat)
    if not staged.problems:
        staged.switch()
    return staged.problems


def _params() -> dict[str, torch.Tensor]:
    return {"a": torch.nn.Parameter(torch.zeros(3, 4)), "b": torch.nn.Parameter(torch.zeros(5)),
            "c": torch.nn.Parameter(torch.zeros(5))}


def test_versions_switch_whole_into_one_buffer_of_their_own() -> None:
    params = _params()
    objects = dict(params)
    for v in (1.0, 2.0, 3.0):
        sent = _flat({"a": torch.full((3, 4), v), "b": torch.full((5,), -v)}, gap=3)
        assert _install(params, sent) == []
        assert torch.equal(params["a"], torch.full((3, 4), v))
        assert torch.equal(params["b"], torch.full((5,), -v))
        sent[0][1].fill_(99.0)  # the sender reuses its buffer: the engine holds a copy
        assert torch.equal(params["a"], torch.full((3, 4), v))
    assert all(params[k] is objects[k] for k in params)  # the same Parameters, repointed
    assert params["a"].untyped_storage().data_ptr() == params["b"].untyped_storage().data_ptr()
    assert torch.equal(params["c"], torch.zeros(5))  # not in the version: untouched


def test_a_nonfinite_version_is_refused_and_the_served_one_stays() -> None:
    params = _params()
    for v in (1.0, 2.0):
        assert _install(params, _flat({"a": torch.full((3, 4), v), "b": torch.full((5,), v)})) == []
    bad = torch.ones(5)
    bad[4] = float("inf")
    assert _install(params, _flat({"a": torch.full((3, 4), 7.0), "b": bad})) == [
        "b: non-finite values"]
    assert torch.equal(params["a"], torch.full((3, 4), 2.0))
    assert torch.equal(params["b"], torch.full((5,), 2.0))
    assert _install(params, _flat({"a": torch.full((3, 4), 3.0), "b": torch.ones(5)})) == []
    assert torch.equal(params["a"], torch.full((3, 4), 3.0))


def test_nan_in_the_padding_alone_does_not_refuse_a_version() -> None:
    params = _params()
    assert _install(params, _flat({"a": torch.full((3, 4), 2.0), "b": torch.ones(5)}, gap=7)) == []
    assert torch.equal(params["a"], torch.full((3, 4), 2.0))


def test_tensors_that_do_not_fit_are_named_and_nothing_changes() -> None:
    params = _params()
    assert _install(params, _flat({"a": torch.ones(4, 3), "zz": torch.ones(5)})) == [
        "a: shape (4, 3) != (3, 4)", "unknown parameter zz"]
    assert torch.equal(params["a"], torch.zeros(3, 4))


def test_tensors_a_later_version_leaves_out_keep_their_values() -> None:
    params = _params()
    assert _install(params, _flat({"a": torch.full((3, 4), 1.0), "b": torch.full((5,), 1.0)})) == []
    for v in (3.0, 4.0):
        assert _install(params, _flat({"a": torch.full((3, 4), v), "c": torch.full((5,), v)})) == []
    assert torch.equal(params["b"], torch.full((5,), 1.0))
    assert torch.equal(params["a"], torch.full((3, 4), 4.0))
    assert torch.equal(params["c"], torch.full((5,), 4.0))


def test_tensors_not_in_one_buffer_are_left_to_the_copy_in_place() -> None:
    apart = [("a", torch.ones(3, 4)), ("b", torch.ones(5))]
    assert flat_version(_params(), apart) is None


def test_a_refused_version_cannot_be_switched_to() -> None:
    params = _params()
    named = _flat({"a": torch.ones(4, 3)})
    flat = flat_version(params, named)
    assert flat is not None
    staged = stage_version(params, named, flat)
    with pytest.raises(RuntimeError, match=r"switch to a refused version: a: shape"):
        staged.switch()


_FUSED = r"""
import torch
from rljob.weightsync.checked_copy import _fused_applies
from rljob.engine.weight_swap import flat_version, stage_version

params = {"a": torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16)),
          "b": torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))}
buf = torch.full((40,), float("nan"), dtype=torch.bfloat16)  # NaN padding around both
named = [("a", buf[3:15].view(3, 4)), ("b", buf[20:25])]
named[0][1].fill_(2.0)
named[1][1].fill_(-1.0)
flat = flat_version(params, named)
assert flat is not None and _fused_applies(flat.reshape(-1), torch.empty_like(flat))
staged = stage_version(params, named, flat)
assert staged.problems == [], staged.problems  # NaN in the padding alone
staged.switch()
assert bool((params["a"] == 2.0).all()) and bool((params["b"] == -1.0).all())
named[1][1][4] = float("inf")
assert stage_version(params, named, flat).problems == ["b: non-finite values"]
assert bool((params["b"] == -1.0).all())
print("fused ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_fused_pass_stages_and_refuses_as_the_cpu_path_does() -> None:
    """`stage_version` over the Triton kernel (its CPU interpreter, in a process of its own):
    NaN in the padding alone passes the flag's second look, an Inf in a tensor is named."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(RUNTIME)}
    done = subprocess.run([sys.executable, "-c", _FUSED], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "fused ok" in done.stdout, done.stderr[-3000:]


def test_an_unfit_version_is_refused_before_any_copy_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Names, shapes and dtypes are checked first, so a refusal answers with nothing still
    reading the sender's buffer."""
    import rljob.engine.weight_swap as weight_swap

    def no_copy(*_: object) -> None:
        raise AssertionError("a copy started for a version that does not fit")

    monkeypatch.setattr(weight_swap, "start_copy_checked", no_copy)
    params = _params()
    named = _flat({"a": torch.ones(3, 4), "zz": torch.ones(5)})
    flat = flat_version(params, named)
    assert flat is not None
    assert stage_version(params, named, flat).problems == ["unknown parameter zz"]
