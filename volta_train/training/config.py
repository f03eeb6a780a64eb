"""Training configuration: one dataclass, filled from defaults, then a YAML file, then the command line.

Every field of a config dataclass is both a YAML key (``seq_len: 4096``) and a
flag (``--seq-len 4096``); booleans get ``--x``/``--no-x``. A field left at
``None`` means "auto": :func:`resolve_auto` fills it from a per-device table
(small and fast on CPU, long sequences and fp16 on a GPU), so that
``python recipes/gpt_long.py`` does something sensible everywhere.

YAML files are read with ``yaml.safe_load``; an unknown key or a value of the
wrong type is a :class:`ConfigError` naming the key and the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type or inconsistent values."""


def field(default, help: str, choices=None):
    """A dataclass field carrying its command-line help (and optional choices)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def _base_type(tp) -> type:
    """int for ``int`` and ``int | None``; the one non-None member of a union."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        members = [t for t in typing.get_args(tp) if t is not type(None)]
        assert len(members) == 1, tp
        return members[0]
    return tp


def _fields(cls) -> dict[str, tuple[dataclasses.Field, type, bool]]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        nullable = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
        out[f.name] = (f, _base_type(tp), nullable)
    return out


def coerce(name: str, value: Any, tp: type, nullable: bool, where: str = "") -> Any:
    """Check (and mildly convert) one value: ints stay ints, ``3e-4`` strings become floats, etc."""
    prefix = f"{where}: " if where else ""
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{prefix}{name} cannot be null")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    hint = " (quote it: YAML reads yes/no/on/off as booleans)" if tp is str and isinstance(value, bool) else ""
    raise ConfigError(f"{prefix}{name} must be {tp.__name__}, got {value!r} ({type(value).__name__}){hint}")


def load_yaml(path: str | Path, cls) -> dict[str, Any]:
    """The YAML file's keys, checked against ``cls``'s fields (dashes allowed for underscores)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of option: value, got {type(raw).__name__}")
    known = _fields(cls)
    out = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}; known keys: {', '.join(known)}")
        f, tp, nullable = known[name]
        value = coerce(name, value, tp, nullable, str(path))
        choices = f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"{path}: {name} is {value!r}; accepted: {', '.join(map(str, choices))}")
        out[name] = value
    return out


def build_parser(cls, description: str) -> argparse.ArgumentParser:
    """--config plus one flag per field; flags not given on the command line stay out of the namespace."""
    parser = argparse.ArgumentParser(
        description=description, argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="YAML", help="YAML file of options; command-line flags override it")
    for name, (f, tp, _) in _fields(cls).items():
        flag = "--" + name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if f.default is not None:
            help_text = f"{help_text} (default: {f.default})"
        elif "auto:" not in help_text:
            help_text = f"{help_text} (default: auto)"
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            metavar = name.upper() if not f.metadata.get("choices") else None
            parser.add_argument(flag, type=tp, choices=f.metadata.get("choices"), metavar=metavar, help=help_text)
    return parser


def parse_config(cls, argv=None, description: str = ""):
    """defaults < ``--config`` YAML < command-line flags. Errors exit through ``parser.error`` (status 2)."""
    parser = build_parser(cls, description)
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    config_path = args.pop("config", None)
    try:
        if config_path:
            values.update(load_yaml(config_path, cls))
        values.update(args)
        return cls(**values)
    except ConfigError as e:
        parser.error(str(e))


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_yaml(cfg, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def resolve_auto(cfg, table: dict[str, Any]):
    """A copy of ``cfg`` with every ``None`` field that ``table`` names set to the table's value."""
    updates = {k: v for k, v in table.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **updates)
