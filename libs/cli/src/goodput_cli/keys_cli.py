"""`goodput keys`: create, list and revoke the gateway's API keys, and set a tenant's limits, in its keys file.

The keys file holds only each key's SHA-256: ``create`` prints the new key once, on stdout and alone on its line, so a
script can take it (``KEY=$(goodput keys create --tenant acme)``), and never writes it anywhere. The file is
``$GOODPUT_GATEWAY_API_KEYS_FILE`` when set, else ``api-keys.json`` in the state folder (``$GOODPUT_STATE_DIR``, else
``.goodput``), or ``--file``. A running gateway re-reads it when it changes: a key created or revoked here works,
or stops working, within seconds, without a restart. For a cluster, edit a local copy and apply it as the keys
Secret (``kubectl create secret generic goodput-api-keys --from-file=api-keys.json --dry-run=client -o yaml |
kubectl apply -f -``).

Example::

    $ KEY=$(goodput keys create --tenant acme --id acme-ci --max-priority P0 --default-priority P1 --rpm 60)
    $ goodput keys tenant acme --tpm 200000 --monthly-tokens 50000000 --weight 2
    $ goodput keys list
    $ goodput keys revoke acme-ci

Each command edits the file in place (atomically, mode 0600) and keeps what it does not know as it was. It checks
the values it writes as the gateway will: names by the gateway's one pattern (``goodput_core.names``), priorities
P0 (most urgent) to P2, limits whole numbers >= 0 (0 = none), ``monthly_soft`` in (0, 1], ``weight`` in (0, 1000].

    >>> _check_name("tenant", "acme"), _limits(rpm=60, tpm=None, monthly_soft=0.8)
    ('acme', {'rpm': 60, 'monthly_soft': 0.8})
"""

from __future__ import annotations

import json
import secrets
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from goodput_core.names import check_name

from goodput_cli.keys import (
    KEYS_FILE,
    KeysFileError,
    default_state_dir,
    edit_keys_document,
    hash_key,
    key_digest,
    key_id,
    read_keys_document,
)

__all__ = ["Priority", "new_api_key", "register"]

LIMITS = ("rpm", "tpm", "max_concurrent", "monthly_tokens", "monthly_soft")


class Priority(str, Enum):
    P0 = "P0"
    P1 = "P1"
    P2 = "P2"


KeysFile = Annotated[Path | None, typer.Option(
    "--file", envvar="GOODPUT_GATEWAY_API_KEYS_FILE", show_default=False, dir_okay=False,
    help=f"The gateway's keys file (default: {KEYS_FILE} in $GOODPUT_STATE_DIR, else in .goodput).")]
Rpm = Annotated[int | None, typer.Option("--rpm", min=0, show_default=False, help="Requests per minute (0 = none).")]
Tpm = Annotated[int | None, typer.Option("--tpm", min=0, show_default=False,
                                         help="Tokens per minute, prompt and completion (0 = none).")]
MaxConcurrent = Annotated[int | None, typer.Option("--max-concurrent", min=0, show_default=False,
                                                   help="Requests in flight at once (0 = none).")]
MonthlyTokens = Annotated[int | None, typer.Option("--monthly-tokens", min=0, show_default=False,
                                                   help="Tokens per calendar month, UTC (0 = none).")]
MonthlySoft = Annotated[float | None, typer.Option(
    "--monthly-soft", show_default=False, help="Share of monthly tokens, in (0, 1], at which the soft threshold's "
                                               "metric and alert fire (gateway default 0.8).")]


def new_api_key() -> str:
    """A new API key: ``gp-`` and 256 random bits (URL-safe base64)."""
    return "gp-" + secrets.token_urlsafe(32)


class _Invalid(Exception):
    """A value the gateway would refuse (the message says which and why)."""


def _fail(message: str, code: int = 1) -> NoReturn:
    Console(stderr=True).print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _note(message: str) -> None:
    Console(stderr=True).print(message, markup=False, highlight=False, soft_wrap=True)


def _keys_path(file: Path | None) -> Path:
    return file if file is not None else default_state_dir() / KEYS_FILE


def _check_name(what: str, value: str) -> str:
    try:
        return check_name(value)
    except ValueError as err:
        raise _Invalid(f"{what}: {err}") from None


