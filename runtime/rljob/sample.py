"""The `Sample` record that flows from generation through reward and buffer to training."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


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
    `weight_version` is the engine's version that produced the response, so staleness is
    visible; `rollout_log_probs` are the engine's log-probs of the response tokens.
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

    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sample:
        data = dict(data)
        data["status"] = Status(data["status"])
        return cls(**data)
