"""The step boundary's vote schedule and the commit barrier's rule: pure code, no collectives."""

from __future__ import annotations

import pytest

from etc_agent.layout.config import ParallelConfig
from etc_agent.worker.boundary import VoteSchedule, needs_commit_barrier


def run_boundaries(
    schedule: VoteSchedule, step_times: list[float], checkpoint_every: int = 0, last: int = 10**9
) -> list[int]:
    """Feed one rank's schedule a run whose step ``i`` takes ``step_times[i]``; the boundaries it votes
    at. Every rank of a job sees the same vote (the MAX of their step times), modelled here by
    giving the schedule the true slowest step since the previous vote."""
    votes, clock, slowest = [], 100.0, 0.0
    schedule.restart(0)
    for step in range(len(step_times) + 1):
        schedule.boundary(clock)
        checkpoint = checkpoint_every > 0 and step > 0 and step % checkpoint_every == 0
        if schedule.due(step, checkpoint, step >= last):
            assert schedule.slowest_step_s == pytest.approx(slowest)
            votes.append(step)
            schedule.voted(step, slowest)
            slowest = 0.0
        if step < len(step_times):
            clock += step_times[step]
            slowest = max(slowest, step_times[step])
    return votes


def test_votes_come_an_interval_of_the_slowest_step_apart_after_a_vote_at_the_first_two_boundaries():
    assert run_boundaries(VoteSchedule(0.5), [0.04] * 40) == [0, 1, 13, 25, 37]


def test_an_interval_of_zero_votes_at_every_boundary():
    assert run_boundaries(VoteSchedule(0.0), [0.04] * 5) == [0, 1, 2, 3, 4, 5]


def test_steps_longer_than_the_interval_vote_at_every_boundary():
    assert run_boundaries(VoteSchedule(0.5), [2.0] * 4) == [0, 1, 2, 3, 4]


def test_a_slow_step_shortens_the_next_gap_and_the_gap_is_capped():
    times = [0.1] * 10 + [0.4] + [0.1] * 10
    assert run_boundaries(VoteSchedule(0.5), times) == [0, 1, 6, 11, 12, 17]
    assert run_boundaries(VoteSchedule(10.0, max_gap=8), [0.001] * 20) == [0, 1, 9, 17]


def test_checkpoint_boundaries_and_the_last_step_always_vote():
    votes = run_boundaries(VoteSchedule(0.5), [0.04] * 30, checkpoint_every=7, last=30)
    assert {7, 14, 21, 28, 30} <= set(votes)


def test_a_restart_votes_at_the_generation_s_first_boundary_and_forgets_the_old_step_times():
    schedule = VoteSchedule(0.5)
    run_boundaries(schedule, [0.04] * 5)
    schedule.restart(40)
    assert schedule.due(40, False, False) and schedule.slowest_step_s == 0.0
    schedule.boundary(1.0)
    schedule.voted(40, 0.0)  # no step measured yet in this generation: vote again at the next one
    assert schedule.next_vote == 41


@pytest.mark.parametrize(
    ("parallel", "needed"),
    [
        ("tp=1,pp=1,dp=4", False),
        ("tp=1,pp=1,dp=4,zero=1", True),
        ("tp=1,pp=1,dp=4,dp_shard=4", True),
        ("tp=1,pp=1,dp=4,dp_shard=2", True),
        ("tp=2,pp=1,dp=2", True),
        ("tp=1,pp=2,dp=2", True),
        ("tp=2,pp=1,dp=1", True),
    ],
)
def test_the_commit_barrier_is_left_out_only_for_whole_replicas(parallel, needed):
    assert needs_commit_barrier(ParallelConfig.parse(parallel), lambda: True) is needed
    assert needs_commit_barrier(ParallelConfig.parse(parallel), lambda: False)


def test_a_state_with_a_range_of_a_tensor_is_not_whole():
    import torch

    from etc_agent.migrate.describe import BoxedTensor
    from etc_agent.worker.appstate import holds_only_whole_tensors

    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters())
    assert holds_only_whole_tensors({"model": model, "optim": optim, "step": 3})
    part = BoxedTensor(torch.arange(4.0), (8,), (4,))
    assert not holds_only_whole_tensors({"model": model, "z": part})
    assert holds_only_whole_tensors({"z": BoxedTensor(torch.arange(8.0), (8,), (0,))})


def _train_with_scheduled_votes(rank: int, world: int) -> tuple[list[int], int]:
    """40 steps, each with an all-reduce standing in for the gradient reduction and a rank-dependent
    pace (rank 2 slows down from step 20); rank 1's agent "sees" generation 1 from step 10. Returns
    the boundaries this rank voted at and the first at which a vote carried generation 1."""
    import time

    import torch
    import torch.distributed as dist

    from etc_agent.worker.boundary import boundary_vote

    schedule, votes, switch_at = VoteSchedule(0.1), [], -1
    schedule.restart(0)
    for step in range(40):
        schedule.boundary(time.perf_counter())
        if schedule.due(step, False, False):
            seen = 1 if rank == 1 and step >= 10 else 0
            vote = boundary_vote(seen, None, step, slowest_step_s=schedule.slowest_step_s)
            votes.append(step)
            schedule.voted(step, vote.slowest_step_s)
            if vote.pending and switch_at < 0:
                switch_at = step
        dist.all_reduce(torch.ones(4))
        time.sleep(0.03 if rank == 2 and step >= 20 else 0.004 * (rank + 1))
    return votes, switch_at


def test_ranks_with_different_paces_vote_at_the_same_boundaries():
    from dist_harness import run_workers

    results = run_workers(3, _train_with_scheduled_votes, pg_timeout_s=30.0, timeout_s=120.0)
    votes, switch_at = results[0]
    assert all(r == (votes, switch_at) for r in results), results
    assert votes[:2] == [0, 1] and len(votes) < 20, votes  # far fewer votes than steps
    assert 10 <= switch_at <= 10 + 64 and switch_at in votes, (switch_at, votes)
    late = [b - a for a, b in zip(votes, votes[1:]) if a >= 22]
    assert late and max(late) <= 4, votes  # rank 2's slower steps (30 ms of a 0.1 s interval) shortened the gaps


def test_the_last_step_time_is_the_gap_between_the_last_two_boundaries_and_a_restart_forgets_it():
    schedule = VoteSchedule(0.5)
    schedule.boundary(10.0)
    assert schedule.last_step_s is None  # one boundary: no step measured yet
    schedule.boundary(10.25)
    schedule.boundary(10.75)
    assert schedule.last_step_s == 0.5 and schedule.slowest_step_s == 0.5
    schedule.restart(7)
    assert schedule.last_step_s is None
