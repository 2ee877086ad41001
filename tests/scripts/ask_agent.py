"""A worker that asks its agent, over ETC_AGENT_ADDR, which generation it runs in."""

import json
import os
import sys

from etc_agent.utils.jsonline import parse_address, request

addr = parse_address(os.environ["ETC_AGENT_ADDR"])
hello = request(addr, {"op": "hello", "local_rank": int(os.environ["LOCAL_RANK"]), "pid": os.getpid()}, timeout=10)
gen = request(addr, {"op": "generation"}, timeout=10)
out = {"env_generation": os.environ["ETC_AGENT_GENERATION"], "hello": hello, "running": gen["running"]["number"],
       "world_size": sum(gen["running"]["num_devices"]), "node_id": gen["node_id"]}
with open(os.path.join(sys.argv[1], f"{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
