"""A worker-API script that reads its rank before ``etc_agent.init()`` (a spare has none there):
data parallel, one replicated tensor, ``argv[1]`` steps of ``argv[2]`` seconds."""

import os
import sys
import time

import torch

import etc_agent

LOCAL_RANK = int(os.environ["LOCAL_RANK"])  # a spare, without a rank, fails here
job = etc_agent.init(parallel="tp=1,pp=1,dp=auto")


def build(ctx: etc_agent.ParallelContext) -> dict:
    model = torch.nn.Linear(4, 4)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


job.start(build)
for step in job.steps(int(sys.argv[1])):
    time.sleep(float(sys.argv[2]))
    if job.ctx.rank == 0:
        print(f"step {step} local_rank {LOCAL_RANK}", flush=True)
job.finish()
