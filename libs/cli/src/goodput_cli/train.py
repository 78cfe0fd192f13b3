"""`goodput train reranker|verifier --data-dir DIR`: Goodput's own cross-encoders, fine-tuned from MiniLM on this
machine (see :mod:`goodput_crossencoder.training`). A folder that already holds a trained model (its model card) is
never retrained (``--force`` does); the model appears whole or not at all.

    goodput train verifier --data-dir ../shared/data          # -> ../shared/data/models/goodput-verifier-minilm
    goodput train reranker --data-dir ../shared/data --out /models/reranker
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ["register"]

DEFAULT_DATA_DIR = Path("../shared/data")


class Kind(str, Enum):
    reranker = "reranker"
    verifier = "verifier"


def register(app: typer.Typer) -> None:
    @app.command()
    def train(
        kind: Annotated[Kind, typer.Argument(help="reranker (retrieval, SciFact) or verifier (cache, QQP/PAWS/MRPC).")],
        data_dir: Annotated[Path, typer.Option("--data-dir", help="The evaluation data folder.")] = DEFAULT_DATA_DIR,
        out: Annotated[Path | None, typer.Option("--out", show_default=False,
                                                 help="Model folder (default <data-dir>/models/goodput-<kind>-minilm)."
                                                 )] = None,
        seed: Annotated[int, typer.Option("--seed")] = 13,
        epochs: Annotated[int, typer.Option("--epochs", min=0, help="0 = the kind's default.")] = 0,
        layers: Annotated[int, typer.Option("--layers", min=0, max=6, help="MiniLM layers kept; 0 = default.")] = 0,
        max_length: Annotated[int, typer.Option("--max-length", min=0, max=512,
                                                help="Tokens per pair; 0 = the kind's default.")] = 0,
        max_steps: Annotated[int, typer.Option("--max-steps", min=0, help="Stop early (smoke runs).")] = 0,
        max_train_pairs: Annotated[int, typer.Option("--max-train-pairs", min=0,
                                                     help="Verifier: train pairs per set at most; 0 = default.")] = 0,
        threads: Annotated[int, typer.Option("--threads", min=0, help="CPU threads; 0 = every core.")] = 0,
        force: Annotated[bool, typer.Option("--force", help="Retrain even if the folder holds a model.")] = False,
    ) -> None:
        """Fine-tune MiniLM into a cross-encoder: the retriever's reranker or the cache's paraphrase verifier."""
        from goodput_crossencoder.card import default_model_dir, read_card

        console = Console(stderr=True)
        target = out or default_model_dir(data_dir, kind.value)
        existing = read_card(target)
        if existing is not None and not force:
            console.print(f"{target} already holds a trained {existing.kind} (trained {existing.created} in "
                          f"{existing.train_seconds:.0f} s); not retraining (--force does)")
            raise typer.Exit(0)
        if not data_dir.is_dir():
            console.print(f"[red]error:[/red] no data folder at {data_dir}")
            raise typer.Exit(2)
        from goodput_crossencoder.training import TrainConfig
        from goodput_crossencoder.training import train as run_training

        cfg = TrainConfig(kind=kind.value, data_dir=data_dir, out=target, seed=seed, epochs=epochs, layers=layers,
                          max_length=max_length, max_steps=max_steps, max_train_pairs=max_train_pairs, threads=threads)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[loss]}"), console=console) as bar:
            tasks: dict[str, TaskID] = {}

            def on_step(phase: str, done: int, total: int, loss: float) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=total, loss="")
                bar.update(tasks[phase], completed=done, total=total, loss=f"loss {loss:.3f}" if loss else "")

            card = run_training(cfg, on_step)
        console.print(f"trained {card.kind} in {card.train_seconds:.0f} s (+{card.validate_seconds:.0f} s "
                      f"validation) -> {target}")
        print(json.dumps({"out": str(target), "train_seconds": card.train_seconds, "validation": card.validation,
                          "threshold": card.threshold}, indent=2))
