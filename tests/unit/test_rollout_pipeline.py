"""The staleness and fit rules of the loop's batches (rljob.cluster.rollout_pipeline), as pure
logic: what lag a batch has, and when a batch a checkpoint kept is generated again."""

from __future__ import annotations

from rljob.cluster.rollout_pipeline import RolloutBatch, Staleness
from rljob.rollout.sample import Sample


def _sample(version: str, spans: list[tuple[str, int]] | None = None) -> Sample:
    return Sample(prompt="p", weight_version=version, version_spans=spans or [])


def test_staleness_counts_the_oldest_token_and_falls_back_to_the_launch_version() -> None:
    batch = RolloutBatch(step=5, stats={}, engine_version=3, samples=[
        _sample("4"),                          # lag 1
        _sample("4", [("2", 0), ("4", 7)]),   # continued: its first tokens are version 2
        _sample(""),                           # a custom generate recorded none: version 3
        _sample("v-next"),                     # not a number: version 3 too
    ])
    assert batch.sample_versions() == [4, 2, 3, 3]
    lag = Staleness.of(batch, policy_version=5, bound=2)
    assert (lag.mean, lag.max, lag.over_bound) == (2.0, 3, 1)  # lags 1, 3, 2, 2
    assert Staleness.of(batch, policy_version=5, bound=None).over_bound == 0  # sync: no bound


def test_a_kept_batch_that_no_longer_fits_is_named() -> None:
    batch = RolloutBatch(step=5, stats={}, engine_version=3,
                         samples=[_sample("3"), _sample("4")])
    assert batch.misfit(oldest_version=3, samples_per_step=2) is None
    assert "older than rollout.maxStaleness now allows" in str(
        batch.misfit(oldest_version=4, samples_per_step=2))
    assert "the job now takes 4 a step" in str(batch.misfit(oldest_version=None,
                                                            samples_per_step=4))
    assert batch.misfit(oldest_version=None, samples_per_step=2) is None
