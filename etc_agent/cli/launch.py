"""etcrun's last step: open the stores, run this node's agent until the job ends for it, and keep
serving the embedded store after a departure while other agents still need it."""

from __future__ import annotations

import logging
import os
import signal

from etc_agent.agent.agent import Agent, install_signal_handlers
from etc_agent.agent.config import AgentConfig
from etc_agent.agent.console import add_log_file, configure_logging, console_level
from etc_agent.agent.workers import WorkerSpec
from etc_agent.cli.etcrun_flags import EtcrunFlags
from etc_agent.cli.rdzv import Rendezvous, open_stores
from etc_agent.protocol import keys
from etc_agent.rendezvous.store import MembershipStore

log = logging.getLogger("etc_agent.etcrun")
OMP_BANNER = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
    "being overloaded, please further tune the variable for optimal performance in your application as needed. \n"
    "*****************************************"
)
"""What torchrun says when it sets OMP_NUM_THREADS for the workers."""


def run_agent(
    config: AgentConfig, spec: WorkerSpec, rdzv: Rendezvous, f: EtcrunFlags, handled_signals: list[signal.Signals]
) -> int:
    """Open the stores, run the agent until the job ends for this node; its exit code."""
    configure_logging(console_level(f.log_level, os.environ), f.log_format)
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        log.warning(OMP_BANNER)
    store, server, workers_store = open_stores(rdzv, f, wait_s=min(config.join_timeout, 60.0))
    agent = Agent(config, spec, store, workers_store=workers_store)
    log_file = add_log_file(agent.log_file)
    install_signal_handlers(agent, handled_signals)
    try:
        code = agent.run()
        if server is not None and agent.leaving.is_set():
            _keep_serving_store(store, agent)
    finally:
        logging.getLogger().removeHandler(log_file)
        log_file.close()
        store.close()
        if server is not None:
            server.stop()
    return code


def _keep_serving_store(store: MembershipStore, agent: Agent) -> None:
    """A departing agent that hosts the embedded store keeps serving it while other agents remain.

    Its devices have left the job; the process stays until the others are gone, since they cannot
    go on without the store. (Jobs where any node may leave at any time should use etcd.)
    """
    announced = False
    while not agent.hard_stop.is_set():
        others = [kv for kv in store.get_prefix(keys.NODES) if not kv.key.endswith(agent.node_id)]
        if not others:
            return
        if not announced:
            agent.emit(
                "store_host_staying",
                {
                    "other_agents": len(others),
                    "note": "this agent hosts the embedded store and serves it until the others leave; "
                    "a second SIGTERM stops it now (use etcd to avoid this)",
                },
            )
            announced = True
        agent.hard_stop.wait(1.0)
