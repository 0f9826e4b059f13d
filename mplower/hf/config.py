"""config.json of a checkpoint folder, read as data: typed fields with located errors.

Defaults are those of the transformers configuration classes (LlamaConfig, MistralConfig,
Qwen2Config, GPT2Config) for the fields their checkpoints may leave out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mplower.ir.diagnostics import DiagnosticError, Location


class Config:
    """The JSON object of config.json; `int`/`float`/`flag` read one field or fail naming it."""

    def __init__(self, path: Path):
        self.path = path
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.error(f"cannot read config.json: {e}") from None
        if not isinstance(data, dict):
            raise self.error("config.json is not a JSON object")
        self.data: dict[str, Any] = data

    def error(self, message: str) -> DiagnosticError:
        return DiagnosticError.at(Location(str(self.path), 0, 0), message)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(key, default)
        if value is None:
            raise self.error(f"config.json has no '{key}'")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.error(f"config.json: '{key}' is {value!r}, not an integer >= {minimum}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise self.error(f"config.json: '{key}' is {value!r}, not a positive number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"config.json: '{key}' is {value!r}, not true or false")
        return value

    def architecture(self) -> str:
        archs = self.data.get("architectures")
        if (not isinstance(archs, list) or not archs
                or not all(isinstance(a, str) for a in archs)):
            raise self.error("config.json has no 'architectures' list naming the model class")
        if len(archs) > 1:
            raise self.error(f"config.json names {len(archs)} architectures ({', '.join(archs)}); "
                             f"mplower imports a checkpoint of one")
        return archs[0]