def _limits(*, monthly_soft: float | None = None, **ints: int | None) -> dict[str, Any]:
    """The limits that were given (None = not given), checked."""
    out: dict[str, Any] = {}
    for name, value in ints.items():
        if value is not None:
            if value < 0:
                raise _Invalid(f"{name} {value}: use a whole number >= 0 (0 = none)")
            out[name] = value
    if monthly_soft is not None:
        if not 0 < monthly_soft <= 1:
            raise _Invalid(f"monthly_soft {monthly_soft}: use a share in (0, 1], e.g. 0.8")
        out["monthly_soft"] = monthly_soft
    return out


def _describe(entry: dict[str, Any], names: tuple[str, ...] = LIMITS) -> str:
    return " ".join(f"{name}={entry[name]}" for name in names if entry.get(name) is not None) or "-"


def register(app: typer.Typer) -> None:
    """Adds ``goodput keys`` and its commands to ``app``."""
    keys_app = typer.Typer(help="API keys and tenants in the gateway's keys file (only digests are stored).",
                           no_args_is_help=True)
    app.add_typer(keys_app, name="keys")

    @keys_app.command()
    def create(
        tenant: Annotated[str, typer.Option("--tenant", help="The tenant the key bills to.")],
        id_: Annotated[str | None, typer.Option(
            "--id", show_default=False, help="The key's name in metrics, usage and logs (default: the first 12 hex "
                                             "digits of its SHA-256).")] = None,
        max_priority: Annotated[Priority, typer.Option("--max-priority",
                                                       help="The most urgent class it may ask for.")] = Priority.P1,
        default_priority: Annotated[Priority | None, typer.Option(
            "--default-priority", show_default=False, help="Its class when a request names none (default: "
                                                           "--max-priority).")] = None,
        rpm: Rpm = None,
        tpm: Tpm = None,
        max_concurrent: MaxConcurrent = None,
        monthly_tokens: MonthlyTokens = None,
        monthly_soft: MonthlySoft = None,
        operator: Annotated[bool, typer.Option("--operator", help="May read every tenant's usage.")] = False,
        file: KeysFile = None,
    ) -> None:
        """Create a key: print it once (stdout, alone on its line) and store only its SHA-256.

        Its own limits (--rpm, ...) apply in addition to its tenant's (`goodput keys tenant`).
        """
        key = new_api_key()
        digest = hash_key(key)
        path = _keys_path(file)
        entry: dict[str, Any] = {"id": id_ if id_ is not None else digest[:12], "tenant": tenant, "key_sha256": digest,
                                 "max_priority": max_priority.value}
        try:
            _check_name("id", entry["id"])
            _check_name("tenant", tenant)
            if default_priority is not None:
                if default_priority.value < max_priority.value:  # "P0" < "P1": more urgent
                    raise _Invalid(f"--default-priority {default_priority.value} is more urgent than "
                                   f"--max-priority {max_priority.value}")
                entry["default_priority"] = default_priority.value
            entry.update(_limits(rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, monthly_tokens=monthly_tokens,
                                 monthly_soft=monthly_soft))
            if operator:
                entry["operator"] = True
            with edit_keys_document(path) as doc:
                keys = doc.setdefault("keys", [])
                if any(key_id(e) == entry["id"] for e in keys):
                    raise _Invalid(f"a key with the id {entry['id']!r} is already in {path} (revoke it first, or "
                                   "choose another --id)")
                keys.append(entry)
        except (_Invalid, KeysFileError, OSError) as err:
            _fail(str(err))
        print(key, flush=True)
        _note(f"created key {entry['id']!r} of tenant {tenant!r} (max {max_priority.value}) in {path}: the key above "
              "is shown only this once; the file keeps its SHA-256 only.")

    @keys_app.command("list")
    def list_keys(file: KeysFile = None) -> None:
        """The keys (id, tenant, priorities, limits, operator, digest prefix; never a key) and the tenants."""
        path = _keys_path(file)
        if not path.exists():
            _fail(f"no keys file at {path} (`goodput keys create` starts one; or give --file)")
        try:
            doc = read_keys_document(path)
        except (KeysFileError, OSError) as err:
            _fail(str(err))
        console = Console()
        keys = doc.get("keys", [])
        table = Table(title=f"{len(keys)} key(s) in {path}", title_justify="left")
        for col in ("id", "tenant", "max", "default", "limits", "operator", "sha256"):
            table.add_column(col, overflow="fold")
        for e in keys:
            table.add_row(key_id(e) or "?", str(e.get("tenant", "?")), str(e.get("max_priority", "P1")),
                          str(e.get("default_priority") or e.get("max_priority", "P1")), _describe(e),
                          "yes" if e.get("operator") else "", key_digest(e)[:12] or "?")
        console.print(table)
        tenants: dict[str, Any] = doc.get("tenants", {})
        if tenants or doc.get("defaults"):
            table = Table(title="tenants (over defaults)", title_justify="left")
            for col in ("tenant", "limits", "weight", "keys"):
                table.add_column(col, overflow="fold")
            rows = [("(defaults)", doc.get("defaults") or {})] + sorted(tenants.items())
            for name, t in rows:
                t = t if isinstance(t, dict) else {}
                count = sum(1 for e in keys if e.get("tenant") == name)
                table.add_row(name, _describe(t), str(t.get("weight", "")), "" if name == "(defaults)" else str(count))
            console.print(table)

    @keys_app.command()
    def revoke(
        id_: Annotated[str, typer.Argument(metavar="ID", help="The key's id (as `goodput keys list` shows it).")],
        file: KeysFile = None,
    ) -> None:
        """Remove a key: the gateway refuses it within seconds."""
        path = _keys_path(file)
        try:
            if not path.exists():
                raise _Invalid(f"no keys file at {path}")
            with edit_keys_document(path) as doc:
                keys = doc.get("keys", [])
                gone = [e for e in keys if key_id(e) == id_]
                if not gone:
                    raise _Invalid(f"no key with the id {id_!r} in {path} (see `goodput keys list`)")
                doc["keys"] = [e for e in keys if key_id(e) != id_]
        except (_Invalid, KeysFileError, OSError) as err:
            _fail(str(err))
        tenants = sorted({str(e.get("tenant")) for e in gone})
        _note(f"revoked key {id_!r} of tenant {', '.join(tenants)} in {path}")

    @keys_app.command()
    def tenant(
        name: Annotated[str, typer.Argument(help="The tenant.")],
        rpm: Rpm = None,
        tpm: Tpm = None,
        max_concurrent: MaxConcurrent = None,
        monthly_tokens: MonthlyTokens = None,
        monthly_soft: MonthlySoft = None,
        weight: Annotated[float | None, typer.Option(
            "--weight", show_default=False, help="Fair-share weight in the scheduler's queues, in (0, 1000] "
                                                 "(default 1).")] = None,
        file: KeysFile = None,
    ) -> None:
        """Set a tenant's limits and weight (merged with those it has); with none given, show them.

        A tenant's limits bound all its keys together; a limit it does not set is the file's `defaults`.
        """
        path = _keys_path(file)
        try:
            _check_name("tenant", name)
            changes = _limits(rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, monthly_tokens=monthly_tokens,
                              monthly_soft=monthly_soft)
            if weight is not None:
                if not 0 < weight <= 1000:
                    raise _Invalid(f"weight {weight}: use a number in (0, 1000]")
                changes["weight"] = int(weight) if weight == int(weight) else weight
            if not changes:
                current = read_keys_document(path).get("tenants", {}).get(name)
                if current is None:
                    raise _Invalid(f"tenant {name!r} has no settings in {path} (give --rpm, --tpm, ..., --weight)")
                print(json.dumps({name: current}, indent=2))
                return
            with edit_keys_document(path) as doc:
                tenants = doc.setdefault("tenants", {})
                if not isinstance(tenants.get(name, {}), dict):
                    raise _Invalid(f"{path}: tenants.{name} is not a JSON object")
                merged = tenants[name] = {**tenants.get(name, {}), **changes}
        except (_Invalid, KeysFileError, OSError) as err:
            _fail(str(err))
        _note(f"tenant {name!r} in {path}: {_describe(merged, (*LIMITS, 'weight'))}")
