"""Command-line flags and ``MESHSERVE_*`` variables derived from a service's config dataclass.

A service's frozen config dataclass is the one place a setting's name, default, help and
environment variable are written: each field declared with ``setting()`` becomes a flag, and
``build_parser`` / ``from_args`` turn the class into an argparse parser and parsed flags back
into the class. Naming, unless a setting says otherwise: field ``page_size`` is the flag
``--page-size``, and a flag ``--x-y`` is the variable ``MESHSERVE_X_Y`` (named after the flag,
not the field, since ``MESHSERVE_<FLAG>`` is what the README tells users). Precedence: flag,
then variable, then the dataclass default. Variables are read when the parser is built (what
``parse`` does on every call), and an empty variable counts as unset (compose writes
``${X:-}`` for the ones a user may leave out).

Types come from the annotations: ``int``, ``float``, ``str``, ``bool`` (a switch: the flag, or
its variable set to 1/true/yes, flips the default), ``T | None`` (an empty value is None) and
``tuple[str, ...]`` (comma-separated; the flag may be repeated). A field whose type is itself a
dataclass (``MeshConfig``) contributes its settings to the same parser; a field that is neither
is not a flag and keeps its default. Validation stays in each class's ``__post_init__``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    C = TypeVar("C", bound=DataclassInstance)

ENV_PREFIX = "MESHSERVE_"
TRUE = ("1", "true", "yes")
_METADATA_KEY = "meshserve.setting"
_SCALARS: tuple[type, ...] = (int, float, str, bool)


@dataclass(frozen=True)
class Setting:
    """What ``setting()`` stores in a field's metadata."""

    help: str
    flag: str | None = None  # default: from the field's name
    env: str | None = None  # the full variable name; default: from the flag
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # text -> value, for a spelling of its own


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    env: str | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field that is also a command-line flag and an environment variable.

    No ``default``: the field is required (the flag too, unless its variable is set or the
    type is Optional, whose default is then None). ``repr=False`` keeps a secret out of the
    start-up log and out of ``--help``.
    """
    metadata = {_METADATA_KEY: Setting(help, flag, env, choices, metavar, parse)}
    return dataclasses.field(default=default, repr=repr, metadata=metadata)


@dataclass(frozen=True)
class Option:
    """One setting of a config class, resolved: what the parser and the reader need."""

    name: str  # the field's
    flag: str
    env: str
    kind: type  # int, float, str, bool or tuple (of str)
    optional: bool
    default: Any  # MISSING: required
    secret: bool
    spec: Setting

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def convert(self, text: str) -> Any:
        """A flag's or variable's text as the field's value."""
        if self.spec.parse is not None:
            return self.spec.parse(text)
        if self.optional and text == "":
            return None
        if self.kind is tuple:
            return split_list(text)
        if self.kind is bool:
            return text.strip().lower() in TRUE
        return self.kind(text)


def split_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _kind(hint: Any, where: str) -> tuple[type, bool]:
    """(kind, optional) of an annotation; anything else is refused when the parser is built."""
    optional = False
    if get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint):
        others = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(others) == 1:
            hint, optional = others[0], True
    if get_origin(hint) is tuple and get_args(hint) == (str, ...):
        return tuple, optional
    if hint in _SCALARS and not (optional and hint is bool):
        return hint, optional
    raise TypeError(
        f"{where}: a setting must be int, float, str, bool, T | None or tuple[str, ...]"
    )


