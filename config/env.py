"""Tiny typed helpers that read settings from the environment."""

from __future__ import annotations

import os
import tomllib


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if not value:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def env_toml_strings(name: str) -> dict[str, str]:
    """The `key = "string"` lines of the TOML file the variable names; {} when it is unset."""
    path = os.environ.get(name)
    if not path:
        return {}
    with open(path, "rb") as file:
        table = tomllib.load(file)
    for key, value in table.items():
        if not isinstance(value, str):
            raise ValueError(f"{name}={path}: {key} must be a string, not {type(value).__name__}")
    return table


def env_toml_table(name: str) -> dict[str, object]:
    """The top-level keys of the TOML file the variable names, as parsed; {} when it is
    unset. What each value must be is its reader's to check."""
    path = os.environ.get(name)
    if not path:
        return {}
    with open(path, "rb") as file:
        return tomllib.load(file)
