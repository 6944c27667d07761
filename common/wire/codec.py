"""The wire codec: typed, versioned, msgpack-encoded messages, validated on decode.

A message is a frozen dataclass; on the wire it is a msgpack map with its fields (those that
differ from their defaults) plus ``"t"`` (type name) and ``"v"`` (schema version). ``decode``
checks the tag, the version and every field's type (nested messages included) and raises
``MessageError`` naming the bad field, so a malformed message is a clear error for the
receiver, never a crash deep in a handler.

The decoder resolves a class's field types with ``typing.get_type_hints`` in the globals of
the module that defines it: a message whose fields name a message class of another module must
import that class at module level (not under ``TYPE_CHECKING``), or decoding it fails.

The message classes are in the other modules of ``common.wire``, one per receiving service.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, Union, cast

import msgpack

SCHEMA_VERSION = 1

M = TypeVar("M", bound="Message")


class MessageError(ValueError):
    """A payload that is not the message it claims to be."""


class Message:
    """Base of every wire message (subclasses are frozen dataclasses)."""

    VERSION: ClassVar[int] = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults (the decoder fills in the rest): a field
        a message rarely sets costs nothing on the wire."""
        out = {}
        for name, has_default, default in _defaults(cast(Any, type(self))):
            value = getattr(self, name)
            if not has_default or value != default:
                out[name] = _plain(value)
        return out

    def encode(self) -> bytes:
        payload = self.to_dict()
        payload["t"] = type(self).__name__
        payload["v"] = self.VERSION
        return msgpack.packb(payload, use_bin_type=True)  # type: ignore[no-any-return]

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise MessageError(f"{cls.__name__}: payload is not msgpack ({exc})") from exc
        if not isinstance(raw, dict):
            raise MessageError(f"{cls.__name__}: payload is not a map")
        tag, version = raw.pop("t", None), raw.pop("v", None)
        if tag != cls.__name__:
            raise MessageError(f"expected a {cls.__name__} message, got {tag!r}")
        if version != cls.VERSION:
            raise MessageError(f"{cls.__name__}: unsupported schema version {version!r}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls: type[M], raw: dict[str, Any], path: str = "") -> M:
        where = path or cls.__name__
        kwargs = {}
        for name, convert, required in _plan(cast(Any, cls)):
            if name in raw:
                kwargs[name] = convert(raw[name], f"{where}.{name}")
            elif required:
                raise MessageError(f"{where}: missing field {name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise MessageError(f"{where}: {exc}") from exc


def decode_any(data: bytes, *kinds: type[Message]) -> Message:
    """Decode a payload that may be any of ``kinds`` (chosen by its type tag)."""
    try:
        tag = msgpack.unpackb(data, raw=False, strict_map_key=False).get("t")
    except Exception as exc:
        raise MessageError(f"payload is not a msgpack map ({exc})") from exc
    for kind in kinds:
        if kind.__name__ == tag:
            return kind.decode(data)
    raise MessageError(f"unexpected message type {tag!r}")


# Room a sender leaves under the server's max_payload for a message's NATS headers (the trace
# context), when it splits what it sends to fit.
PAYLOAD_HEADROOM = 1024
T = TypeVar("T")


def encode_within(
    items: list[T], build: Callable[[list[T]], Message], limit: int
) -> tuple[list[tuple[bytes, list[T]]], list[T]]:
    """``build(items)`` as encoded messages of at most ``limit`` bytes each, with the items each
    holds: usually one, split in halves while too large. An item that alone exceeds the limit
    cannot be sent at all: those come back apart (second value)."""
    data = build(items).encode()
    if len(data) <= limit:
        return [(data, items)], []
    if len(items) == 1:
        return [], items
    half = len(items) // 2
    first, first_bad = encode_within(items[:half], build, limit)
    rest, rest_bad = encode_within(items[half:], build, limit)
    return first + rest, first_bad + rest_bad


def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_dict()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@functools.cache
def _defaults(cls: Any) -> tuple[tuple[str, bool, Any], ...]:  # a Message subclass
    """Each field's name, whether it has a default, and that default (a factory's value)."""
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append((f.name, True, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((f.name, True, f.default_factory()))
        else:
            out.append((f.name, False, None))
    return tuple(out)


# Decoding is on every hop of a request, so each message class's field types are turned into
# converter functions once (typing.get_type_hints re-evaluates every annotation string per
# call: it was most of a ~0.6 ms decode of a 50-token request). A converter takes the raw
# value and the field's path (for the error message) and returns the typed value.
Converter = Callable[[Any, str], Any]


@functools.cache
def _plan(cls: Any) -> tuple[tuple[str, Converter, bool], ...]:  # a Message subclass
    hints = typing.get_type_hints(cls)
    return tuple(
        (
            f.name,
            _converter(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    )


def _converter(hint: Any) -> Converter:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union(typing.get_args(hint))
    if origin is list or origin is tuple:
        args = typing.get_args(hint)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return _fixed_tuple(args)
        return _sequence(args[0], origin)
    if origin is dict:
        return _mapping(*typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, Message):
        return _nested(hint)
    if hint is Any:
        return lambda value, path: value
    if hint is float:
        return _float
    if hint is int:
        return _int
    if hint in (str, bool, bytes):
        return _exact(hint)
    raise TypeError(f"unsupported message field type {hint!r}")


def _union(options: tuple[Any, ...]) -> Converter:
    none_ok = type(None) in options
    converters = [_converter(o) for o in options if o is not type(None)]

    def convert(value: Any, path: str) -> Any:
        if value is None and none_ok:
            return None
        errors = []
        for option in converters:
            try:
                return option(value, path)
            except MessageError as exc:
                errors.append(str(exc))
        raise MessageError(errors[0] if len(errors) == 1 else f"{path}: no variant matches")

    return convert


def _fixed_tuple(args: tuple[Any, ...]) -> Converter:
    converters = [_converter(a) for a in args]

    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, list | tuple):
            raise MessageError(f"{path}: expected a list, got {type(value).__name__}")
        if len(value) != len(converters):
            raise MessageError(f"{path}: expected {len(converters)} items, got {len(value)}")
        return tuple(
            c(v, f"{path}[{i}]") for i, (v, c) in enumerate(zip(value, converters, strict=True))
        )

    return convert


def _sequence(item_hint: Any, origin: Any) -> Converter:
    item = _converter(item_hint)
    # Token ids, hashes and strings: one C-speed type check for the whole list.
    exact = item_hint if item_hint in (int, str) else None

    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, list | tuple):
            raise MessageError(f"{path}: expected a list, got {type(value).__name__}")
        if exact is not None and all(type(v) is exact for v in value):
            items = list(value)
        else:
            items = [item(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items

    return convert


def _mapping(key_hint: Any, value_hint: Any) -> Converter:
    key, val = _converter(key_hint), _converter(value_hint)

    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise MessageError(f"{path}: expected a map, got {type(value).__name__}")
        return {key(k, f"{path} key"): val(v, f"{path}[{k!r}]") for k, v in value.items()}

    return convert


def _nested(kind: type[Message]) -> Converter:
    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise MessageError(f"{path}: expected a map, got {type(value).__name__}")
        return kind.from_dict(value, path)

    return convert


def _float(value: Any, path: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise MessageError(f"{path}: expected a number, got {type(value).__name__}")


def _int(value: Any, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise MessageError(f"{path}: expected an integer, got {type(value).__name__}")


def _exact(kind: type) -> Converter:
    def convert(value: Any, path: str) -> Any:
        if isinstance(value, kind):
            return value
        raise MessageError(f"{path}: expected {kind.__name__}, got {type(value).__name__}")

    return convert


# --- range checks ------------------------------------------------------------------------------
# Types are checked by the decoder; values are checked by the messages' ``__post_init__``,
# which raises ValueError (``from_dict`` turns it into a MessageError, so the runtime drops the
# message with a log line). Mesh-state messages (heartbeats, presence) feed routing and health
# for every request: one nonsensical value (a page size of 0) must not reach them.
# A limit only one message checks is defined beside it (``MAX_CHOICES``, ``MAX_SHARDS``).

MAX_ID_LEN = 256  # executor and instance ids travel in subjects and metric labels
MAX_PAGE_SIZE = 1 << 16  # tokens per KV page; real meshes use 1..256


def require(kind: str, checks: dict[str, bool]) -> None:
    failed = [what for what, ok in checks.items() if not ok]
    if failed:
        raise ValueError(f"{kind}: " + "; ".join(failed))


def id_ok(value: str) -> bool:
    """An id that may be spliced into a subject: non-empty, bounded, no whitespace or NATS
    wildcards, no empty subject token (dots are allowed: hostnames have them)."""
    return (
        0 < len(value) <= MAX_ID_LEN
        and not any(c.isspace() or c in "*>" for c in value)
        and "" not in value.split(".")
    )


def time_ok(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def page_size_ok(value: int) -> bool:
    return 1 <= value <= MAX_PAGE_SIZE