def _nested(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _members(cls: type[DataclassInstance]) -> list[tuple[str, Any, Option | None]]:
    """(field name, annotation, its Option or None) for each field of ``cls`` that is a
    setting or a config class of settings."""
    members: list[tuple[str, Any, Option | None]] = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if _nested(hint):
            members.append((f.name, hint, None))
            continue
        spec = f.metadata.get(_METADATA_KEY)
        if spec is None:
            continue
        kind, optional = _kind(hint, f"{cls.__name__}.{f.name}")
        if kind is bool and f.default is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a switch needs a default")
        if kind is tuple and spec.choices is not None:  # argparse would check the whole text
            raise TypeError(f"{cls.__name__}.{f.name}: check a list's items in __post_init__")
        flag = spec.flag or "--" + f.name.replace("_", "-")
        env = spec.env or ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()
        option = Option(f.name, flag, env, kind, optional, f.default, not f.repr, spec)
        members.append((f.name, hint, option))
    return members


def options(cls: type[DataclassInstance]) -> list[Option]:
    """Every setting of ``cls`` and of the config classes it holds, in field order."""
    found: list[Option] = []
    for _, hint, option in _members(cls):
        found += options(hint) if option is None else [option]
    return found


def _env_default(option: Option, parser: argparse.ArgumentParser) -> Any:
    """The option's default as its variable (if set) makes it; exits as argparse does."""
    text = os.environ.get(option.env, "")
    if text == "":
        return None if option.default is MISSING and option.optional else option.default
    if option.kind is bool:  # the variable stands for the switch
        return not option.default if option.convert(text) else option.default
    try:
        value = option.convert(text)
    except ValueError:
        parser.error(f"{option.env}: invalid {option.kind.__name__} value {text!r}")
    if option.spec.choices is not None and value not in option.spec.choices:
        parser.error(f"{option.env}: {text!r} is not one of {', '.join(option.spec.choices)}")
    return value


def _shown(value: Any) -> str:
    if value is None or value == ():
        return "none"
    if value == "":
        return "empty"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def _help(option: Option, default: Any) -> str:
    """The setting's help with what ``--help`` should say about it (argparse formats help
    with %-interpolation, hence the escaping)."""
    notes = []
    if option.kind is tuple:
        notes.append("comma-separated, repeatable")
    if option.kind is bool:
        notes.append(f"env {option.env}=1")
    elif default is MISSING:
        notes.append(f"required unless {option.env} is set")
    else:
        shown = "hidden" if option.secret and default not in (None, ()) else _shown(default)
        notes.append(f"default: {shown}; env {option.env}")
    text = f"{option.spec.help} ({'; '.join(notes)})" if option.spec.help else f"({notes[-1]})"
    return text.replace("%", "%%")


class _ListAction(argparse.Action):
    """Each use adds comma-separated items; the first replaces the default (a flag given
    replaces the variable's list rather than adding to it)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        kept = () if current is self.default else current
        setattr(namespace, self.dest, (*kept, *split_list(values)))


def _converter(option: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        return option.convert(text)

    convert.__name__ = option.kind.__name__  # argparse names it in "invalid int value"
    return convert


def add_settings(parser: argparse.ArgumentParser, cls: type[DataclassInstance]) -> None:
    """Add ``cls``'s flags to ``parser``, with defaults from the environment as it is now."""
    for option in options(cls):
        default = _env_default(option, parser)
        kwargs: dict[str, Any] = {"dest": option.dest, "help": _help(option, default)}
        if option.kind is bool:
            action = "store_false" if option.default else "store_true"
            parser.add_argument(option.flag, action=action, default=default, **kwargs)
            continue
        if option.spec.choices is None:  # with choices, argparse shows them instead
            kwargs["metavar"] = option.spec.metavar or option.dest.upper()
        if default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if option.kind is tuple:
            kwargs["action"] = _ListAction
        else:
            kwargs["type"] = _converter(option)
            kwargs["choices"] = option.spec.choices
        parser.add_argument(option.flag, **kwargs)


def build_parser(
    cls: type[DataclassInstance], prog: str | None = None, description: str | None = None
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_settings(parser, cls)
    return parser


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    """The config ``args`` (from a parser ``add_settings`` built for ``cls``) describe."""
    values = {
        name: from_args(hint, args) if option is None else getattr(args, option.dest)
        for name, hint, option in _members(cls)
    }
    return cls(**values)


def parse(
    cls: type[C],
    argv: list[str] | None = None,
    prog: str | None = None,
    description: str | None = None,
) -> C:
    """``cls`` from the command line (``sys.argv`` when ``argv`` is None) and environment."""
    return from_args(cls, build_parser(cls, prog, description).parse_args(argv))
