"""How the rollout worker's requests hold their places and how their answers are read."""

from __future__ import annotations

import asyncio

import pytest

from rljob.engine.client import generate_answers
from rljob.rollout.in_flight import InFlight

pytestmark = pytest.mark.unit


def test_a_request_takes_a_place_per_row_and_waits_for_all_of_them() -> None:
    async def go() -> list[str]:
        places = InFlight(4)
        order: list[str] = []
        first_in = asyncio.Event()
        release_first = asyncio.Event()

        async def request(name: str, rows: int, hold: asyncio.Event | None) -> None:
            async with places.rows(rows):
                order.append(f"{name} in ({places.free} free)")
                if hold is not None:
                    first_in.set()
                    await hold.wait()
            order.append(f"{name} out")

        first = asyncio.create_task(request("a", 3, release_first))
        await first_in.wait()
        second = asyncio.create_task(request("b", 2, None))  # 2 rows, 1 place free: waits
        third = asyncio.create_task(request("c", 1, None))  # 1 row: fits at once
        await third
        assert not second.done()
        release_first.set()
        await asyncio.gather(first, second)
        # A request of more rows than there are places waits for all of them, then runs.
        await request("d", 9, None)
        return order

    # Bounded: a limiter that took places piecemeal would hang here, not pass.
    assert asyncio.run(asyncio.wait_for(go(), 30)) == [
        "a in (1 free)", "c in (0 free)", "c out", "a out",
        "b in (2 free)", "b out", "d in (0 free)", "d out"]


def test_answers_are_taken_in_order_one_per_prompt() -> None:
    answers = [{"output_ids": [i], "meta_info": {"output_token_logprobs": [[-0.1, i, None]],
                                                  "finish_reason": {"type": "length"}}}
               for i in range(3)]
    assert generate_answers(answers, 3) == answers
    assert generate_answers(answers[0], 1) == [answers[0]]
    with pytest.raises(ValueError, match="2 answers to 3 prompt"):
        generate_answers(answers[:2], 3)
    for bad in ({"text": "x", "meta_info": {"finish_reason": {"type": "stop"}}},
                {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-0.1, 1, None]],
                                                     "finish_reason": {"type": "length"}}},
                {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}},
                {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-0.1, 1, None]],
                                                  "finish_reason": "length"}}):
        with pytest.raises(ValueError, match="unexpected response"):
            generate_answers([bad], 1)


def test_a_prompt_sglang_aborted_before_its_prefill_is_an_abort_with_no_tokens() -> None:
    # SGLang 0.5.3's answer to a request `abort_all` took from the scheduler's queue
    # (TokenizerManager._handle_abort_req): no output_ids, no log-probs.
    queued = {"text": "", "meta_info": {"id": "r1", "finish_reason": {
        "type": "abort", "message": "Abort before prefill"}, "prompt_tokens": 0,
        "completion_tokens": 0}}
    ran = {"output_ids": [5, 6], "meta_info": {
        "output_token_logprobs": [[-0.5, 5, None], [-0.2, 6, None]],
        "finish_reason": {"type": "abort", "message": "aborted"}}}
    first, second = generate_answers([queued, ran], 2)
    assert first["output_ids"] == [] and first["meta_info"]["output_token_logprobs"] == []
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    assert second == ran
