"""Typed reads of a JSON request body and the 400s they raise (OpenAI's error shape), shared by
the request parsers (``protocol.py``) and the structured-output ones (``structured.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from common.runtime import RequestError


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(message, 400, "invalid_request_error", param, code)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def wrong_type(param: str, expected: str, value: Any) -> RequestError:
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} instead.",
        param,
        "invalid_type",
    )


def out_of_range(param: str, value: Any, allowed: str) -> RequestError:
    return bad_request(f"'{param}' must be {allowed}, got {value!r}.", param, "invalid_value")


class Body:
    """Typed reads of a request body's fields; null counts as absent."""

    def __init__(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise bad_request(f"The request body must be a JSON object, got {json_type(raw)}.")
        self.raw: dict[str, Any] = raw

    def get(self, name: str) -> Any:
        return self.raw.get(name)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise wrong_type(name, "a boolean", value)
        return value

    def optional_int(self, name: str) -> int | None:
        """An integer field of any size, or None; a wrong type is a 400."""
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 16.0 is 16, as pydantic (vLLM) reads it
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong_type(name, "an integer", value)
        return value

    def optional_integer(self, name: str, lo: int, hi: int) -> int | None:
        value = self.optional_int(name)
        if value is not None and not lo <= value <= hi:
            raise out_of_range(name, value, f"between {lo} and {hi}")
        return value

    def integer(self, name: str, default: int, lo: int, hi: int) -> int:
        value = self.optional_integer(name, lo, hi)
        return default if value is None else value

    def number(
        self, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False
    ) -> float:
        value = self.raw.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong_type(name, "a number", value)
        ok = (lo < value if lo_open else lo <= value) and value <= hi
        if not ok:  # NaN fails here too
            bracket = "(" if lo_open else "["
            raise out_of_range(name, value, f"in {bracket}{lo:g}, {hi:g}]")
        return float(value)

    def string(self, name: str) -> str | None:
        value = self.raw.get(name)
        if value is not None and not isinstance(value, str):
            raise wrong_type(name, "a string", value)
        return value


def check_unicode(value: Any, param: str = "") -> None:
    """Every string in the JSON value ``value`` (object keys too) is Unicode text
    (``unicode_text``); the error names the first that is not by its path. Iterative (the
    body may be nested as deep as the JSON decoder allows), and the path is built only for a
    string found bad: built for every element up front, a wide body cost gigabytes.
    ``param``: where ``value`` itself is (its paths are under it)."""

    def where(bad: Any) -> str:
        path = path_to(value, bad)
        if not param:
            return path
        return f"{param}{path}" if path.startswith("[") or not path else f"{param}.{path}"

    todo: list[Any] = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if not is_text(item):
                unicode_text(item, where(item))
        elif isinstance(item, dict):
            for key, sub in item.items():
                if not is_text(key):  # named by its object's path (the key is no text)
                    unicode_text(key, where(item) or "body")
                if isinstance(sub, str | dict | list):
                    todo.append(sub)
        elif isinstance(item, list):
            todo.extend(sub for sub in item if isinstance(sub, str | dict | list))


def is_text(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def path_to(root: Any, target: Any) -> str:
    """The path (``messages[0].content``) of ``target`` (that very object) in ``root``, depth
    first with one path on the way down."""
    parts: list[str] = []
    stack: list[Iterator[tuple[str, Any]]] = [iter([("", root)])]
    while stack:
        step = next(stack[-1], None)
        if step is None:
            stack.pop()
            if parts:
                parts.pop()
            continue
        part, item = step
        if item is target:
            return "".join([*parts, part]).lstrip(".")
        if isinstance(item, dict):
            parts.append(part)
            stack.append(iter((f".{k}", v) for k, v in item.items()))
        elif isinstance(item, list):
            parts.append(part)
            stack.append(iter((f"[{i}]", sub) for i, sub in enumerate(item)))
    return ""


def unicode_text(value: str, param: str) -> str:
    """``value`` if it is Unicode text. JSON may escape a lone surrogate (``"\\ud800"``),
    which is not: no tokenizer takes it and the mesh's msgpack (UTF-8) cannot carry it."""
    if is_text(value):
        return value
    surrogate = next(c for c in value if "\ud800" <= c <= "\udfff")
    raise bad_request(
        f"'{param}' holds a lone surrogate (U+{ord(surrogate):04X}), "
        "which is not valid Unicode text.",
        param,
        "invalid_value",
    )
