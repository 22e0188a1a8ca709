"""The SGLang releases rljob supports (`spec.rollout.backend: sglang`).

Here, in the API model, because the reference (docs/reference.md) states the range and the
runtime refuses an engine outside it (`rljob.engine.sglang_release`). `RELEASE` is the one
the rollout image is built on; `NEWEST_CHECKED` the newest whose source the contract tests
read too (pyproject.toml `tool.rljob.sglang` pins both for them).
"""

from __future__ import annotations

RELEASE = "0.5.3"
NEWEST_CHECKED = "0.5.23"
SUPPORTED_RANGE = f">= {RELEASE}, <= {NEWEST_CHECKED}"
