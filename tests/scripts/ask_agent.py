"""A worker that asks its agent, over ETC_AGENT_ADDR, which generation it runs in, and sends it
malformed requests (each must get an error reply; the agent must go on serving)."""

import json
import os
import sys

from etc_agent.utils.jsonline import JsonLineError, parse_address, request

addr = parse_address(os.environ["ETC_AGENT_ADDR"])
hello = request(addr, {"op": "hello", "local_rank": int(os.environ["LOCAL_RANK"]), "pid": os.getpid()}, timeout=10)
errors = []
for bad in (
    {"op": "hello", "local_rank": -1},
    {"op": "hello", "local_rank": 99},
    {"op": "finished", "step": "many", "generation": 0},
    {"op": "migration", "record": {"generation": 1}},
    {"op": "reboot"},
    {"op": "fatal", "reason": 1, "extra": True},
):
    try:
        request(addr, bad, timeout=10)
        errors.append(None)
    except JsonLineError as err:
        errors.append(str(err))
gen = request(addr, {"op": "generation"}, timeout=10)
out = {
    "env_generation": os.environ["ETC_AGENT_GENERATION"],
    "hello": hello,
    "running": gen["running"]["number"],
    "world_size": sum(gen["running"]["num_devices"]),
    "node_id": gen["node_id"],
    "errors": errors,
}
with open(os.path.join(sys.argv[1], f"{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
