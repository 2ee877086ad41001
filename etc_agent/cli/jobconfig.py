"""``etcrun --config job.yaml``: a job's flags kept in a file (``configs/jobs/``).

The file holds etcrun's options by their long names with underscores (``nproc_per_node: 2``,
``rdzv_endpoint: etcd:2379``), plus ``script`` and ``script_args`` for what follows them on the
command line; ``module: true`` runs ``script`` as a module, as ``-m`` does. Flags given on the
command line win over the file; a script given on the command line replaces the file's script and
its arguments. The accepted keys and their types are etcrun's own parameters, so the file cannot
drift from the CLI; an unknown key or a value of the wrong type is an error naming it.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

RENAMED = {"script": "training_script", "script_args": "training_script_args"}
"""File keys -> etcrun parameter names."""
_FILE_KEY = {parameter: key for key, parameter in RENAMED.items()}


def _model_for(command: Callable) -> type[BaseModel]:
    hints = typing.get_type_hints(command, include_extras=True)
    fields: dict[str, Any] = {}
    for name in inspect.signature(command).parameters:
        if name in ("ctx", "config"):
            continue
        annotation = hints[name]
        base = typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation
        fields[_FILE_KEY.get(name, name)] = (base | None, None)
    return create_model("JobConfig", __config__=ConfigDict(extra="forbid"), **fields)


def load_job_config(path: Path, command: Callable) -> dict[str, Any]:
    """etcrun parameter name -> value for every key set in the YAML file ``path``."""
    if not path.exists():
        raise ValueError(f"--config {path}: no such file")
    if path.is_dir():
        raise ValueError(f"--config {path}: a directory, not a YAML file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--config {path}: cannot read it as text ({type(err).__name__}: {err})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a mapping of etcrun options, got {type(raw).__name__}")
    for key in ("nproc_per_node", "nnodes"):  # N or a word (gpu, 1:4): the CLI reads them as text
        if isinstance(raw.get(key), int) and not isinstance(raw.get(key), bool):
            raw[key] = str(raw[key])
    model = _model_for(command)
    try:
        parsed = model.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        hint = (
            "; keys are etcrun's long options with underscores, plus script and script_args"
            if first["type"] == "extra_forbidden"
            else ""
        )
        raise ValueError(f"--config {path}: {where}: {first['msg']}{hint}") from None
    values = parsed.model_dump(exclude_unset=True)
    return {RENAMED.get(key, key): value for key, value in values.items()}


def split_config_flag(argv: list[str], value_options: set[str]) -> tuple[Path | None, list[str]]:
    """``(--config path or None, argv without it)``. Only etcrun's own flags count: scanning stops at
    the training script (the first word that is neither a flag nor a flag's value), whose arguments
    may have a ``--config`` of their own. ``value_options``: etcrun's flags that take a value."""
    out: list[str] = []
    path: Path | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file (a job YAML, e.g. configs/jobs/megatron-gpt.yaml)")
            path = Path(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1])
            i += 1
            continue
        if arg == "--" or not arg.startswith("-"):
            out.extend(argv[i:])
            break
        out.append(arg)
        if arg in value_options and i + 1 < len(argv):
            out.append(argv[i + 1])
            i += 1
        i += 1
    return path, out
