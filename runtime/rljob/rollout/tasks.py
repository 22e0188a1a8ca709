"""Prompt sets: the built-in toy tasks (generated in code) and JSONL files.

The toy tasks have exact rewards computed from the reference answer, so a rising reward
means the policy really learned the task, not that a reward model was fooled.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Reward = Callable[[str, str], float]


@dataclass(frozen=True)
class Prompt:
    prompt: str
    label: str


@dataclass(frozen=True)
class Task:
    """A prompt list, the characters it uses and its exact reward."""

    name: str
    prompts: tuple[Prompt, ...]
    alphabet: str
    reward: Reward


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file/line and the fix."""


def leading_number_reward(response: str, label: str) -> float:
    """1 when the digits the response starts with are exactly the answer, else 0.

    What follows the number is ignored, as a grader extracting "the answer" would.
    """
    digits = ""
    for ch in response:
        if not ch.isdigit():
            break
        digits += ch
    return 1.0 if digits and digits == label else 0.0


def char_accuracy_reward(response: str, label: str) -> float:
    """Fraction of positions right, over the longer of response and answer."""
    width = max(len(response), len(label))
    if width == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, label, strict=False)) / width


def exact_match_reward(response: str, label: str) -> float:
    return 1.0 if response.strip() == label.strip() else 0.0


def arithmetic() -> Task:
    """Single-digit sums `a+b=` with a + b <= 9; the answer is one digit."""
    prompts = tuple(
        Prompt(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10) if a + b <= 9
    )
    return Task("arithmetic", prompts, string.digits + "+=", leading_number_reward)


def reverse() -> Task:
    """Reverse a 3-letter word over a 5-letter alphabet: `abc>` → `cba`."""
    letters = "abcde"
    rng = random.Random(0)
    words = sorted({"".join(rng.choice(letters) for _ in range(3)) for _ in range(400)})
    prompts = tuple(Prompt(f"{w}>", w[::-1]) for w in words)
    return Task("reverse", prompts, letters + ">", char_accuracy_reward)


BUILTIN_TASKS: dict[str, Callable[[], Task]] = {
    "builtin:arithmetic": arithmetic,
    "builtin:reverse": reverse,
}


def load_jsonl(path: Path, prompt_key: str, label_key: str,
               field: str = "spec.data.dataset") -> Task:
    """A JSONL prompt file: one object per line with `prompt_key` and `label_key` strings;
    errors name `field`, the spec field that gave the path."""
    prompts: list[Prompt] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise DatasetError(
            f"{field}: cannot read {path}: {err.strerror}; give an existing JSONL "
            "file or builtin:arithmetic / builtin:reverse"
        ) from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{number}: each line must be a JSON object")
        missing = [k for k in (prompt_key, label_key) if not isinstance(row.get(k), str)]
        if missing:
            raise DatasetError(
                f"{path}:{number}: needs string field(s) {', '.join(missing)} "
                "(set spec.data.promptKey / labelKey to the names your file uses)"
            )
        prompts.append(Prompt(row[prompt_key], row[label_key]))
    if not prompts:
        raise DatasetError(f"{path}: holds no prompts")
    alphabet = "".join(sorted({ch for p in prompts for ch in p.prompt + p.label}))
    return Task(path.name, tuple(prompts), alphabet, exact_match_reward)


def load_task(dataset: str, prompt_key: str = "prompt", label_key: str = "label",
              field: str = "spec.data.dataset") -> Task:
    """The task named by `field`: `spec.data.dataset`, or `spec.eval.dataset`."""
    if dataset.startswith("builtin:"):
        if dataset not in BUILTIN_TASKS:
            raise DatasetError(
                f"{field}: unknown built-in {dataset!r}; use one of "
                + ", ".join(sorted(BUILTIN_TASKS))
            )
        return BUILTIN_TASKS[dataset]()
    return load_jsonl(Path(dataset), prompt_key, label_key, field)
