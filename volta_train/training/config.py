"""Training configuration: dataclasses filled from defaults, then a YAML file, then the command line.

Every field of a config dataclass is both a YAML key (``seq_len: 4096``) and a
flag (``--seq-len 4096``); booleans get ``--x``/``--no-x``. A field whose type
is itself a dataclass is a *section*: a YAML mapping (``optimizer: {lr: 3e-4}``)
whose keys are flags with the section's name in front (``--optimizer.lr 3e-4``).
Error messages name keys with dots (``optimizer.lr``), the way they are written
on the command line.

A field left at ``None`` means "auto": :func:`resolve_auto` fills it from a
per-device table (small and fast on CPU, long sequences and fp16 on a GPU), so
that ``python recipes/gpt_long.py`` does something sensible everywhere.

YAML files are read with a ``yaml.SafeLoader`` (no Python objects can be built
from a file) that also refuses duplicate keys; an unknown key or a value of the
wrong type is a :class:`ConfigError` naming the key and the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, NoReturn

import yaml


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type or inconsistent values."""


USAGE_EXIT = 2  # a usage error's exit status, argparse's: a bad flag, a bad YAML value, an unknown --config


class UsageStatus(int):
    """The exit status :data:`USAGE_EXIT` carrying its message: ``str()`` of it is the message, so code that reads
    ``SystemExit.code`` as text (as for the recipes' other errors) still reads it."""

    message: str

    def __new__(cls, message: str):
        status = super().__new__(cls, USAGE_EXIT)
        status.message = message
        return status

    def __str__(self) -> str:
        return self.message


def usage_error(prog: str, message: str) -> NoReturn:
    """``prog: error: message`` on stderr and exit :data:`USAGE_EXIT`, as argparse does for a bad flag."""
    text = f"{prog}: error: {message}"
    print(text, file=sys.stderr)
    raise SystemExit(UsageStatus(text))


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose "unrecognized arguments" error suggests the closest flag (``--stpes``: did you mean
    ``--steps``?)."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = [o for o in self._option_string_actions if o.startswith("--")]
            hints = []
            for arg in message[len(prefix):].split():
                flag = arg.split("=", 1)[0]
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75) if flag.startswith("-") else []
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
            if hints:
                message += f" ({'; '.join(hints)})"
        super().error(message)


class _UniqueKeySafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain PyYAML keeps the last silently). Merge
    keys (``<<: *defaults``) stay valid: the mapping's own keys override the merged ones, as YAML defines."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # flattened by SafeLoader's construct_mapping
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def field(default, help: str, choices=None, unset: bool = False):
    """A dataclass field carrying its command-line help (and optional choices).

    A ``None`` default means "auto" (filled in later) unless ``unset=True`` (the option is simply absent).
    """
    metadata = {"help": help, "choices": choices, "unset": unset}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls, help: str = ""):
    """A dataclass field holding a nested section (a YAML mapping, flags ``--name.key``)."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "section": True})


def _base_type(tp) -> Any:
    """int for ``int`` and ``int | None``; the one non-None member of a union."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        members = [t for t in typing.get_args(tp) if t is not type(None)]
        assert len(members) == 1, tp
        return members[0]
    return tp


def _fields(cls) -> dict[str, tuple[dataclasses.Field, Any, bool]]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        nullable = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
        out[f.name] = (f, _base_type(tp), nullable)
    return out


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def leaf_fields(cls, prefix: str = "") -> dict[str, tuple[dataclasses.Field, Any, bool]]:
    """Every option of ``cls`` by dotted name (``optimizer.lr``); sections are walked, not listed."""
    out = {}
    for name, (f, tp, nullable) in _fields(cls).items():
        if _is_section(tp):
            out.update(leaf_fields(tp, f"{prefix}{name}."))
        else:
            out[prefix + name] = (f, tp, nullable)
    return out


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return getattr(tp, "__name__", str(tp))


