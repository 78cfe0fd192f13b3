"""The REST request bodies as pydantic models mirroring OpenAI's schema, with OpenAI's error shape: ``{"error":
{"message", "type", "param", "code"}}``, ``param`` named as OpenAI names it (``messages[0].content``). Here: the base
:class:`Body`, :func:`parse`, and the bodies of embeddings and of the gateway's own APIs (knowledge bases, batches,
jobs); chat and completions are in :mod:`goodput_gateway.generation_schemas`.

Every field of OpenAI's schema is either carried through or refused by name: a field the gateway does not
implement (``functions``, ``audio``, ``modalities``, ...) is a 400 with ``code: unsupported_parameter``
unless its value asks for nothing (``null``, ``n: 1``); a field OpenAI does not have either is a 400 with the same
code. Nothing is silently dropped.

Types are strict (``"10"`` is not an integer, ``1`` is not ``true``); ranges and sizes are the domain's checks
(:func:`goodput_gateway.requests.validate`), which gRPC requests pass as well.

Example:
    >>> parse(EmbeddingsRequest, {"input": "Hi", "dimensions": 8})
    Traceback (most recent call last):
    goodput_core.errors.InvalidArgument: 'dimensions' is not supported by this gateway (accepted: null)
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from goodput_core.errors import InvalidArgument

__all__ = ["EmbeddingsRequest", "IndexRequest", "JobRequest", "SearchRequest", "parse"]

UNSUPPORTED = "unsupported_parameter"
M = TypeVar("M", bound="Body")


class Body(BaseModel):
    """A REST body: strict types, unknown fields refused, ``UNSUPPORTED`` fields refused unless neutral."""

    model_config = ConfigDict(strict=True, extra="forbid")
    # OpenAI fields this gateway does not implement -> the values that ask for nothing (accepted and dropped).
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.UNSUPPORTED:
            return data
        for name, neutral in cls.UNSUPPORTED.items():
            if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in neutral):
                accepted = ", ".join(json.dumps(v) for v in neutral)
                raise PydanticCustomError(UNSUPPORTED, f"is not supported by this gateway (accepted: {accepted})",
                                          {"field": name})
        return {name: value for name, value in data.items() if name not in cls.UNSUPPORTED}


def parse(model: type[M], body: Any) -> M:
    """``body`` (parsed JSON) validated as ``model``; InvalidArgument in OpenAI's terms otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise _invalid(err) from None


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_RANK = {UNSUPPORTED: 0, "extra_forbidden": 0, "missing": 1}  # refusals by name first, then what is missing


def _invalid(err: ValidationError) -> InvalidArgument:
    e = min(err.errors(include_url=False), key=lambda e: _RANK.get(e["type"], 2))
    kind, loc = e["type"], tuple(e["loc"])
    if kind == UNSUPPORTED:
        param = _param((*loc, e["ctx"]["field"]))
        return InvalidArgument(f"'{param}' {e['msg']}", param=param, code=UNSUPPORTED)
    param = _param(loc)
    if not loc:
        return InvalidArgument("the request body must be a JSON object", code="invalid_json")
    if kind == "extra_forbidden":
        return InvalidArgument(f"unrecognized request argument supplied: '{param}'", param=param, code=UNSUPPORTED)
    if kind == "missing":
        return InvalidArgument(f"'{param}' is required", param=param, code="missing_required_parameter")
    if kind in ("invalid_type", "invalid_value", "unsupported_value"):  # ours, from a field validator
        return InvalidArgument(f"'{param}' {e['msg']}", param=param, code=kind)
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return InvalidArgument(f"'{param}': {e['msg'][:1].lower()}{e['msg'][1:]}", param=param, code=code)


class EmbeddingsRequest(Body):
    """``POST /v1/embeddings``."""

    UNSUPPORTED = {"dimensions": (None,), "user": (None,)}
    input: list[str]
    model: str | None = None
    encoding_format: str | None = "float"

    @field_validator("input", mode="before")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and not all(isinstance(t, str) for t in value):
            raise PydanticCustomError("unsupported_value", "must be a string or an array of strings (token arrays "
                                      "are not supported)")
        return value

    @field_validator("encoding_format")
    @classmethod
    def _format(cls, value: str | None) -> str:
        if value not in (None, "float", "base64"):
            raise PydanticCustomError("invalid_value", "must be 'float' or 'base64'")
        return value or "float"


class SearchRequest(Body):
    """``POST /v1/knowledge-bases/{kb}/search``."""

    query: str | None = ""
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    fusion: str | None = ""  # "rrf" | "weighted" | "" (the retriever's default)
    dense_weight: float | None = Field(None, ge=0.0, le=1.0)
    rerank: bool = False


class Document(Body):
    id: str | None = None
    text: str | None = None
    type: str | None = None
    title: str | None = None
    metadata: dict[str, str | int | float | bool] | None = None


class IndexRequest(Body):
    """``POST /v1/knowledge-bases/{kb}/documents``."""

    documents: list[Document] | None = None
    delete_ids: list[str] | None = None


class BatchRequest(Body):
    """``POST /v1/batches``."""

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


class JobRequest(Body):
    """``POST /v1/jobs``: batch work run later at P2 (``body`` is validated as the endpoint's body at once)."""

    endpoint: str = "/v1/chat/completions"
    body: dict[str, Any]
