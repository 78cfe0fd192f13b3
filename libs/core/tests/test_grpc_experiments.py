"""The gRPC experiments every service starts with (goodput_core.clients.GRPC_EXPERIMENTS) are ones the installed
grpcio knows and serves with, and every image sets the same value.

gRPC only logs an unknown experiment and carries on, so an upgrade of grpcio that drops one would silently change
the transport; this fails instead. The process is a fresh one: gRPC reads the variable once, at its start.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from goodput_core.clients import GRPC_EXPERIMENTS

REPO = Path(__file__).resolve().parents[3]

_CALLS = textwrap.dedent("""
    import asyncio

    import grpc
    from grpc import aio


    async def tokens(request, context):
        for i in range(int(request)):
            yield str(i).encode()


    async def main():
        server = aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.T", {"Tokens": grpc.unary_stream_rpc_method_handler(tokens)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/t.T/Tokens")
            got = [[m async for m in call(b"5")] for _ in range(20)]
        await server.stop(None)
        assert got == [[b"0", b"1", b"2", b"3", b"4"]] * 20, got
        print("ok")


    asyncio.run(main())
""")


def test_the_installed_grpc_knows_the_experiments_and_streams_with_them() -> None:
    assert GRPC_EXPERIMENTS  # one or more, comma-separated, each with or without a leading "-"
    env = {**os.environ, "GRPC_EXPERIMENTS": GRPC_EXPERIMENTS}
    proc = subprocess.run([sys.executable, "-c", _CALLS], capture_output=True, text=True, timeout=60, env=env,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert "experiment" not in proc.stderr.lower(), proc.stderr  # gRPC's "Unknown experiment: ..." error


def test_every_image_sets_the_same_experiments() -> None:
    dockerfiles = sorted(REPO.glob("services/*/Dockerfile"))
    assert len(dockerfiles) >= 6
    for path in dockerfiles:
        text = path.read_text(encoding="utf-8")
        runtime_stages = len(re.findall(r"^ENTRYPOINT ", text, re.MULTILINE))
        values = re.findall(r"^\s+GRPC_EXPERIMENTS=(\S+)", text, re.MULTILINE)
        assert values == [GRPC_EXPERIMENTS] * runtime_stages, path