def coerce(name: str, value: Any, tp, nullable: bool, where: str = "") -> Any:
    """Check (and mildly convert) one value: ints stay ints, ``3e-4`` strings become floats, etc."""
    prefix = f"{where}: " if where else ""
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{prefix}{name} cannot be null")
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        items = value if isinstance(value, list) else [value]
        return [coerce(f"{name}[{i}]", v, item_tp, False, where) for i, v in enumerate(items)]
    if origin is dict or tp is dict:
        if isinstance(value, str):  # from the command line: JSON
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{prefix}{name} must be a mapping (JSON on the command line): {e}") from None
        if isinstance(value, dict):
            return {str(k): v for k, v in value.items()}
    elif tp is bool:
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
    raise ConfigError(f"{prefix}{name} must be {_type_name(tp)}, got {value!r} ({type(value).__name__}){hint}")


def _check_choice(name: str, f: dataclasses.Field, value: Any, where: str) -> None:
    choices = f.metadata.get("choices")
    if choices and value is not None and value not in choices:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}{name} is {value!r}; accepted: {', '.join(map(str, choices))}")


def _unknown(where: str, key: str, known: list[str], prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
    scope = f" in {prefix[:-1]}" if prefix else ""
    return ConfigError(f"{where}: unknown key {prefix + key!r}{hint}; known keys{scope}: {', '.join(known)}")


def _flatten(raw: dict, cls, where: str, prefix: str = "") -> dict[str, Any]:
    fields = _fields(cls)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if "." in name:  # a dotted key at any level: optimizer.lr: 3e-4
            head, rest = name.split(".", 1)
            value, name = {rest: value}, head
        if name not in fields:
            raise _unknown(where, name, list(fields), prefix)
        f, tp, nullable = fields[name]
        if _is_section(tp):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{where}: {prefix + name} is a section: expected a mapping of option: value, got {value!r}"
                )
            out.update(_flatten(value, tp, where, f"{prefix}{name}."))
            continue
        value = coerce(prefix + name, value, tp, nullable, where)
        _check_choice(prefix + name, f, value, where)
        out[prefix + name] = value
    return out


