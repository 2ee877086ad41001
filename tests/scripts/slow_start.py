"""A worker-API script whose processes take a while before ``job.start()`` (slow imports, a big
dataset index): a node that joins meanwhile must not find the job "without state".

Arguments: the number of steps, then a file the processes wait for before ``job.start()`` (at most
120 s)."""

import sys
import time
from pathlib import Path

import torch

import etc_agent

job = etc_agent.init(parallel="tp=1,pp=1,dp=auto")
go, deadline = Path(sys.argv[2]), time.monotonic() + 120
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)


def build(ctx: etc_agent.ParallelContext) -> dict:
    model = torch.nn.Linear(4, 4)
    torch.manual_seed(0)
    with torch.no_grad():
        model.weight.copy_(torch.arange(16, dtype=torch.float32).view(4, 4) / 16)
        model.bias.zero_()
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


job.start(build)
for step in job.steps(int(sys.argv[1])):
    model, optim = job.state["model"], job.state["optim"]
    loss = model(torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    for p in model.parameters():  # data parallel: average the gradients
        torch.distributed.all_reduce(p.grad, group=job.ctx.dp_group)
        p.grad /= job.ctx.dp
    optim.step()
    optim.zero_grad()
    time.sleep(0.05)
    if job.ctx.rank == 0:
        print(f"step {step} world {job.ctx.world_size} loss {loss.item():.6f}", flush=True)
job.finish()
