"""Fails on RANK 1 through torch's ``@record`` (which writes the error file); the others wait."""

import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if os.environ["RANK"] == "1":
        raise RuntimeError("deliberate failure on rank 1")
    time.sleep(30)


main()
