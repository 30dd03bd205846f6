"""Run configs: a TOML file that mirrors a launcher's command line (`--config run.toml`; flags override).

Keys are the long flag names, with dashes or underscores (`max-new-tokens = 16`, `cp_strategy = "ring"`).
Tables are only for grouping and are flattened: `[parallel] tp = 8` is `tp = 8`. Relative paths are taken
relative to the config file, so a config and its prompt files can move together. Values are checked like
the flags themselves (type, choices) and an unknown key is an error that lists the valid ones.
"""
from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

SKIP = {"help", "config"}  # flags a config cannot set


class RunConfigError(ValueError):
    pass


def read_toml(path: str | Path) -> dict[str, Any]:
    """The config's keys flattened (tables are for grouping only); dashes become underscores."""
    path = Path(path)
    if not path.is_file():
        raise RunConfigError(f"--config {path}: no such file")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RunConfigError(f"--config {path}: not valid TOML ({e})") from None
    flat: dict[str, Any] = {}

    def walk(table: dict, where: str) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(value, f"{where}[{key}] ")
                continue
            dest = key.replace("-", "_")
            if dest in flat:
                raise RunConfigError(f"--config {path}: {where}{key} is set twice")
            flat[dest] = value
    walk(raw, "")
    return flat


def _check(action: argparse.Action, key: str, value: Any, base: Path) -> Any:
    """The value as the flag would have produced it, or an error naming the key and what it takes."""
    flag = action.option_strings[-1]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise RunConfigError(f"{key} = {value!r}: {flag} is a switch, give true or false")
        return value
    if isinstance(value, list):  # lists (e.g. pp-layers = [16, 16]) go through the flag's parser as "a,b"
        value = ",".join(str(v) for v in value)
    if isinstance(value, bool) or isinstance(value, (dict,)):
        raise RunConfigError(f"{key} = {value!r}: {flag} takes a value, not a switch")
    typ = action.type
    kind = getattr(typ, "kind", typ)  # a range-checked number (cli.number) reads as its int or float
    try:
        if typ is None:
            out = str(value)
        elif typ is Path:
            p = Path(str(value)).expanduser()
            out = p if p.is_absolute() else base / p
        elif kind is float and isinstance(value, (int, float)):
            out = float(value) if typ is float else typ(str(float(value)))
        elif kind is int and not isinstance(value, int):
            raise ValueError("not an integer")
        else:
            out = typ(value) if isinstance(value, str) or typ in (int, float) else typ(str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise RunConfigError(f"{key} = {value!r}: not a valid value for {flag} ({e})") from None
    if action.choices is not None and out not in action.choices:
        raise RunConfigError(f"{key} = {value!r}: {flag} must be one of {', '.join(map(str, action.choices))}")
    return out


def config_defaults(parser: argparse.ArgumentParser, path: str | Path) -> dict[str, Any]:
    """The config file as parser defaults ({dest: value}); explicit flags still win when parsed after."""
    path = Path(path)
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in SKIP}
    out = {}
    for dest, value in read_toml(path).items():
        if dest not in actions:
            valid = ", ".join(sorted(d.replace("_", "-") for d in actions))
            raise RunConfigError(f"--config {path}: unknown key {dest.replace('_', '-')!r}; valid keys: {valid}")
        out[dest] = _check(actions[dest], dest.replace("_", "-"), value, path.resolve().parent)
    return out


def parse_with_config(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse argv; a `--config FILE` among them sets defaults first, so flags override the file."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        try:
            parser.set_defaults(**config_defaults(parser, known.config))
        except RunConfigError as e:
            parser.error(str(e))
    return parser.parse_args(argv)
