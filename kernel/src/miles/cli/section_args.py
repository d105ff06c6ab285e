"""Command-line flags derived from a config section's pydantic model, and back to config overrides.

A server process of a run (the engine, the router, the session server) reads its settings from
the run's config file (``--config``); started by hand, it takes flags instead. Both are one table,
the section's model: :func:`add_section_arguments` adds one flag per field
(``max_running_requests`` -> ``--max-running-requests``), typed and documented from the field, and
:func:`section_overrides` turns the flags the user actually gave into ``section.key=value``
overrides for :func:`miles.config.load_config` (or :func:`miles.context.service_context`). The
values are then validated by the section model, with the config loader's messages, exactly as if
they had been written in the file; a flag left out leaves the file's value (or the default).

How a field becomes a flag (``X | None`` is read as ``X``; ``Annotated`` metadata is ignored):

==========================  ====================================================================
``bool``                    ``--x`` / ``--no-x``
``Literal[...]``, an Enum   a value among the choices
``int``, ``float``, ``str``  a value of that type (a ``Path`` is a string)
``list[scalar]``            repeatable: ``--x a --x b`` gives ``[a, b]`` (replacing the file's list)
anything else               one JSON value: ``--middleware-options '{"metrics": {"window": 8}}'``
==========================  ====================================================================

The help of a flag is the field's description, its config key and its default.
"""

from __future__ import annotations

import argparse
import enum
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import yaml

if typing.TYPE_CHECKING:
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo

DEST_PREFIX = "miles-config:"
"""Prefix of the ``dest`` of every derived flag: ``args`` holds ``"miles-config:engine.seed"``
(read with ``getattr``), so derived flags never clash with a command's own arguments."""

_SEQUENCES = (list, set, frozenset, Sequence, typing.Sequence)


@dataclass(frozen=True, slots=True)
class _Shape:
    """How one field is read from the command line."""

    kind: str  # "bool" | "value" | "list" | "json"
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None


def add_config_file_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                             help: str | None = None) -> None:
    """``--config FILE`` (``args.config``, None when not given)."""
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=help or "a Miles config (YAML) to read the settings from; a run passes its folder's "
                                     "config.yaml. Flags given besides override its keys; without it, the defaults")


def add_section_arguments(parser: argparse.ArgumentParser, section: str, model: type[BaseModel], *,
                          only: Iterable[str] | None = None, exclude: Iterable[str] = (),
                          flags: Mapping[str, str | Sequence[str]] | None = None,
                          title: str | None = None) -> argparse._ArgumentGroup:
    """Add a flag for each field of ``model`` (the model of config section ``section``), in an
    argument group of their own; returns the group.

    :param only: the fields to add, in this order (default: every field, in the model's order).
    :param exclude: fields not to add (a process that does not read them).
    :param flags: option strings to use instead of the derived one, by field
        (``{"middlewares": "--middleware"}``; a sequence gives aliases).
    :param title: the group's title in ``--help`` (default: the section's name).
    """
    fields = model.model_fields
    names = list(only) if only is not None else list(fields)
    unknown = [name for name in (*names, *exclude, *(flags or {})) if name not in fields]
    if unknown:
        raise ValueError(f"{model.__name__} has no field(s) {unknown}; fields: {', '.join(fields)}")
    group = parser.add_argument_group(title or f"{section} settings",
                                      f"keys of the config's `{section}` section (a flag overrides the file's value)")
    defaults = _defaults(model)
    for name in names:
        if name in exclude:
            continue
        info = fields[name]
        options = (flags or {}).get(name) or "--" + name.replace("_", "-")
        option_strings = [options] if isinstance(options, str) else list(options)
        _add_one(group, option_strings, f"{section}.{name}", info, defaults.get(name))
    return group


def section_overrides(args: argparse.Namespace) -> list[str]:
    """``section.key=value`` for every derived flag the command line gave, in the order the flags
    were added (for :func:`miles.config.load_config`)."""
    return [config_override(dest[len(DEST_PREFIX):], value) for dest, value in vars(args).items()
            if dest.startswith(DEST_PREFIX) and value is not None]


