"""The node's state machine (etc_agent.agent.node_state): its tables, checked without a store."""

from __future__ import annotations

import signal

import pytest

from etc_agent.agent.node_state import Lifecycle, NodeStateMachine, Readiness
from etc_agent.protocol.phases import Phase


def test_leaving_running_for_a_new_generation_goes_through_pending():
    node = NodeStateMachine("n")
    node.move(Phase.MIGRATING, 0)
    node.move(Phase.RUNNING, 0)
    seen = []
    original = node._set
    node._set = lambda new: seen.append(new.phase) or original(new)  # type: ignore[method-assign]
    node.move(Phase.MIGRATING, 1)
    assert seen == [Phase.PENDING, Phase.MIGRATING]
    assert (node.state.phase, node.state.generation) == (Phase.MIGRATING, 1)


@pytest.mark.parametrize("direct", [Phase.RECOVERING, Phase.DEPARTING, Phase.FINISHED, Phase.FAILED])
def test_a_running_node_recovers_departs_or_ends_directly(direct):
    node = NodeStateMachine("n")
    node.move(Phase.MIGRATING, 0)
    node.move(Phase.RUNNING, 0)
    node.move(direct, 0)
    assert node.state.phase == direct


def test_final_phases_stay_whatever_comes_after():
    node = NodeStateMachine("n")
    node.move(Phase.FINISHED, 3)
    node.move(Phase.FAILED, 4)
    node.move(Phase.RUNNING, 5)
    assert (node.state.phase, node.state.generation, node.state.done) == (Phase.FINISHED, 3, True)


def test_a_transition_outside_the_protocol_fails_where_it_starts():
    node = NodeStateMachine("agent n")
    with pytest.raises(AssertionError, match="agent n: no transition spare -> running"):
        node.move(Phase.RUNNING, 0)


def test_a_crash_restart_takes_the_node_out_until_every_restarted_rank_is_back():
    node = NodeStateMachine("n")
    node.restarting({1}, generation=4)
    node.restarting({0}, generation=5)  # another rank crashed meanwhile
    state = node.state
    assert (state.readiness, state.restarting, state.crashed_in, state.ready) == (
        Readiness.RESTARTING,
        frozenset({0, 1}),
        5,
        False,
    )
    back = node.rejoined()
    assert node.state.ready is False  # not until it is committed (after the store heard it)
    node.commit(back)
    assert (node.state.ready, node.state.restarting, node.state.crashed_in) == (True, frozenset(), None)


def test_warming_is_only_for_a_ready_node_and_ends_ready():
    node = NodeStateMachine("n")
    node.warming()
    assert not node.state.ready
    with pytest.raises(AssertionError, match="warming -> restarting"):
        node.restarting({0}, 1)
    node.warmed()
    node.warmed()  # once over, a second call changes nothing
    assert node.state.readiness == Readiness.READY


def test_a_first_signal_leaves_a_second_stops_now_and_the_events_follow():
    node = NodeStateMachine("n")
    assert node.leave(signal.SIGTERM) is True
    assert node.state.lifecycle == Lifecycle.LEAVING and node.state.cause == signal.SIGTERM
    assert node.leaving_event.is_set() and not node.hard_stop_event.is_set() and not node.stop_event.is_set()
    assert node.leave(None) is False  # a second crash-limit departure: nothing new
    assert node.state.lifecycle == Lifecycle.LEAVING
    assert node.leave(signal.SIGINT) is False
    assert node.state.stopping_now and node.state.cause == signal.SIGTERM  # the first signal is the cause
    assert node.hard_stop_event.is_set() and node.stop_event.is_set()


def test_a_crash_limit_departure_then_a_signal_stops_now_with_that_signal_as_the_cause():
    node = NodeStateMachine("n")
    node.leave(None)
    node.leave(signal.SIGTERM)
    assert node.state.stopping_now and node.state.cause == signal.SIGTERM


def test_closing_stops_the_threads_but_is_no_hard_stop():
    node = NodeStateMachine("n")
    node.close()
    assert node.stop_event.is_set() and node.state.stop_requested
    assert not node.hard_stop_event.is_set() and not node.state.leaving


def test_a_launchers_request_to_leave_never_escalates_and_the_first_signal_after_it_is_a_first_one():
    """A terminating pod signals the sidecar's and the workers' containers together: the launcher's
    request (Leave) may come first, and the sidecar's own SIGTERM must not turn it into a stop."""
    node = NodeStateMachine("n")
    assert node.leave(None, asked=True) is True
    assert node.state.lifecycle == Lifecycle.LEAVING and node.state.cause is None
    assert node.leave(None, asked=True) is False  # asked again: nothing new
    assert node.leave(signal.SIGTERM) is False
    assert node.state.lifecycle == Lifecycle.LEAVING and node.state.cause == signal.SIGTERM
    assert not node.hard_stop_event.is_set()
    assert node.leave(signal.SIGTERM) is False  # the second signal stops now, as ever
    assert node.state.stopping_now and node.state.cause == signal.SIGTERM
    # The other order: the sidecar's signal first, the launcher's request after it changes nothing.
    other = NodeStateMachine("n")
    other.leave(signal.SIGTERM)
    assert other.leave(None, asked=True) is False
    assert other.state.lifecycle == Lifecycle.LEAVING and not other.hard_stop_event.is_set()
