"""A worker-API script whose build() is wrong on purpose: after the first generation, rank 1 returns
a tensor of a different shape than everyone else (a layout mistake the job must name, not hide)."""

import sys
import time

import torch

import etc_agent

job = etc_agent.init(parallel="tp=1,pp=1,dp=auto")


def build(ctx: etc_agent.ParallelContext) -> dict:
    size = 9 if ctx.generation > 0 and ctx.rank == 1 else 8
    return {"w": torch.arange(size, dtype=torch.float32)}


job.start(build)
for step in job.steps(int(sys.argv[1])):
    time.sleep(0.1)
    if len(sys.argv) > 2 and job.ctx.rank == 0:
        with open(sys.argv[2], "a") as f:
            f.write(f"{step}\n")
job.finish()
