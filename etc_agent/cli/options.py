"""Command-line options generated from a pydantic model's fields, so every documented figure of a
cost model is a flag with the field's own description, and the two never drift apart.

Two ways: :func:`model_options` adds a model's fields to a command as optional overrides (a dict of
the flags given), :func:`flags_command` makes a command's options from a flags model (each field
an option or argument, its description the help, its default the default; :class:`Cli` in the
field's ``Annotated`` metadata where it is not spelled ``--field-name``) and hands the command the
model.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo


class OptionsError(ValueError):
    """A flag generated from a model field got a value the model rejects."""


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def model_options(model_cls: type[BaseModel], dest: str, panel: str | None = None) -> Callable:
    """Decorate a typer command: add one ``--field-name`` option per field of ``model_cls`` (help =
    the field's description and default) and pass the command ``dest=`` the dict of the flags given
    (field name -> value), to merge over defaults or a file and check with :func:`build_model`."""
    fields = model_cls.model_fields

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)  # typer reads __signature__ as is: no string annotations
        params = [p for p in sig.parameters.values() if p.name != dest]
        for name, field in fields.items():
            default = f"{field.default:g}" if isinstance(field.default, (int, float)) else "none"
            option = typer.Option(
                flag_name(name),
                help=f"{field.description} (default {default})",
                show_default=False,
                rich_help_panel=panel,
            )
            params.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=None,
                    annotation=Annotated[_value_type(field.annotation) | None, option],
                )
            )

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in fields if name in kwargs}
            kwargs[dest] = {name: value for name, value in given.items() if value is not None}
            return fn(*args, **kwargs)

        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


@dataclass(frozen=True)
class Cli:
    """How a field of a flags model (:func:`flags_command`) is given on the command line, where it is
    not the option ``--field-name``."""

    names: tuple[str, ...] = ()
    """The option's long spellings, instead of ``--field-name``."""
    short: tuple[str, ...] = ()
    """Short spellings before them (``-m``)."""
    torchrun: bool = False
    """torchrun's way: also spelled ``--field_name``, and read from ``PET_FIELD_NAME`` (not shown in the help)."""
    envvar: str | None = None
    argument: bool = False
    """A positional argument instead of an option."""


TORCHRUN = Cli(torchrun=True)


def _command_parameter(name: str, field: FieldInfo) -> inspect.Parameter:
    """The typer parameter of one field of a flags model."""
    cli = next((meta for meta in field.metadata if isinstance(meta, Cli)), Cli())
    info: Any
    if cli.argument:
        info = typer.Argument(help=field.description)
    elif cli.torchrun:
        names = [*cli.short, *(cli.names or [flag_name(name)]), *([f"--{name}"] if "_" in name else [])]
        info = typer.Option(*names, envvar=f"PET_{name.upper()}", show_envvar=False, help=field.description)
    else:
        info = typer.Option(*cli.short, *(cli.names or [flag_name(name)]), envvar=cli.envvar, help=field.description)
    default = inspect.Parameter.empty if field.is_required() else field.default
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[field.annotation, info]
    )


def flags_command(flags_cls: type[BaseModel], dest: str) -> Callable:
    """Decorate a typer command: one option (or argument) per field of ``flags_cls``, in the fields'
    order after the command's own parameters, and ``dest=`` the model of the values given."""
    fields = flags_cls.model_fields

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)  # typer reads __signature__ as is: no string annotations
        params = [p for p in sig.parameters.values() if p.name != dest]
        params += [_command_parameter(name, field) for name, field in fields.items()]

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            kwargs[dest] = flags_cls(**{name: kwargs.pop(name) for name in fields})
            return fn(*args, **kwargs)

        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


def _value_type(annotation: Any) -> Any:
    """``float`` for ``float``, ``float | None`` and ``Optional[float]``."""
    if get_origin(annotation) in (Union, types.UnionType):
        return next(a for a in get_args(annotation) if a is not type(None))
    return annotation


Model = TypeVar("Model", bound=BaseModel)


def build_model(
    model_cls: type[Model], values: dict[str, Any], source: str = "", names: Mapping[str, str] | None = None
) -> Model:
    """``model_cls(**values)``; a rejected value raises :class:`OptionsError` naming its flag
    (``names``: field -> how the user set it, e.g. ``--rdzv-conf lease_ttl``; default ``--field-name``)."""
    try:
        return model_cls(**values)
    except ValidationError as err:
        raise OptionsError(error_line(err, source, names)) from None


def error_line(err: ValidationError, source: str = "", names: Mapping[str, str] | None = None) -> str:
    """The first problem of ``err`` in one line: ``[source: ]name: message``, the name being how the
    user set the field; a check of several fields (no field) is its message alone."""
    problem = err.errors()[0]
    field = str(problem["loc"][0]) if problem["loc"] else ""
    name = ((names or {}).get(field) or flag_name(field)) if field else ""
    message = str(problem["ctx"]["error"]) if problem["type"] == "value_error" else problem["msg"]
    return ": ".join(part for part in (source, name, message) if part)
