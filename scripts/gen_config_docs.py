"""Print every service's settings as Markdown tables (env var, type, default, description), for the README.

The tables come from the settings classes themselves (pydantic-settings), so they cannot drift from the code.
A service whose settings do not import (not written yet, or not installed) is skipped with a note on stderr.

Usage:
    python scripts/gen_config_docs.py > /tmp/config.md
"""

from __future__ import annotations

import importlib
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# (title, module, class) in the order of docs/services.md.
SERVICES = [
    ("gateway", "goodput_gateway.config", "GatewaySettings"),
    ("scheduler", "goodput_scheduler.config", "SchedulerSettings"),
    ("inference worker", "goodput_inference.config", "InferenceSettings"),
    ("embedder", "goodput_embedder.config", "EmbedderSettings"),
    ("retriever", "goodput_retriever.config", "RetrieverSettings"),
    ("cache", "goodput_cache.config", "CacheSettings"),
]


def type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not typing.Annotated]
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names) + (" (optional)" if type(None) in args else "")
    if origin in (list, tuple, set, frozenset):
        inner = type_name(args[0]) if args else "any"
        return f"list of {inner} (comma-separated)"
    if origin is dict:
        return "JSON object"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if value is None or value == "" or value == [] or value == {}:
        return "empty"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, BaseModel):  # a structured setting: its defaults are documented where it is defined
        return f"see `{type(value).__module__}`"
    if isinstance(value, list | tuple):
        return "`" + ",".join(str(v) for v in value) + "`"
    return f"`{value}`"


# For fields whose class (and its bases) give no description.
FALLBACK_DESCRIPTIONS = {
    "grpc_port": "gRPC port.",
    "http_port": "Port of /metrics and /healthz.",
    "log_level": "Log level.",
    "log_format": "Log line format.",
}


def description(cls: Any, name: str) -> str:
    """The field's description, else the one a base class gives the same field, else a fallback."""
    for klass in cls.__mro__:
        field = getattr(klass, "model_fields", {}).get(name)
        if field is not None and field.description:
            return str(field.description)
    return FALLBACK_DESCRIPTIONS.get(name, "")


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def group_of(cls: Any, field: FieldInfo) -> type[BaseModel] | None:
    """A settings group (a model of plain fields, each its own ``<GROUP>__<FIELD>`` variable), or None."""
    kind = field.annotation
    if not cls.model_config.get("env_nested_delimiter") or not (isinstance(kind, type) and issubclass(kind, BaseModel)):
        return None
    plain = all(not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)) and
                typing.get_origin(f.annotation) is not dict for f in kind.model_fields.values())
    return kind if plain else None


def table(cls: Any) -> str:
    prefix = str(cls.model_config.get("env_prefix", ""))
    rows = ["| env var | type | default | description |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        group = group_of(cls, field)
        if group is None:
            rows.append(f"| `{prefix}{name.upper()}` | {type_name(field.annotation)} | {default_text(field)} | "
                        f"{cell(description(cls, name))} |")
            continue
        rows.append(f"| `{prefix}{name.upper()}` | group | | {cell(group.__doc__ or '')} Each field below, or the "
                    f"whole group as one JSON object. |")
        for sub_name, sub in group.model_fields.items():
            rows.append(f"| `{prefix}{name.upper()}__{sub_name.upper()}` | {type_name(sub.annotation)} | "
                        f"{default_text(sub)} | {cell(description(group, sub_name))} |")
    return "\n".join(rows)


def main() -> int:
    sections = []
    for title, module, class_name in SERVICES:
        try:
            cls = getattr(importlib.import_module(module), class_name)
        except (ImportError, AttributeError) as err:
            print(f"note: skipped {title}: {module}.{class_name} does not import ({err})", file=sys.stderr)
            continue
        prefix = cls.model_config.get("env_prefix", "")
        sections.append(f"### {title} (`{prefix}*`)\n\n{table(cls)}\n")
    if not sections:
        print("no settings class imports; run `make install` first", file=sys.stderr)
        return 1
    text = "\n".join(sections)
    if len(sys.argv) > 2 and sys.argv[1] == "--readme":
        return write_readme(Path(sys.argv[2]), text)
    print(text, end="")
    return 0


BEGIN, END = "<!-- BEGIN CONFIG (generated by scripts/gen_config_docs.py) -->", "<!-- END CONFIG -->"


def write_readme(path: Path, text: str) -> int:
    """Replaces the block between the BEGIN/END CONFIG markers of a README with the tables."""
    doc = path.read_text(encoding="utf-8")
    if BEGIN not in doc or END not in doc:
        print(f"{path}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{text}{END}{tail}", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
