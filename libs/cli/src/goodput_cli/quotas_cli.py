"""``goodput quotas``: the quota store's state (its epoch, :mod:`goodput_contracts.quota_epoch`), and the
operator's answer when the gateways found it had lost its counts: ``accept-loss`` takes the counts as they stand
(restored from a backup first, or accepted as empty), and every gateway checks budgets again."""

from __future__ import annotations

import os
import secrets
from typing import Annotated

import redis
import typer

from goodput_contracts.quota_epoch import DEFAULT_PREFIX, OPERATOR, epoch_key, epoch_text, is_lost

__all__ = ["register"]

RedisUrl = Annotated[str, typer.Option(
    "--redis-url", help="The quota Redis (the gateway's QUOTA_REDIS_URL, else its REDIS_URL).")]
Prefix = Annotated[str, typer.Option("--prefix", help="The gateway's QUOTAS__PREFIX.")]


def _default_url() -> str:
    return (os.environ.get("GOODPUT_GATEWAY_QUOTA_REDIS_URL") or os.environ.get("GOODPUT_GATEWAY_REDIS_URL")
            or "redis://127.0.0.1:6379/0")


def register(app: typer.Typer) -> None:
    """Adds ``goodput quotas`` and its commands to ``app``."""
    quotas_app = typer.Typer(help="The gateways' shared quota store.", no_args_is_help=True)
    app.add_typer(quotas_app, name="quotas")

    @quotas_app.command()
    def status(redis_url: RedisUrl = "", prefix: Prefix = DEFAULT_PREFIX) -> None:
        """The store's epoch; exits with 1 when it is marked as having lost its counts."""
        epoch = epoch_text(redis.Redis.from_url(redis_url or _default_url()).get(epoch_key(prefix)))
        print(f"epoch: {epoch or '(none yet: the first gateway admission creates it)'}")
        if is_lost(epoch):
            print("the store lost its counts: budgeted requests are refused until `goodput quotas accept-loss`")
            raise typer.Exit(1)

    @quotas_app.command("accept-loss")
    def accept_loss(redis_url: RedisUrl = "", prefix: Prefix = DEFAULT_PREFIX) -> None:
        """Accepts the quota counts as they stand: every gateway adopts the new epoch and checks budgets again."""
        epoch = OPERATOR + secrets.token_hex(8)
        redis.Redis.from_url(redis_url or _default_url()).set(epoch_key(prefix), epoch)
        print(f"epoch: {epoch}; the gateways check budgets against the counts as they stand")
