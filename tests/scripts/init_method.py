"""A plain torchrun script: ``init_process_group`` with the ``--init-method`` it is given (``env://``
or ``tcp://host:port``), one all-reduce of a one-hot vector, then a file named after its rank."""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--init-method", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group(
    "gloo", init_method=args.init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
)
one_hot = torch.zeros(world_size, dtype=torch.int64)
one_hot[rank] = 1
dist.all_reduce(one_hot)
assert one_hot.tolist() == [1] * world_size, one_hot
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(args.out, f"{rank}.txt"), "w") as f:
    f.write(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\n")
