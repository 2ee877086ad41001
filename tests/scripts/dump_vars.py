"""Writes the environment variables named after the output folder to ``<out>/<RANK>.json``."""

import json
import os
import sys

out_dir, names = sys.argv[1], sys.argv[2:]
with open(os.path.join(out_dir, f"{os.environ['RANK']}.json"), "w") as f:
    json.dump({name: os.environ.get(name) for name in names}, f)
