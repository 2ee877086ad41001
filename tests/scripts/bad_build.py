"""A worker-API script whose build() is wrong on purpose: after the first generation, rank 1 returns
a tensor of a different shape than everyone else, or (``missing-key``) leaves out a tensor every
other rank of its stage holds: layout mistakes the job must name, not hide."""

import sys
import time

import torch

import etc_agent

job = etc_agent.init(parallel="tp=1,pp=1,dp=auto")


MISSING_KEY = len(sys.argv) > 3 and sys.argv[3] == "missing-key"


def build(ctx: etc_agent.ParallelContext) -> dict:
    wrong = ctx.generation > 0 and ctx.rank == 1
    if MISSING_KEY:
        state = {"w": torch.arange(8, dtype=torch.float32)}
        if not wrong:
            state["b"] = torch.arange(4, dtype=torch.float32)
        return state
    return {"w": torch.arange(9 if wrong else 8, dtype=torch.float32)}


job.start(build)
for step in job.steps(int(sys.argv[1])):
    time.sleep(0.1)
    if len(sys.argv) > 2 and job.ctx.rank == 0:
        with open(sys.argv[2], "a") as f:
            f.write(f"{step}\n")
job.finish()