def load_yaml(path: str | Path, cls) -> dict[str, Any]:
    """The YAML file's options by dotted name, checked against ``cls`` (dashes allowed for underscores)."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeySafeLoader)  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a directory") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of option: value, got {type(raw).__name__}")
    return _flatten(raw, cls, str(path))


def from_flat(cls, values: dict[str, Any], prefix: str = ""):
    """Build ``cls`` (and its sections) from dotted names; missing options keep their defaults."""
    kwargs = {}
    for name, (f, tp, _) in _fields(cls).items():
        if _is_section(tp):
            kwargs[name] = from_flat(tp, values, f"{prefix}{name}.")
        elif prefix + name in values:
            kwargs[name] = values[prefix + name]
    return cls(**kwargs)


def build_parser(cls, description: str) -> argparse.ArgumentParser:
    """--config plus one flag per option; flags not given on the command line stay out of the namespace."""
    parser = _Parser(
        description=description, argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="YAML", help="YAML file of options; command-line flags override it")
    groups: dict[str, Any] = {}
    for name, (f, tp, _) in leaf_fields(cls).items():
        head = name.rsplit(".", 1)[0] if "." in name else ""
        if head and head not in groups:
            groups[head] = parser.add_argument_group(f"{head} (YAML section {head!r})")
        target = groups.get(head, parser)
        flag = "--" + name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if default is not None:
            help_text = f"{help_text} (default: {default})"
        elif f.metadata.get("unset"):
            help_text = f"{help_text} (default: unset)"
        elif "auto" not in help_text:
            help_text = f"{help_text} (default: auto)"
        if tp is bool:
            # --x / --no-x; in a section --model.patch / --model.no-patch
            head_flag, _, leaf = flag.rpartition(".")
            negative = f"{head_flag}.no-{leaf}" if head_flag else "--no-" + flag[2:]
            target.add_argument(flag, dest=name, action="store_const", const=True,
                                help=f"{help_text}; {negative} turns it off")
            target.add_argument(negative, dest=name, action="store_const", const=False, help=argparse.SUPPRESS)
        elif typing.get_origin(tp) is list:
            (item_tp,) = typing.get_args(tp)
            target.add_argument(flag, dest=name, type=item_tp, nargs="+", metavar=name.rsplit(".", 1)[-1].upper(),
                                help=help_text)
        else:
            choices = f.metadata.get("choices")
            arg_type = str if (tp is dict or typing.get_origin(tp) is dict) else tp
            metavar = None if choices else name.rsplit(".", 1)[-1].upper()
            target.add_argument(flag, dest=name, type=arg_type, choices=choices, metavar=metavar, help=help_text)
    return parser


def parse_config(cls, argv=None, description: str = ""):
    """defaults < ``--config`` YAML < command-line flags. Errors exit through ``parser.error`` (status 2)."""
    parser = build_parser(cls, description)
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    config_path = args.pop("config", None)
    leaves = leaf_fields(cls)
    try:
        if config_path:
            values.update(load_yaml(config_path, cls))
        for name, value in args.items():
            _, tp, nullable = leaves[name]
            values[name] = coerce(name, value, tp, nullable, "command line")
        return from_flat(cls, values)
    except ConfigError as e:
        parser.error(str(e))


def check_number(name: str, value, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, integer: bool = False, note: str = "") -> None:
    """``value`` must be a finite number (an int when ``integer``) within [low, high] (``*_open``: strict);
    otherwise a :class:`ConfigError` naming ``name``, the value and the accepted range (``note`` appended)."""
    lo = "" if low is None else f"{'(' if low_open else '['}{low:g}"
    hi = "" if high is None else f"{high:g}{')' if high_open else ']'}"
    if low is not None and high is not None:
        accepted = f"a finite number in {lo}, {hi}"
    elif low is not None:
        accepted = f"a finite number {'>' if low_open else '>='} {low:g}"
    elif high is not None:
        accepted = f"a finite number {'<' if high_open else '<='} {high:g}"
    else:
        accepted = "a finite number"
    if integer:
        accepted = accepted.replace("a finite number", "an integer")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = isinstance(value, int)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ConfigError(f"{name} must be {accepted}, got {value!r}{'; ' + note if note else ''}")


def check_optimization(values: dict[str, tuple[str, Any]]) -> None:
    """The optimizer, schedule and loss-scaling options both recipes share, by kind.

    ``values`` maps a kind (``lr``, ``weight_decay``, ``beta1``, ``beta2``, ``eps``, ``momentum``,
    ``grad_clip``, ``warmup_steps``, ``min_lr_ratio``, ``loss_scale_init``, ``loss_scale_window``,
    ``max_consecutive_skips``, ``time_limit_min``) to (the option's name as the user writes it, its value);
    kinds a recipe lacks are simply left out.
    """
    ranges: dict[str, tuple[tuple, dict]] = {
        "lr": ((0, None), {"low_open": True}),
        "weight_decay": ((0, None), {}),
        "beta1": ((0, 1), {"high_open": True}),
        "beta2": ((0, 1), {"high_open": True}),
        "eps": ((0, None), {"low_open": True}),
        "momentum": ((0, 1), {"high_open": True}),
        "grad_clip": ((0, None), {"note": "0 turns clipping off"}),
        "warmup_steps": ((0, None), {"integer": True}),
        "min_lr_ratio": ((0, 1), {}),
        "loss_scale_init": ((0, None), {"low_open": True}),
        "loss_scale_window": ((1, None), {"integer": True}),
        "max_consecutive_skips": ((1, None), {"integer": True}),
        "time_limit_min": ((0, None), {"note": "0: no limit"}),
    }
    for kind, (name, value) in values.items():
        (low, high), kwargs = ranges[kind]
        if value is not None:
            check_number(name, value, low, high, **kwargs)


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_yaml(cfg, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def resolve_auto(cfg, table: dict[str, Any]):
    """A copy of ``cfg`` with every ``None`` field that ``table`` names set to the table's value."""
    updates = {k: v for k, v in table.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **updates)
