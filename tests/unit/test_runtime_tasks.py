"""Toy tasks, their exact rewards and the resumable data source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rljob.rollout.data_source import DataSource
from rljob.rollout.tasks import (
    DatasetError,
    arithmetic,
    char_accuracy_reward,
    leading_number_reward,
    load_task,
    reverse,
)

pytestmark = pytest.mark.unit


def test_arithmetic_rewards_exact_answers_only() -> None:
    task = arithmetic()
    assert all(int(p.label) == eval(p.prompt[:-1]) for p in task.prompts)
    assert leading_number_reward("7", "7") == 1.0
    assert leading_number_reward("7+", "7") == 1.0
    assert leading_number_reward("71", "7") == 0.0
    assert leading_number_reward("", "7") == 0.0
    assert set("".join(p.prompt + p.label for p in task.prompts)) <= set(task.alphabet)


def test_reverse_reward_is_positional_accuracy() -> None:
    assert reverse().prompts[0].label == reverse().prompts[0].prompt[:-1][::-1]
    assert char_accuracy_reward("cba", "cba") == 1.0
    assert char_accuracy_reward("cbx", "cba") == pytest.approx(2 / 3)
    assert char_accuracy_reward("cbaaa", "cba") == pytest.approx(3 / 5)


def test_jsonl_dataset_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "d.jsonl"
    good.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n\n")
    task = load_task(str(good), "q", "a")
    assert task.prompts[0].prompt == "hi" and task.reward("yo ", "yo") == 1.0
    with pytest.raises(DatasetError, match="promptKey"):
        load_task(str(good), "prompt", "a")
    with pytest.raises(DatasetError, match="cannot read"):
        load_task(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="builtin:arithmetic"):
        load_task("builtin:nope")


def test_data_source_order_is_seeded_and_resumable() -> None:
    prompts = arithmetic().prompts
    a = DataSource(prompts, seed=3, shuffle=True)
    first = a.take(40) + a.take(40)  # crosses an epoch boundary (55 prompts)
    b = DataSource(prompts, seed=3, shuffle=True)
    b.take(40)
    state = json.loads(json.dumps(b.state()))
    c = DataSource(prompts, seed=3, shuffle=True)
    c.load(state)
    assert c.take(40) == first[40:]
    assert sorted(p.prompt for p in first[:55]) == sorted(p.prompt for p in prompts)


def test_buffered_prompts_are_served_first_and_persisted() -> None:
    prompts = arithmetic().prompts
    src = DataSource(prompts, seed=0, shuffle=False)
    taken = src.take(2)
    src.give_back(taken[:1])
    restored = DataSource(prompts, seed=0, shuffle=False)
    restored.load(src.state())
    assert restored.take(2) == [taken[0], prompts[2]]


def test_a_bad_eval_dataset_is_named_as_spec_eval_dataset(tmp_path: Path) -> None:
    from rljob.driver.model_files import prepare_model
    from rljob_api.exits import INVALID, JobError
    from rljob_api.spec import RLJobSpec

    spec = RLJobSpec.model_validate(
        {"eval": {"dataset": str(tmp_path / "missing.jsonl"), "interval": 5}})
    with pytest.raises(JobError) as err:
        prepare_model(spec, tmp_path / "work")
    assert err.value.code == INVALID
    assert str(err.value).startswith("spec.eval.dataset: cannot read")
    with pytest.raises(DatasetError, match=r"^spec\.eval\.dataset: unknown built-in"):
        load_task("builtin:nope", field="spec.eval.dataset")
