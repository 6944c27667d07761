"""common.settings: flags and MESHSERVE_* variables derived from a config dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from common.settings import build_parser, options, parse, setting


@dataclass(frozen=True)
class Inner:
    url: str = setting("nats://a:1", "where")


def even(text: str) -> int:
    value = int(text)
    if value % 2:
        raise ValueError("odd")
    return value


@dataclass(frozen=True)
class Demo:
    inner: Inner = field(default_factory=Inner)
    page_size: int = setting(16, "KV page size in tokens")
    ratio: float = setting(0.5, "a ratio")
    timeout_s: float = setting(2.0, "renamed flag", flag="--timeout")
    shard: int = setting(0, "renamed variable", env="MESHSERVE_DEMO_SHARD")
    mode: str = setting("off", "one of three", choices=("off", "on", "auto"))
    model: str | None = setting(None, "optional")
    port: int | None = setting(None, "optional number")
    verbose: bool = setting(False, "a switch")
    caching: bool = setting(True, "a switch that turns a default off", flag="--no-caching")
    stages: tuple[str, ...] = setting(("a", "b"), "a list")
    keys: tuple[str, ...] = setting((), "secrets", flag="--key", env="MESHSERVE_KEYS", repr=False)
    token: str | None = setting(None, "a secret", repr=False)
    even_number: int = setting(2, "own spelling", parse=even)
    internal: float = 0.25  # not a setting: no flag, keeps its default

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")


@dataclass(frozen=True)
class Required:
    draft: str = setting(help="required")
    maybe: str | None = setting(help="required field, optional flag")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for option in options(Demo) + options(Required):
        monkeypatch.delenv(option.env, raising=False)


def test_names_are_derived_from_the_field_unless_overridden():
    names = {o.name: (o.flag, o.env) for o in options(Demo)}
    assert names["url"] == ("--url", "MESHSERVE_URL")  # a nested class's settings come along
    assert names["page_size"] == ("--page-size", "MESHSERVE_PAGE_SIZE")
    assert names["timeout_s"] == ("--timeout", "MESHSERVE_TIMEOUT")  # the variable follows
    assert names["shard"] == ("--shard", "MESHSERVE_DEMO_SHARD")
    assert names["caching"] == ("--no-caching", "MESHSERVE_NO_CACHING")
    assert "internal" not in names


def test_defaults_are_the_dataclass_defaults():
    assert parse(Demo, []) == Demo()


def test_the_environment_overrides_defaults_and_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("MESHSERVE_PAGE_SIZE", "32")
    monkeypatch.setenv("MESHSERVE_TIMEOUT", "1.5")
    monkeypatch.setenv("MESHSERVE_DEMO_SHARD", "3")
    monkeypatch.setenv("MESHSERVE_URL", "nats://env:2")
    config = parse(Demo, [])
    assert (config.page_size, config.timeout_s, config.shard) == (32, 1.5, 3)
    assert config.inner == Inner("nats://env:2")
    config = parse(Demo, ["--page-size", "64", "--timeout", "9", "--url", "nats://flag:3"])
    assert (config.page_size, config.timeout_s, config.shard) == (64, 9.0, 3)
    assert config.inner.url == "nats://flag:3"
    monkeypatch.setenv("MESHSERVE_SHARD", "5")  # the field's name is not the variable's
    assert parse(Demo, []).shard == 3


def test_an_empty_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv("MESHSERVE_PAGE_SIZE", "")
    monkeypatch.setenv("MESHSERVE_STAGES", "")
    assert parse(Demo, []) == Demo()


def test_switches(monkeypatch):
    assert parse(Demo, ["--verbose"]).verbose
    assert not parse(Demo, ["--no-caching"]).caching
    for text in ("1", "true", "YES"):
        monkeypatch.setenv("MESHSERVE_VERBOSE", text)
        monkeypatch.setenv("MESHSERVE_NO_CACHING", text)
        assert parse(Demo, []).verbose and not parse(Demo, []).caching
    for text in ("0", "false", "no"):
        monkeypatch.setenv("MESHSERVE_VERBOSE", text)
        monkeypatch.setenv("MESHSERVE_NO_CACHING", text)
        assert not parse(Demo, []).verbose and parse(Demo, []).caching
    with pytest.raises(SystemExit):
        parse(Demo, ["--verbose", "1"])  # a switch takes no value


def test_lists_are_comma_separated_and_repeatable(monkeypatch):
    assert parse(Demo, []).stages == ("a", "b")
    assert parse(Demo, ["--stages", "x, y,,z"]).stages == ("x", "y", "z")
    assert parse(Demo, ["--key", "k1", "--key", "k2,k3"]).keys == ("k1", "k2", "k3")
    monkeypatch.setenv("MESHSERVE_KEYS", "e1, e2")
    monkeypatch.setenv("MESHSERVE_STAGES", "c")
    assert parse(Demo, []).keys == ("e1", "e2") and parse(Demo, []).stages == ("c",)
    assert parse(Demo, ["--key", "k1"]).keys == ("k1",)  # the flag replaces the variable's


def test_choices(monkeypatch, capsys):
    assert parse(Demo, ["--mode", "auto"]).mode == "auto"
    with pytest.raises(SystemExit) as exited:
        parse(Demo, ["--mode", "sometimes"])
    assert exited.value.code == 2 and "invalid choice" in capsys.readouterr().err
    monkeypatch.setenv("MESHSERVE_MODE", "on")
    assert parse(Demo, []).mode == "on"
    monkeypatch.setenv("MESHSERVE_MODE", "sometimes")
    with pytest.raises(SystemExit):
        parse(Demo, [])
    assert "MESHSERVE_MODE: 'sometimes' is not one of off, on, auto" in capsys.readouterr().err


def test_optional_values(monkeypatch):
    assert (parse(Demo, []).model, parse(Demo, []).port) == (None, None)
    assert parse(Demo, ["--model", "m", "--port", "9"]) == Demo(model="m", port=9)
    assert parse(Demo, ["--model", ""]).model is None
    monkeypatch.setenv("MESHSERVE_PORT", "7")
    assert parse(Demo, []).port == 7


def test_a_field_without_default_is_required_unless_its_variable_is_set(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse(Required, [])
    assert "--draft" in capsys.readouterr().err
    assert parse(Required, ["--draft", "d"]) == Required("d", None)  # Optional: None
    monkeypatch.setenv("MESHSERVE_DRAFT", "e")
    assert parse(Required, []) == Required("e", None)


def test_bad_values_exit_as_argparse_does(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse(Demo, ["--page-size", "x"])
    assert "invalid int value: 'x'" in capsys.readouterr().err
    monkeypatch.setenv("MESHSERVE_RATIO", "half")
    with pytest.raises(SystemExit) as exited:
        parse(Demo, [])
    assert exited.value.code == 2
    assert "MESHSERVE_RATIO: invalid float value 'half'" in capsys.readouterr().err


def test_a_setting_may_parse_its_own_spelling(monkeypatch):
    assert parse(Demo, ["--even-number", "4"]).even_number == 4
    with pytest.raises(SystemExit):
        parse(Demo, ["--even-number", "3"])


def test_validation_stays_in_post_init():
    with pytest.raises(ValueError, match="page_size"):
        parse(Demo, ["--page-size", "0"])


def test_help_shows_defaults_and_variables_but_no_secrets(monkeypatch):
    monkeypatch.setenv("MESHSERVE_KEYS", "sk-secret")
    monkeypatch.setenv("MESHSERVE_TOKEN", "tok-secret")
    monkeypatch.setenv("MESHSERVE_RATIO", "0.75")
    text = " ".join(build_parser(Demo).format_help().split())
    assert "KV page size in tokens (default: 16; env MESHSERVE_PAGE_SIZE)" in text
    assert "(default: 0.75; env MESHSERVE_RATIO)" in text  # what this environment gives
    assert "a list (comma-separated, repeatable; default: a,b; env MESHSERVE_STAGES)" in text
    assert "a switch (env MESHSERVE_VERBOSE=1)" in text
    assert "{off,on,auto}" in text
    assert "sk-secret" not in text and "tok-secret" not in text
    assert "(comma-separated, repeatable; default: hidden; env MESHSERVE_KEYS)" in text


def test_unsupported_annotations_are_refused():
    @dataclass(frozen=True)
    class Bad:
        items: frozenset[str] | None = setting(None, "lists are tuples here")

    with pytest.raises(TypeError):
        options(Bad)
