"""`trainer.megatronArgs` -> field overrides of megatron-core's config dataclasses.

The spec passes Megatron-LM style flags through verbatim (`--recompute-granularity full`,
`--no-gradient-accumulation-fusion`, `--adam-beta2=0.95`). megatron-core has no argument
parser of its own, so each flag is routed by name to the config dataclass that owns the field;
a flag no config knows is rejected with the list of configs searched, never ignored.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from typing import Any


class MegatronArgError(ValueError):
    pass


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        return text


def route_megatron_args(
    args: Sequence[str], fields: Mapping[str, set[str]]
) -> dict[str, dict[str, Any]]:
    """Split flags into `{config name: {field: value}}`.

    `fields` maps each config's name (e.g. "transformer") to its field names; a field present
    in several configs is set on all of them (e.g. `bf16`).
    """
    out: dict[str, dict[str, Any]] = {name: {} for name in fields}
    i = 0
    while i < len(args):
        flag = args[i]
        if not flag.startswith("--"):
            raise MegatronArgError(
                f"trainer.megatronArgs[{i}] = {flag!r}: expected a flag starting with '--'"
            )
        body, has_eq, inline = flag[2:].partition("=")
        name = body.replace("-", "_")
        value: Any
        if has_eq:
            value = _value(inline)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            i += 1
            value = _value(args[i])
        elif name.startswith("no_"):
            name, value = name[3:], False
        else:
            value = True
        owners = [cfg for cfg, names in fields.items() if name in names]
        if not owners:
            raise MegatronArgError(
                f"trainer.megatronArgs: {flag!r} sets no field of megatron-core's "
                f"{', '.join(fields)} configs; check the name against megatron-core's docs"
            )
        for cfg in owners:
            out[cfg][name] = value
        i += 1
    return out
