"""The `Sample` record that flows from generation through reward and buffer to training."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


def version_number(version: str) -> int | None:
    """A weight version as the loop counts it (engines report it as text; a custom engine or
    generate function may report something else, or nothing: None)."""
    return int(version) if version.lstrip("-").isdigit() else None


class Status(str, Enum):
    pending = "pending"
    completed = "completed"
    truncated = "truncated"
    aborted = "aborted"
    failed = "failed"


@dataclass
class Sample:
    """One response to one prompt.

    `tokens` holds prompt and response ids; `loss_mask` has one entry per response token
    (1 = trained on, 0 = e.g. a tool output a custom generate function inserted).
    `weight_version` is the version of the engine that produced the response's LAST token,
    so staleness is visible; `rollout_log_probs` are the engine's log-probs of the response
    tokens.

    A generation that partial rollout aborted at a step boundary and continued later was
    produced by more than one weight version: `version_spans` lists them in order as
    (version, index in the response of its first token), one entry per engine call that
    added tokens, so the tokens of older versions can be masked (`mask_older_versions`)
    and `first_weight_version` shows the oldest. The built-in generate function fills it;
    a custom one may leave it empty (then nothing is masked).
    """

    prompt: str
    label: str = ""
    group_index: int = 0
    index: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    reward: float | None = None
    weight_version: str = ""
    status: Status = Status.pending
    seed: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    version_spans: list[tuple[str, int]] = field(default_factory=list)

    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    @property
    def first_weight_version(self) -> str:
        """The version that produced the response's first token (`weight_version` when the
        response came from one version, or no spans were recorded)."""
        return self.version_spans[0][0] if self.version_spans else self.weight_version

    def add_span(self, version: str, start: int) -> None:
        """Record that response tokens from index `start` on came from `version`."""
        if not self.version_spans or self.version_spans[-1][0] != version:
            self.version_spans.append((version, start))

    def mask_older_versions(self) -> int:
        """Loss mask 0 on the response tokens produced by a version other than the one that
        produced the last token (versions only grow in a run, so other means older);
        returns how many tokens this newly masked."""
        ends = [start for _, start in self.version_spans[1:]] + [self.response_length]
        masked = 0
        for (version, start), end in zip(self.version_spans, ends, strict=True):
            if version == self.weight_version:
                continue
            for i in range(start, min(end, len(self.loss_mask))):
                masked += self.loss_mask[i]
                self.loss_mask[i] = 0
        return masked

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sample:
        data = dict(data)
        data["status"] = Status(data["status"])
        # JSON (a checkpoint's rollout_state.json) turns the spans' tuples into lists.
        data["version_spans"] = [(str(v), int(i)) for v, i in data.get("version_spans", [])]
        return cls(**data)
