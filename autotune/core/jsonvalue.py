"""A JSON document's values as a type: what `json.loads` returns, and what a user-facing file
(summary.json, a study's stored meta) holds. Data model only: no imports of autotune."""

from __future__ import annotations

from typing import TypeAlias

JsonValue: TypeAlias = "None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]"
JsonObject: TypeAlias = "dict[str, JsonValue]"


def json_object(value: JsonValue) -> JsonObject | None:
    """`value` where it is a JSON object, else None (a missing or damaged stored value)."""
    return value if isinstance(value, dict) else None
