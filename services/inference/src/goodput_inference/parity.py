"""Numerics parity: does the engine give the model's own greedy answer?

The reference is a second implementation of the same weights: transformers on the CPU, in float32, greedy. The
engine's answer (its detokenised text, as the worker streams it) is compared with the reference token by token:
the reference's first ``k`` tokens must decode to a prefix of the engine's text, for every ``k`` up to the
horizon. The horizon is the requested number of tokens, cut at the first step where the reference itself was
nearly undecided (its two best logits closer than ``tie_margin``): two correct float32 implementations may part
there, and what follows is no longer a comparison of the same continuation. A wrong kernel does not hide behind
this: bf16 on an Intel AMX machine leaves the reference at the first token of the answer.

Used by the numerics parity test (tests/integration/test_numerics.py) and the dtype benchmark (loadtests.dtype).

Example:
    >>> ref = Reference(prompt_ids=[1], token_ids=[10, 11, 12], pieces=["The", "The capital", "The capital is"],
    ...                 margins=[3.0, 2.5, 0.01])
    >>> compare(ref, "The capital was", tie_margin=0.05)
    Parity(matched=2, horizon=2, first_mismatch=None)
    >>> compare(ref, "A capital", tie_margin=0.05).ok
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PROMPTS", "Parity", "Reference", "compare", "reference_greedy"]

# Fixed prompts, chat and completion, whose greedy continuations the parity test checks. Chat prompts are lists of
# messages (the worker applies the model's chat template, and so does the reference); completions are plain text.
PROMPTS: list[dict[str, Any]] = [
    {"name": "chat-capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "chat-system", "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colours."}]},
    {"name": "chat-explain", "messages": [{"role": "user", "content": "Explain in one sentence what a CPU does."}]},
    {"name": "completion-count", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"},
    {"name": "completion-prose", "prompt": "The quick brown fox"},
]


@dataclass(frozen=True)
class Reference:
    """The reference's greedy continuation: its token ids, the decoded text after each token, and at each step
    the gap between its best and second-best logit."""

    prompt_ids: list[int]
    token_ids: list[int]
    pieces: list[str]
    margins: list[float]


@dataclass(frozen=True)
class Parity:
    matched: int  # leading reference tokens the engine's text agrees with
    horizon: int  # tokens compared: the requested count, cut at the reference's first near-tie
    first_mismatch: int | None  # index of the first reference token the engine left, within the horizon

    @property
    def ok(self) -> bool:
        return self.matched >= self.horizon


def prompt_ids(tokenizer: Any, prompt: dict[str, Any]) -> list[int]:
    """Token ids of a :data:`PROMPTS` entry, built the way the worker builds them (chat template with the
    generation prompt, or the tokenizer's special tokens around a completion prompt)."""
    if "messages" in prompt:
        ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers >= 5 returns a BatchEncoding
            ids = list(ids["input_ids"])
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt["prompt"], add_special_tokens=True)]


def reference_greedy(model_dir: Path, prompts: list[dict[str, Any]], *, max_tokens: int) -> list[Reference]:
    """Greedy continuations of ``prompts`` by transformers on the CPU in float32, from the folder the engine
    serves. Stops early at the end-of-sequence token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    stop = {int(i) for i in ([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])}
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = prompt_ids(tokenizer, prompt)
            tokens: list[int] = []
            margins: list[float] = []
            pieces: list[str] = []
            seq = torch.tensor([ids])
            past = None
            for _ in range(max_tokens):
                result = model(input_ids=seq, past_key_values=past, use_cache=True)
                past = result.past_key_values
                logits = result.logits[0, -1].float()
                top = torch.topk(logits, 2)
                token = int(top.indices[0])
                if token in stop:
                    break
                tokens.append(token)
                margins.append(float(top.values[0] - top.values[1]))
                pieces.append(str(tokenizer.decode(tokens, skip_special_tokens=True)))
                seq = torch.tensor([[token]])
            out.append(Reference(prompt_ids=ids, token_ids=tokens, pieces=pieces, margins=margins))
    return out


def compare(reference: Reference, text: str, *, tie_margin: float = 0.05, max_tokens: int | None = None) -> Parity:
    """How far the engine's greedy ``text`` follows ``reference``, token by token (see the module's docstring)."""
    n = len(reference.token_ids) if max_tokens is None else min(max_tokens, len(reference.token_ids))
    horizon = next((i for i in range(n) if reference.margins[i] < tie_margin), n)
    for i in range(horizon):
        # A token that ends inside a multi-byte character decodes to U+FFFD: judge what it has so far.
        if not text.startswith(reference.pieces[i].rstrip("\ufffd")):
            return Parity(matched=i, horizon=horizon, first_mismatch=i)
    return Parity(matched=horizon, horizon=horizon, first_mismatch=None)
