"""This node's workers, watched: exits, hangs, crash restarts, a warm start, who the end waits for.

- :meth:`Supervision.check_workers` (every pass of the main loop): a plain script's failed worker
  fails the node's part of the generation (the leader counts it against ``--max-restarts``); a
  worker-API process that died or hung is restarted as a standby process while the node is out of
  the membership (:meth:`on_live_crash`), and the node rejoins once it runs (:meth:`maybe_rejoin`);
  workers that all exited 0 end the node's part of the job.
- :meth:`join_warm` (before registering): joining a running elastic job, the workers start first.
"""

from __future__ import annotations

import logging
import time

from etc_agent.agent.endwatch import EndWatch
from etc_agent.agent.node import Node
from etc_agent.agent.spares import SpareKeeper
from etc_agent.agent.worker_env import standby_env
from etc_agent.protocol import keys
from etc_agent.protocol.phases import RESTART_EXIT, Phase
from etc_agent.rendezvous.records import GenerationRecord, NodeStatus
from etc_agent.rendezvous.store import StoreError

log = logging.getLogger("etc_agent.agent")

FORK_SERVER_WAIT_S = 120.0
"""Longest a joining agent waits for its fork server's imports before it registers anyway."""


class Supervision:
    def __init__(self, node: Node):
        self.node = node
        self._last_crash: tuple[int, tuple[tuple[int, int | None], ...]] | None = None
        self._end_watch = EndWatch(node.node_id)
        self._end_read_at = 0.0
        self.spares = SpareKeeper(node)
        """The node's warm spare worker (:mod:`etc_agent.agent.spares`)."""

    def check_workers(self, gen: GenerationRecord) -> None:
        node = self.node
        assert node.workers is not None  # the main loop checks workers only while there are some
        if node.elastic and node.config.worker_heartbeat_timeout > 0:
            self._kill_hung_workers(gen)
        codes = node.workers.poll()
        failed = {r: c for r, c in codes.items() if c not in (None, 0, RESTART_EXIT)}
        if failed and node.elastic:
            self.on_live_crash(gen, codes, failed)
        elif failed and node.superseded(gen):
            return  # a newer generation (a member's planned departure, say) restarts these workers anyway
        elif failed:
            self._fail_generation(gen, codes, failed)
        elif all(c == 0 for c in codes.values()):
            self._all_exited(gen, codes)

    def _fail_generation(self, gen: GenerationRecord, codes: dict[int, int | None], failed: dict[int, int]) -> None:
        node = self.node
        assert node.workers is not None
        summary = node.workers.failure_summary(node.host)
        node.emit("workers_failed", {"generation": gen.number, "exit_codes": failed})
        node.state.move(Phase.RECOVERING, gen.number)
        group = node.workers
        node.stop_workers("a local worker failed")
        # After the stop, as torchrun does: the workers stopped because of the failure are listed too.
        log.error("worker failure (generation %d):\n%s", gen.number, group.failure_report(node.script_name()))
        node.report(gen, _failed_status(codes, summary))

    def _all_exited(self, gen: GenerationRecord, codes: dict[int, int | None]) -> None:
        node = self.node
        assert node.workers is not None
        node.workers.close()
        node.workers = None
        if node.node_id not in gen.members:
            # A spare whose workers sent their state: it waits, without workers, for a generation that needs it.
            node.state.move(Phase.SPARE, gen.number)
            node.emit("spare", {"generation": gen.number, "members": len(gen.members), "workers": "state sent, exited"})
            return
        node.report(gen, NodeStatus(state="succeeded", exit_codes=codes))
        node.state.move(Phase.FINISHED, gen.number)
        node.emit("workers_succeeded", {"generation": gen.number})

    def _kill_hung_workers(self, gen: GenerationRecord) -> None:
        """A worker-API process that stopped talking (frozen, deadlocked with the GIL held) is killed so
        that the job handles it like a crash instead of every peer waiting on it."""
        node = self.node
        assert node.workers is not None  # only from check_workers()
        now = time.monotonic()
        codes = node.workers.poll()
        timeout = node.config.worker_heartbeat_timeout
        for local_rank, pid in node.workers.pids().items():
            seen = node.contacts.seen.get(local_rank)
            if seen is None or codes.get(local_rank) is not None or node.contacts.pid.get(local_rank) != pid:
                continue
            silent = now - seen
            if silent <= timeout:
                continue
            why = f"no word from it for {silent:.1f} s (--worker-heartbeat-timeout {timeout:g})"
            node.emit(
                "worker_hung",
                {
                    "generation": gen.number,
                    "local_rank": local_rank,
                    "pid": pid,
                    "silent_s": round(silent, 1),
                    "action": "SIGKILL, handled as a crash",
                },
            )
            log.error("worker local_rank %d (pid %d) on %s hung: %s; killing it", local_rank, pid, node.node_id, why)
            node.workers.kill(local_rank, why)
            node.contacts.seen.pop(local_rank, None)

    def on_live_crash(self, gen: GenerationRecord, codes: dict[int, int | None], failed: dict[int, int]) -> None:
        """A worker of a live job died: restart it now as a standby process and take this node out
        of the membership until it runs, so the others go on at once (this node's surviving workers
        send what they hold and wait); past ``--max-restarts`` the node leaves the job instead."""
        node = self.node
        assert node.workers is not None  # only from check_workers()
        pids = node.workers.pids()
        crash = (gen.number, tuple(sorted((r, pids.get(r)) for r in failed)))
        if crash == self._last_crash:
            return  # seen already (the checkpoint baseline restarts the worker with the next generation)
        self._last_crash = crash
        summary = node.workers.failure_summary(node.host)
        log.error("worker failure (generation %d):\n%s", gen.number, node.workers.failure_report(node.script_name()))
        if node.node_id in gen.members:
            node.state.move(Phase.RECOVERING, gen.number)
        limit = node.config.node_crash_restarts
        if node.num_crash_restarts >= limit:
            action = f"leaving the job: {node.num_crash_restarts}/{limit} crash restarts used (--max-restarts)"
            node.emit("workers_failed", {"generation": gen.number, "exit_codes": failed, "action": action})
            node.request_departure()
            return
        node.num_crash_restarts += 1
        if node.config.migration == "checkpoint":
            # The baseline restarts every worker of the generation after it (as torchrun does).
            action = "restart as joiners (--migration checkpoint)"
            node.emit("workers_failed", {"generation": gen.number, "exit_codes": failed, "action": action})
            node.report(gen, _failed_status(codes, summary))
            return
        self._restart_as_standby(gen, codes, failed, summary)

    def _restart_as_standby(
        self, gen: GenerationRecord, codes: dict[int, int | None], failed: dict[int, int], summary: str
    ) -> None:
        node = self.node
        assert node.workers is not None
        node.state.restarting(set(failed), gen.number)
        for local_rank in failed:
            node.contacts.hellos.discard(local_rank)
        try:
            node.put_record()  # out of the membership; the restarted ranks are no senders
        except StoreError as err:
            node.emit("store_unreachable", {"error": str(err), "pending": "leave the membership while restarting"})
        node.report(gen, _failed_status(codes, summary))
        # After the store heard of it: the leader's decision does not wait for the restart.
        from_spare = []
        for local_rank in failed:
            env = standby_env(node, local_rank, gen.number + 1)
            attempt_dir = node.run_dir / f"restart_{node.num_crash_restarts}"
            if self.spares.take(local_rank, env, attempt_dir):
                from_spare.append(local_rank)
            else:
                node.workers.restart(local_rank, env, attempt_dir)
        limit = node.config.node_crash_restarts
        node.emit(
            "workers_failed",
            {
                "generation": gen.number,
                "exit_codes": failed,
                "restarting": sorted(failed),
                "from_spare": from_spare,
                "action": f"restarting local ranks {sorted(failed)} ({node.num_crash_restarts}/{limit}); "
                "the others go on, this node rejoins once they run",
            },
        )

    def maybe_rejoin(self) -> None:
        """Back into the membership once every restarted worker said hello (a warm join); where the
        store cannot hear it, the node stays restarting and tries again on the next pass."""
        node = self.node
        state = node.state.state
        if not state.restarting or not state.restarting <= node.contacts.hellos:
            return
        latest = node.latest
        crashed_in = state.crashed_in if state.crashed_in is not None else -1
        if latest is not None and latest.number <= crashed_in and node.node_id in latest.members:
            # The leader has not answered the crash of a member yet: a warm spare says hello within
            # milliseconds, and a record ready again before the leader reads it would make the others
            # wait for this node's transfer instead of going on (faults.md). Back once the answer is
            # out (a crash while already out of the membership needs none).
            return
        rejoined = node.state.rejoined()
        try:
            node.put_record(rejoined)
        except StoreError as err:
            node.emit("store_unreachable", {"error": str(err), "pending": "rejoin after a restart"})
            return
        node.state.commit(rejoined)
        node.emit("workers_warm", {"note": "restarted workers run; this node rejoins the job"})

    def join_warm(self) -> None:
        """Joining a running elastic job: start the workers first (interpreter, torch, the script's
        imports) and register as ready only once they said hello, so the running ranks do not stall
        while this node's processes start. They wait for their assignment in ``job.start()``."""
        node = self.node
        try:
            elastic = node.store.get(keys.ELASTIC) is not None
            current = node.read_generation()
        except StoreError:
            return
        if not elastic or current is None or current.status != "running":
            return
        if node.spec.no_python or node.config.migration != "live":
            return
        node.state.warming()
        node.elastic = True
        # No rank yet: a standby worker learns it from its assignment once the node is a member.
        envs = [standby_env(node, local_rank, current.number + 1) for local_rank in range(node.config.nproc_per_node)]
        node.workers = node.make_workers(envs, node.run_dir / "standby")
        node.emit("workers_warming", {"workers": len(envs), "note": "joining once they run"})
        self._await_warm_workers()
        node.state.warmed()

    def _await_warm_workers(self) -> None:
        node = self.node
        assert node.workers is not None
        started = time.monotonic()
        deadline = started + node.config.join_timeout
        while time.monotonic() < deadline and not node.state.state.stop_requested and not node.state.state.leaving:
            if len(node.contacts.hellos) >= node.config.nproc_per_node:
                node.emit("workers_warm", {"seconds": round(time.monotonic() - started, 2)})
                return
            if any(code is not None for code in node.workers.poll().values()):
                # The script is not a worker-API script after all (or it failed at start): join normally.
                node.workers.stop(node.config.shutdown_timeout)
                node.workers = None
                node.elastic = False
                note = "a worker exited before saying hello; joining without warm start"
                node.emit("workers_warming_failed", {"note": note})
                return
            time.sleep(0.05)

    def warm_fork_server_before_joining(self) -> None:
        """Joining a running job restarts the others' workers (a plain script's) or brings this
        node's in (a worker-API script's): the fork server's imports are paid before this node
        registers, so the others' workers never wait for them in the rendezvous. A first start
        registers at once (the imports overlap the rendezvous)."""
        node = self.node
        forkserver = node.forkserver
        if forkserver is None:
            return
        try:
            current = node.read_generation()
        except StoreError:
            return
        if current is None or current.status != "running" or forkserver.ready.is_set():
            return
        started = time.monotonic()
        deadline = started + min(node.config.join_timeout, FORK_SERVER_WAIT_S)
        while not forkserver.ready.wait(0.1):
            if time.monotonic() >= deadline or node.state.state.stop_requested or node.state.state.leaving:
                break
        node.emit(
            "fork_server_warm" if forkserver.ready.is_set() else "fork_server_not_warm",
            {"seconds": round(time.monotonic() - started, 2), "note": "before joining the running job"},
        )

    def watch_end(self, now: float) -> None:
        """Who the end of the job waits for, said every 30 s (:mod:`etc_agent.agent.endwatch`); the
        statuses are read at most every 10 s."""
        node = self.node
        gen = node.generation
        done = node.state.state.phase == Phase.FINISHED
        if gen is None or gen.status != "running" or (node.workers is None and not done):
            return
        if now - self._end_read_at < self._end_watch.every_s / 3:
            return
        self._end_read_at = now
        try:
            kvs = node.store.get_prefix(keys.statuses(gen.number))
        except StoreError:
            return
        succeeded = {
            keys.node_of(kv.key)
            for kv in kvs
            if (status := node.reader.parse(NodeStatus, kv)) is not None and status.state == "succeeded"
        }
        pids = {}
        if node.workers is not None:
            codes = node.workers.poll()
            pids = {r: pid for r, pid in node.workers.pids().items() if codes.get(r) is None}
        said = self._end_watch.check(now, gen, done, succeeded, pids)
        if said is not None:
            node.emit(*said)


def _failed_status(codes: dict[int, int | None], summary: str) -> NodeStatus:
    return NodeStatus(state="failed", exit_codes={r: c for r, c in codes.items() if c is not None}, message=summary)