def config_override(key: str, value: Any) -> str:
    """``key=value`` with ``value`` written so that the config loader reads it back as it is (a
    string stays a string even if it looks like a number; lists and mappings as YAML flow)."""
    if isinstance(value, PurePath):
        value = str(value)
    elif isinstance(value, enum.Enum):
        value = value.value
    elif isinstance(value, tuple | set | frozenset):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True)
    if text.endswith("\n...\n"):  # a lone scalar ends its document explicitly
        text = text[: -len("...\n")]
    return f"{key}={text.rstrip(chr(10))}"


# ----------------------------------------------------------------------------- one field


def _add_one(group: argparse._ArgumentGroup, option_strings: list[str], key: str, info: FieldInfo,
             default: Any) -> None:
    shape = _shape(info.annotation)
    help_text = _help(info, key, default, repeatable=shape.kind == "list")
    dest = DEST_PREFIX + key
    if shape.metavar is None and shape.choices is None:  # a string: named after its flag
        shape = _Shape(shape.kind, shape.type, None, option_strings[0].lstrip("-").replace("-", "_").upper())
    if shape.kind == "bool":
        group.add_argument(*option_strings, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                           help=help_text)
    elif shape.kind == "list":
        group.add_argument(*option_strings, dest=dest, action="append", default=None, type=shape.type or str,
                           choices=shape.choices, metavar=shape.metavar, help=help_text)
    elif shape.kind == "json":
        group.add_argument(*option_strings, dest=dest, default=None, type=_json_value, metavar="JSON",
                           help=help_text)
    else:
        group.add_argument(*option_strings, dest=dest, default=None, type=shape.type or str, choices=shape.choices,
                           metavar=shape.metavar, help=help_text)


def _shape(annotation: Any) -> _Shape:
    annotation = _unwrap(annotation)
    scalar = _scalar(annotation)
    if scalar is not None:
        return scalar
    origin = typing.get_origin(annotation)
    if origin in _SEQUENCES:
        (element,) = typing.get_args(annotation) or (str,)
        item = _scalar(_unwrap(element))
        if item is not None and item.kind == "value":
            return _Shape("list", item.type, item.choices, item.metavar)
    return _Shape("json")


def _unwrap(annotation: Any) -> Any:
    """``annotation`` without ``Annotated[...]`` and without ``| None``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            if len(rest) != 1:
                return annotation
            annotation = rest[0]
        else:
            return annotation


def _scalar(annotation: Any) -> _Shape | None:
    if annotation is bool:
        return _Shape("bool")
    if typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
        kinds = {type(choice) for choice in choices}
        kind = kinds.pop() if len(kinds) == 1 else str
        return _Shape("value", kind if kind in (int, float, str) else str, choices, None)
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return _Shape("value", str, tuple(str(member.value) for member in annotation), None)
        if issubclass(annotation, int):
            return _Shape("value", int, None, "N")
        if issubclass(annotation, float):
            return _Shape("value", float, None, "X")
        if issubclass(annotation, str):
            return _Shape("value", str, None, None)
        if issubclass(annotation, PurePath):
            return _Shape("value", str, None, None)
    return None


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None


def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    """The fields' defaults (those a default factory makes included); a field without one is left out."""
    out = {}
    for name, info in model.model_fields.items():
        if not info.is_required():
            out[name] = info.get_default(call_default_factory=True)
    return out


def _help(info: FieldInfo, key: str, default: Any, *, repeatable: bool = False) -> str:
    parts = [key]
    if default not in (None, [], {}, ()):
        parts.append(f"default {_shown(default)}")
    if repeatable:
        parts.append("repeat for several")
    where = "; ".join(parts)
    text = f"{info.description} ({where})" if info.description else f"({where})"
    return text.replace("%", "%%")  # argparse formats help with %


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, str | int | float | PurePath):
        return str(value)
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


__all__ = ["DEST_PREFIX", "add_config_file_argument", "add_section_arguments", "config_override", "section_overrides"]
