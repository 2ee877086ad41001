"""A worker that records its launch environment, then runs until told to stop (or fails on request)."""

import json
import os
import sys
import time

out_dir, seconds = sys.argv[1], float(sys.argv[2])
fail_until_restart = int(sys.argv[3]) if len(sys.argv) > 3 else 0
env = {
    k: os.environ.get(k)
    for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "ETC_AGENT_GENERATION")
}
name = f"gen{env['ETC_AGENT_GENERATION']}_rank{env['RANK']}.json"
with open(os.path.join(out_dir, name + ".tmp"), "w") as f:
    json.dump(env, f)
os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))  # readers never see half a file
if int(env["TORCHELASTIC_RESTART_COUNT"]) < fail_until_restart:
    sys.exit(3)
time.sleep(seconds)
