"""Normalisation of a request and derivation of its cache keys.

The exact (L1) key is a hash of *everything that changes the answer*: tenant, model and model version, the whole
normalised conversation (system prompt and every turn, with roles and names), the output-changing sampling
parameters and, for RAG requests, the knowledge base and its version. Two requests share an entry only when all of
it is equal, so a tenant never sees another tenant's answer and a new model or knowledge-base version never sees an
old answer.

The semantic (L2) *partition* holds what must be equal for a paraphrase to reuse an answer: tenant, model and model
version, knowledge base and version, the system prompt and the earlier turns of the conversation (follow-ups such as
"and in Python?" mean something only after the exact same history). Inside a partition only the last user message
is compared by embedding.

Example:
    >>> req = CacheRequest(tenant="acme", model="m", model_version="1",
    ...                    messages=[Message("user", "What is  Goodput?")], sampling=Sampling(temperature=0.0))
    >>> same = CacheRequest(**{**req.__dict__, "messages": [Message("user", "What is Goodput?")]})
    >>> derive(req).exact == derive(same).exact
    True
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass, field

from goodput_core.errors import InvalidArgument
from goodput_core.sampling import Sampling

__all__ = ["CacheRequest", "DerivedKeys", "Message", "Sampling", "derive", "greedy", "normalise", "validate_key",
           "validate_name"]

KEY_VERSION = "v1"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY = re.compile(r"^[0-9a-f]{64}$")
_SPACE = re.compile(r"\s+")
_ROLES = {"system", "user", "assistant", "tool", "developer"}


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    name: str = ""


def greedy(s: Sampling) -> bool:
    """Temperature 0: the same request always gets the same answer, so it is reusable."""
    return s.temperature is not None and s.temperature == 0.0


@dataclass(frozen=True)
class CacheRequest:
    tenant: str
    model: str
    model_version: str = ""
    messages: list[Message] = field(default_factory=list)
    prompt: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    knowledge_base: str = ""
    kb_version: int = 0

    @property
    def rag(self) -> bool:
        return bool(self.knowledge_base)

    def last_user(self) -> str:
        """The question being asked: the last user message (or the completion prompt)."""
        return next((m.content for m in reversed(self.messages) if m.role == "user"), self.prompt)

    def chars(self) -> int:
        return len(self.prompt) + sum(len(m.content) for m in self.messages)


@dataclass(frozen=True)
class DerivedKeys:
    exact: str          # 64 hex digits
    partition: str      # 32 hex digits
    question: str       # normalised last user message (what L2 embeds and the guard compares)


def normalise(text: str) -> str:
    """Unicode NFC, whitespace runs collapsed to one space, trimmed. Case and punctuation are kept: they can change
    an answer (code, names, "US" vs "us")."""
    return _SPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def validate_name(value: str, what: str) -> str:
    if not value:
        raise InvalidArgument(f"{what} is required", param=what)
    if not _NAME.match(value):
        raise InvalidArgument(f"{what} {value[:80]!r} is malformed: 1-64 characters of letters, digits, '.', '_' "
                              "or '-', starting with a letter or digit", param=what)
    return value


def validate_key(value: str) -> str:
    if not _KEY.match(value):
        raise InvalidArgument(f"key {value[:80]!r} is malformed: a cache key is 64 lowercase hex digits "
                              "(LookupResponse.key)", param="key")
    return value


def _sampling(s: Sampling) -> dict[str, object]:
    out: dict[str, object] = {"max_tokens": s.max_tokens, "temperature": s.temperature,
                              "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
                              "stop": sorted(set(s.stop))}
    if s.logit_bias:
        out["logit_bias"] = [list(b) for b in s.logit_bias]
    if s.structured:  # the same question answered as JSON is another answer
        out.update(json_schema=s.json_schema, json_object=s.json_object)
    extensions = s.vllm_extensions()
    if extensions:  # vLLM's (ignore_eos, min_tokens, ...): each changes the answer; keys without them stay as they were
        out["vllm"] = extensions
    if not greedy(s):
        # Greedy decoding ignores top_p, top_k and the seed; any other temperature depends on all of them.
        out.update(top_p=s.top_p, top_k=s.top_k, seed=s.seed)
    return out


def _hash(obj: object, n: int = 64) -> str:
    data = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:n]


def derive(req: CacheRequest) -> DerivedKeys:
    """The L1 key, the L2 partition and the question of a validated request."""
    msgs = [[m.role, m.name, normalise(m.content)] for m in req.messages]
    common = {"v": KEY_VERSION, "tenant": req.tenant, "model": req.model, "model_version": req.model_version,
              "kb": req.knowledge_base, "kb_version": req.kb_version if req.rag else 0}
    exact = _hash({**common, "messages": msgs, "prompt": normalise(req.prompt), "sampling": _sampling(req.sampling)})
    # The context of the last user message: everything before it (system prompt, earlier turns) must match exactly.
    last = max((i for i, m in enumerate(req.messages) if m.role == "user"), default=-1)
    context = msgs[:last] if last >= 0 else msgs
    trailing = msgs[last + 1:] if last >= 0 else []
    partition = _hash({**common, "context": context, "trailing": trailing, "sampling": _sampling(req.sampling),
                       "completion": not req.messages}, 32)
    return DerivedKeys(exact=exact, partition=partition, question=normalise(req.last_user()))


def check_request(req: CacheRequest, *, max_chars: int, tenants: list[str]) -> None:
    """Refuses malformed requests with a clear message (InvalidArgument / PermissionDenied)."""
    from goodput_core.errors import PermissionDenied

    validate_name(req.tenant, "tenant")
    if tenants and req.tenant not in tenants:
        raise PermissionDenied(f"tenant {req.tenant!r} is not known to the cache", param="tenant",
                               code="unknown_tenant")
    if not req.model:
        raise InvalidArgument("model is required", param="model")
    if not req.messages and not req.prompt:
        raise InvalidArgument("messages or prompt is required", param="messages")
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise InvalidArgument(f"messages[{i}].role {m.role!r} is not one of {sorted(_ROLES)}",
                                  param=f"messages[{i}].role")
    if req.chars() > max_chars:
        raise InvalidArgument(f"the conversation has {req.chars()} characters; the cache accepts at most "
                              f"{max_chars}", param="messages")
    if req.knowledge_base:
        validate_name(req.knowledge_base, "knowledge_base")
    if req.kb_version < 0:
        raise InvalidArgument("kb_version must not be negative", param="kb_version")
