"""Every key of a job's membership store, built here and nowhere else.

Keys are relative to the job's prefix (:data:`etc_agent.rendezvous.store.ROOT_PREFIX` and the run
id, added by the store). What each holds (``docs/protocol.md`` has the whole picture):

=================================== ============================================ =================
key                                 value                                        written by
=================================== ============================================ =================
``leader``                          :class:`LeaderRecord` (under its lease)      the leader
``generation``                      :class:`GenerationRecord` (compare-and-set)  the leader
``nodes/<node>``                    :class:`NodeRecord` (under its lease)        each agent
``generations/<n>/master``          :class:`MasterRecord`: the workers' store    the first member
``generations/<n>/status/<node>``   :class:`NodeStatus` in generation n          each agent
``generations/<n>/peer_failed/<n>`` :class:`PeerFailureRecord`                   an agent whose
                                                                                 worker saw a peer
                                                                                 fail
``generations/<n>/abandoned/<n>``   :class:`AbandonRecord`: n must be planned    an agent
                                    again
``generations/<n>/migration``       :class:`MigrationRecord` of the switch to n  rank 0's agent
``last_migration``                  the newest :class:`MigrationRecord`          rank 0's agent
``elastic``                         the job's workers use the worker API         the first agent
                                                                                 told so
``trained``                         a training step has run (never start fresh)  rank 0's agent
``finished``                        the last step is done                        rank 0's agent
``checkpoint``                      :class:`CheckpointRecord`: the newest        rank 0's agent
                                    committed periodic checkpoint (written only
                                    while ``generation`` is at its revision)
``parallel``                        a parallel config asked for by hand          ``etc-agent
                                                                                 reconfigure``
=================================== ============================================ =================
"""

from __future__ import annotations

LEADER = "leader"
GENERATION = "generation"
NODES = "nodes/"
"""The prefix of every node record."""
GENERATIONS = "generations/"
"""The prefix of every generation's keys."""
LAST_MIGRATION = "last_migration"
ELASTIC = "elastic"
TRAINED = "trained"
FINISHED = "finished"
CHECKPOINT = "checkpoint"
REQUESTED_PARALLEL = "parallel"


def node(node_id: str) -> str:
    return f"{NODES}{node_id}"


def node_of(key: str) -> str:
    """The node a key of a per-node family ends with (``nodes/<node>``, ``.../status/<node>``)."""
    return key.rsplit("/", 1)[-1]


def generation_prefix(number: int) -> str:
    return f"{GENERATIONS}{number}/"


def generation_number(key: str) -> int | None:
    """The generation a key under ``generations/`` belongs to (None for any other key)."""
    parts = key.split("/")
    if len(parts) < 2 or parts[0] + "/" != GENERATIONS or not parts[1].isdigit():
        return None
    return int(parts[1])


def master(number: int) -> str:
    return f"{generation_prefix(number)}master"


def statuses(number: int) -> str:
    """The prefix of every node's status in generation ``number``."""
    return f"{generation_prefix(number)}status/"


def status(number: int, node_id: str) -> str:
    return f"{statuses(number)}{node_id}"


def peer_failures(number: int) -> str:
    """The prefix of every node's report that a peer failed in generation ``number``."""
    return f"{generation_prefix(number)}peer_failed/"


def peer_failure(number: int, node_id: str) -> str:
    return f"{peer_failures(number)}{node_id}"


def abandons(number: int) -> str:
    """The prefix of every node's report that generation ``number`` must be planned again."""
    return f"{generation_prefix(number)}abandoned/"


def abandon(number: int, node_id: str) -> str:
    return f"{abandons(number)}{node_id}"


def migration(number: int) -> str:
    return f"{generation_prefix(number)}migration"
