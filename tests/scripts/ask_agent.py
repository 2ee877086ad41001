"""A worker that asks its agent, over ETC_AGENT_ADDR, which generation it runs in, and sends it
malformed requests (each must get an error reply; the agent must go on serving)."""

import json
import os
import sys

from etc_agent.utils.auth import Key, worker_key
from etc_agent.utils.jsonline import JsonLineError, parse_address, request

addr = parse_address(os.environ["ETC_AGENT_ADDR"])
local_rank = int(os.environ["LOCAL_RANK"])
key = worker_key(os.environ["ETC_AGENT_ADDR"], local_rank)
hello = request(addr, {"op": "hello", "local_rank": local_rank, "pid": os.getpid()}, timeout=10, key=key)
errors = []
for bad in (
    {"op": "hello", "local_rank": -1},
    {"op": "hello", "local_rank": 99},
    {"op": "finished", "step": "many", "generation": 0},
    {"op": "migration", "record": {"generation": 1}},
    {"op": "reboot"},
    {"op": "fatal", "reason": 1, "extra": True},
    {"op": "hello", "local_rank": local_rank, "pid": 1},  # not the process the agent started
    {"op": "heartbeat", "local_rank": 1 - local_rank},  # another rank's name under this rank's key
    {"op": "finished", "step": 3, "generation": 0} if local_rank else {"op": "migration", "record": {}},
):
    try:
        request(addr, bad, timeout=10, key=key)
        errors.append(None)
    except JsonLineError as err:
        errors.append(str(err))
unsigned = []
for other in (Key(key.id, b"a key that is not this worker's"), Key("w99", key.secret), Key("agent", key.secret)):
    try:
        request(addr, {"op": "fatal", "reason": "forged"}, timeout=10, key=other)
        unsigned.append(None)
    except JsonLineError as err:
        unsigned.append(str(err))
gen = request(addr, {"op": "generation"}, timeout=10, key=key)
out = {
    "env_generation": os.environ["ETC_AGENT_GENERATION"],
    "hello": hello,
    "running": gen["running"]["number"],
    "world_size": sum(gen["running"]["num_devices"]),
    "node_id": gen["node_id"],
    "errors": errors,
    "unsigned": unsigned,
}
with open(os.path.join(sys.argv[1], f"{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
