"""`goodput index PATH... --kb NAME` and `goodput search "query" --kb NAME`, through the gateway's REST API.

``index`` reads files, folders or JSONL files (``{"id", "text", "title"?, "type"?, "metadata"?}`` per line), several
at once (``goodput index docs/ README.md --kb handbook``; two paths that give the same document id are refused before
anything is sent), sends them in batches to ``POST /v1/knowledge-bases/{kb}/documents`` with a progress bar, and is
incremental by nature: the indexer skips documents whose content hash is unchanged (0 embeddings) and replaces the
chunks of changed ones. (Removing documents that disappeared from a source is what a Reindex job does: it sees the
whole source.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from goodput_sources import SourceError, read_sources

from goodput_cli.chat import DEFAULT_GATEWAY_URL, ChatError, resolve_key
from goodput_cli.keys import default_state_dir

__all__ = ["register"]


def _post(url: str, key: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    import httpx

    try:
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s)
    except httpx.HTTPError as err:
        raise ChatError(f"cannot reach the gateway at {url}: {err}") from None
    try:
        data = r.json()
    except ValueError:
        data = {}
    if r.status_code >= 400:
        message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
        raise ChatError(f"{r.status_code}: {message or r.text[:300]}")
    return data


def register(app: typer.Typer) -> None:
    @app.command()
    def index(
        paths: Annotated[list[Path], typer.Argument(help="Files, folders (recursively) or JSONL files of documents.",
                                                    show_default=False)],
        kb: Annotated[str, typer.Option("--kb", help="Knowledge base name.")],
        batch: Annotated[int, typer.Option("--batch", min=1, help="Documents per request.")] = 32,
        url: Annotated[str, typer.Option("--url", envvar="GOODPUT_URL", help="Gateway URL.")] = DEFAULT_GATEWAY_URL,
        key: Annotated[str | None, typer.Option("--key", help="API key (default $GOODPUT_API_KEY, then "
                                                              ".goodput/dev-key).", show_default=False)] = None,
        timeout: Annotated[float, typer.Option("--timeout", help="Seconds per request.")] = 300.0,
    ) -> None:
        """Index documents into a knowledge base (incremental: unchanged documents are not re-embedded)."""
        console = Console(stderr=True)
        try:
            api_key = resolve_key(key, default_state_dir())
            docs = [{"id": d.id, "text": d.text, "title": d.title, "type": d.type, "metadata": d.metadata}
                    for d in read_sources(paths)]
        except (ChatError, SourceError) as err:
            console.print(f"error: {err}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
        if not docs:
            console.print(f"error: no documents in {' '.join(map(str, paths))}", markup=False, soft_wrap=True)
            raise typer.Exit(1)
        totals = {"chunks_embedded": 0, "chunks_deleted": 0, "documents_unchanged": 0, "kb_version": 0}
        endpoint = f"{url.rstrip('/')}/v1/knowledge-bases/{kb}/documents"
        with Progress(TextColumn("indexing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            task = progress.add_task("index", total=len(docs))
            for i in range(0, len(docs), batch):
                part = docs[i:i + batch]
                try:
                    r = _post(endpoint, api_key, {"documents": part}, timeout)
                except ChatError as err:
                    progress.stop()
                    console.print(f"error: documents {i}-{i + len(part) - 1}: {err}", markup=False, soft_wrap=True)
                    raise typer.Exit(1) from None
                for k in ("chunks_embedded", "chunks_deleted", "documents_unchanged"):
                    totals[k] += int(r.get(k, 0))
                totals["kb_version"] = int(r.get("kb_version", 0))
                progress.advance(task, len(part))
        print(json.dumps({"knowledge_base": kb, "documents": len(docs), **totals}))

    @app.command()
    def search(
        query: Annotated[str, typer.Argument(help="The query.")],
        kb: Annotated[str, typer.Option("--kb", help="Knowledge base name.")],
        top_k: Annotated[int, typer.Option("--top-k", min=1)] = 5,
        fusion: Annotated[str, typer.Option("--fusion", help="rrf or weighted.")] = "rrf",
        dense_weight: Annotated[float | None, typer.Option("--dense-weight", min=0.0, max=1.0)] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON answer.")] = False,
        url: Annotated[str, typer.Option("--url", envvar="GOODPUT_URL", help="Gateway URL.")] = DEFAULT_GATEWAY_URL,
        key: Annotated[str | None, typer.Option("--key", show_default=False, help="API key.")] = None,
    ) -> None:
        """Search a knowledge base (hybrid dense + BM25)."""
        console = Console()
        try:
            api_key = resolve_key(key, default_state_dir())
            body: dict[str, Any] = {"query": query, "top_k": top_k, "fusion": fusion}
            if dense_weight is not None:
                body["dense_weight"] = dense_weight
            r = _post(f"{url.rstrip('/')}/v1/knowledge-bases/{kb}/search", api_key, body, 60.0)
        except ChatError as err:
            Console(stderr=True).print(f"error: {err}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
        if as_json:
            print(json.dumps(r, indent=2))
            return
        table = Table(title=f"{kb} (version {r.get('kb_version', 0)})", title_justify="left")
        for col in ("#", "score", "document", "text"):
            table.add_column(col, overflow="fold")
        for i, h in enumerate(r.get("data", []), 1):
            text = " ".join(str(h.get("text", "")).split())
            table.add_row(str(i), f"{h.get('score', 0):.4f}", str(h.get("document_id")), text[:200])
        console.print(table)
        for note in r.get("notes", []):
            console.print(f"note: {note}", markup=False, soft_wrap=True)
        if r.get("degraded"):
            console.print("[yellow]degraded: one search leg did not answer[/]")
