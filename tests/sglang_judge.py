"""SGLang's own code reads the requests rljob sends: run as a process of its own, the engine.

`python -m tests.sglang_judge CASES OUT` reads a JSON list of requests (route, body, and for
a weight install the tensor-parallel size and the names, dtypes and shapes of the model) and
answers, in OUT (torch.save), what the installed SGLang release makes of each:

- the request type its HTTP route is declared with (read from `http_server.py` with `ast`:
  that module imports SGLang's kernels), the body's fields that type lacks, and the body as
  validated against that type by pydantic, as FastAPI validates it; for `/generate`, the
  requests its `normalize_batch_and_arguments` makes of it (one per prompt of a batch);
- for `/update_weights_from_tensor`, the tensors each TP rank loaded, through SGLang's own
  `TpModelWorker.update_weights_from_tensor` and `ModelRunner.update_weights_from_tensor`
  (their source, compiled here from the installed files, since their modules import the
  kernels too), with SGLang's patched torch reductions, its `MultiprocessingSerializer` and
  its `FlattenedTensorBucket`; the model they load into is the smallest model SGLang's
  runner calls (`load_weights` of (name, tensor) pairs) over tensors of the trainer's names,
  dtypes and shapes;
- for a launch command, the arguments SGLang's own `ServerArgs` parser reads from it.

A separate process because SGLang patches torch's reductions for the whole process, as it
does in its own scheduler processes, and because the tensors then cross processes as they do
to a real engine (shared memory opened by name).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pydantic
import torch
from sglang.srt.managers import io_struct
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import MultiprocessingSerializer, dynamic_import
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

from tests.sglang_source import RELEASE, installed_path, route_table


def methods(path: Path, class_name: str | None, names: list[str],
            namespace: dict[str, Any]) -> dict[str, Any]:
    """SGLang's functions `names` (of class `class_name`, or of the module) compiled from
    the installed source into `namespace`."""
    tree = ast.parse(path.read_text())
    body = tree.body
    if class_name is not None:
        body = next(n for n in tree.body
                    if isinstance(n, ast.ClassDef) and n.name == class_name).body
    found = [n for n in body if isinstance(n, ast.FunctionDef | ast.ClassDef)
             and n.name in names]
    assert sorted(n.name for n in found) == sorted(names), (path, names)
    for node in found:
        node.decorator_list = [d for d in node.decorator_list
                               if not (isinstance(d, ast.Name) and d.id == "dataclass")]
        module = ast.Module(body=[node], type_ignores=[])
        exec(compile(module, str(path), "exec"), namespace)
    return {name: namespace[name] for name in names}


class Model:
    """What SGLang's runner calls on a model to install weights: `load_weights` of (name,
    tensor) pairs. Holds tensors of the trainer's names, dtypes and shapes and refuses any
    other, as a model's `load_weights` fails on an unknown name or a wrong shape."""

    def __init__(self, layout: dict[str, tuple[str, list[int]]]) -> None:
        self.weights = {name: torch.full(shape, float("nan"), dtype=getattr(torch, dtype))
                        for name, (dtype, shape) in layout.items()}

    def load_weights(self, named: typing.Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            have = self.weights[name]
            if tensor.shape != have.shape or tensor.dtype != have.dtype:
                raise ValueError(f"{name}: {tensor.dtype}{list(tensor.shape)} for "
                                 f"{have.dtype}{list(have.shape)}")
            have.copy_(tensor)


def weight_receivers() -> tuple[type, type]:
    """SGLang's ModelRunner and TpModelWorker, as far as their weight-update methods reach."""
    namespace: dict[str, Any] = {
        "torch": torch, "List": typing.List, "Tuple": typing.Tuple,  # noqa: UP006
        "Union": typing.Union, "Optional": typing.Optional, "dataclass": dataclasses.dataclass,
        "monkey_patch_torch_reductions": monkey_patch_torch_reductions,
        "MultiprocessingSerializer": MultiprocessingSerializer,
        "FlattenedTensorBucket": FlattenedTensorBucket,
        "FlattenedTensorMetadata": FlattenedTensorMetadata, "dynamic_import": dynamic_import,
    }
    runner_src = installed_path("srt/model_executor/model_runner.py")
    methods(runner_src, None, ["_unwrap_tensor"], namespace)
    local = methods(runner_src, None, ["LocalSerializedTensor"], namespace)
    namespace["LocalSerializedTensor"] = dataclasses.dataclass(local["LocalSerializedTensor"])
    runner = methods(runner_src, "ModelRunner",
                     ["update_weights_from_tensor", "_update_weights_from_flattened_bucket"],
                     namespace)
    worker = methods(installed_path("srt/managers/tp_worker.py"), "TpModelWorker",
                     ["update_weights_from_tensor"], namespace)
    return type("ModelRunner", (), runner), type("TpModelWorker", (), worker)


def judge_request(route: str, body: dict[str, Any], types: dict[str, str | None]) -> dict[str, Any]:
    type_name = types.get(route, "absent")
    answer: dict[str, Any] = {"type": type_name}
    if type_name in (None, "absent"):
        return answer
    cls = getattr(io_struct, type_name)
    fields = {f.name for f in dataclasses.fields(cls)}
    answer["unknown_fields"] = sorted(set(body) - fields)
    answer["missing_fields"] = sorted(
        f.name for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        and f.name not in body)
    try:
        validated = pydantic.TypeAdapter(cls).validate_python(body)
    except pydantic.ValidationError as err:
        answer["invalid"] = str(err)
        return answer
    answer["validated"] = {f: getattr(validated, f) for f in fields}
    if isinstance(validated, io_struct.GenerateReqInput):
        # What the tokenizer manager makes of it: one request per prompt (a batch is split,
        # each row with its own sampling params), as `normalize_batch_and_arguments` reads it.
        validated.normalize_batch_and_arguments()
        rows = [validated] if validated.is_single else [
            validated[i] for i in range(validated.batch_size)]
        answer["rows"] = [{"input_ids": r.input_ids, "sampling_params": r.sampling_params}
                          for r in rows]
    return answer


def install(body: dict[str, Any], tp_size: int, layout: dict[str, tuple[str, list[int]]],
            runner_cls: type, worker_cls: type) -> list[dict[str, torch.Tensor] | str]:
    req = io_struct.UpdateWeightsFromTensorReqInput(**body)
    loaded: list[dict[str, torch.Tensor] | str] = []
    for rank in range(tp_size):
        runner = runner_cls()
        runner.tp_rank, runner.device, runner.model = rank, "cpu", Model(layout)
        runner.server_args = SimpleNamespace(custom_weight_loader=[])
        worker = worker_cls()
        worker.tp_rank, worker.model_runner = rank, runner
        try:
            success, message = worker.update_weights_from_tensor(req)
        except Exception as err:  # what the rank would log and answer
            loaded.append(f"{type(err).__name__}: {err}")
            continue
        loaded.append({k: v.clone() for k, v in runner.model.weights.items()} if success
                      else str(message))
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases")
    parser.add_argument("out")
    args = parser.parse_args()
    cases = json.loads(Path(args.cases).read_text())
    types = {path: route.request_type for path, route in route_table(RELEASE).items()}
    runner_cls, worker_cls = weight_receivers()
    out: dict[str, Any] = {}
    for case in cases:
        if "argv" in case:
            cli = argparse.ArgumentParser()
            ServerArgs.add_cli_args(cli)
            out[case["id"]] = vars(cli.parse_args(case["argv"]))
            continue
        answer = judge_request(case["route"], case["body"], types)
        if "layout" in case:
            answer["loaded"] = install(case["body"], case["tp_size"], case["layout"],
                                       runner_cls, worker_cls)
        out[case["id"]] = answer
    torch.save(out, args.out)


if __name__ == "__main__":
    sys.exit(main())
