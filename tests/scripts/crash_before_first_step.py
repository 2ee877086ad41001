"""A worker-API script whose state is sharded without replicas (each rank holds its own range of
``z``, as ZeRO does); rank 1 dies once before the first optimizer step. Nothing was trained, so
the job must rebuild the initial state rather than report the dead rank's range as lost."""

import os
import sys
import time

import torch

import etc_agent
from etc_agent.layout.boxes import balanced_range
from etc_agent.migrate.describe import BoxedTensor

NUM_ELEMENTS = 24
job = etc_agent.init(parallel="tp=1,pp=1,dp=auto")
marker = sys.argv[2]


def build(ctx: etc_agent.ParallelContext) -> dict:
    start, length = balanced_range(NUM_ELEMENTS, ctx.world_size, ctx.rank)
    z = torch.nn.Parameter(torch.arange(start, start + length, dtype=torch.float32))
    return {
        "z": BoxedTensor(z.data, (NUM_ELEMENTS,), (0,), (NUM_ELEMENTS,), (start, start + length)),
        "optim": torch.optim.SGD([z], lr=0.5),
    }


job.start(build)
for step in job.steps(int(sys.argv[1])):
    z = job.state["optim"].param_groups[0]["params"][0]
    if step == 0 and job.ctx.rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)  # a crash before anyone stepped
    z.grad = torch.ones_like(z)
    job.state["optim"].step()
    time.sleep(0.05)
    full = job.gather_state()
    if full is not None:
        print(f"step {step} world {job.ctx.world_size} z {full['z'].tolist()}", flush=True)
job.finish()
