"""`python -m goodput_inference`: one engine behind gRPC (vLLM in-process, a Triton server, or the simulator).

The gRPC server starts at once and reports NOT_SERVING until the engine has loaded (a couple of minutes on CPU),
so the scheduler and Kubernetes probes see a live but not-ready worker.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from goodput.inference.v1 import inference_pb2_grpc
from prometheus_client import Gauge

from goodput_core.bootstrap import bootstrap
from goodput_core.server import ServiceRunner, run_main

from goodput_inference.config import InferenceSettings
from goodput_inference.devmodel import SERVED_NAME, ensure_dev_model
from goodput_inference.engine import Engine
from goodput_inference.progress import Progress
from goodput_inference.servicer import InferenceServicer, WorkerMetrics
from goodput_inference.tenancy import CacheSalts
from goodput_inference.tool_parsing import DEV_TEMPLATE, DEV_TOOL_PARSER


async def serve() -> None:
    rt = bootstrap("inference", InferenceSettings)
    s = rt.settings
    engine: Engine
    salts = CacheSalts.from_settings(s)  # the prefix cache is salted per tenant (or sharing group)

    async def model_folder(folder: str) -> tuple[Path, str]:
        """The model's folder and the name it is served by default: the folder given, else the dev model's."""
        if folder:
            return Path(folder), Path(folder).name
        return await asyncio.to_thread(ensure_dev_model, Path(s.data_dir) if s.data_dir else None), SERVED_NAME

    if s.engine == "sim":
        from goodput_inference.sim_engine import SimEngine

        engine = SimEngine(s, salts=salts)
    elif s.engine == "triton":
        from goodput_inference.triton_engine import TritonEngine

        # The tokenizer and chat template: the model's folder (only its tokenizer files are read), or the dev model's.
        tokenizer_dir, default_name = await model_folder(s.triton_tokenizer or s.model)
        served = s.served_model_name or default_name
        engine = TritonEngine(s, tokenizer_dir=tokenizer_dir, served_model_name=served,
                              triton_model=s.triton_model or served, salts=salts)
    else:
        from goodput_inference.vllm_engine import VllmEngine

        tool_parser, tool_template = None, None  # the settings'
        model_dir, default_name = await model_folder(s.model)
        if not s.model and not s.tool_call_parser and not s.tool_chat_template:  # the dev model's tool format
            tool_parser, tool_template = DEV_TOOL_PARSER, DEV_TEMPLATE
        engine = VllmEngine(s, model_dir=model_dir, served_model_name=s.served_model_name or default_name,
                            salts=salts, tool_call_parser=tool_parser, tool_chat_template=tool_template)
    worker_id = s.worker_id or f"{socket.gethostname()}:{s.grpc_port}"
    progress = Progress(stall_after_s=s.stall_after_s)
    servicer = InferenceServicer(engine, worker_id=worker_id, metrics=WorkerMetrics(rt.registry, engine),
                                 pool=s.pool, pool_classes=s.pool_classes, aliases=s.served_model_aliases,
                                 cost_per_hour=s.pool_cost_per_hour, progress=progress)
    runner = ServiceRunner(name="inference", settings=s, registry=rt.registry, provider=rt.provider)
    runner.add(inference_pb2_grpc.add_InferenceServicer_to_server, servicer, "goodput.inference.v1.Inference")

    stalled = Gauge("goodput_worker_stalled", "1 while the worker's generations make no progress (a hung engine: "
                    "NOT_SERVING, nothing new is placed here).", registry=rt.registry)

    async def on_stall(now: bool) -> None:
        """NOT_SERVING while the engine is stalled, SERVING again when tokens come (not while draining)."""
        stalled.set(1 if now else 0)
        if not servicer.draining:
            await runner.set_serving(not now)

    watchdog: asyncio.Task[None] | None = None

    async def started() -> None:
        nonlocal watchdog
        await engine.start()
        if s.stall_after_s > 0:
            watchdog = asyncio.get_running_loop().create_task(progress.watch(on_stall), name="progress-watchdog")

    async def drain() -> None:
        servicer.draining = True
        if watchdog is not None:
            watchdog.cancel()

    runner.on_drain.append(drain)
    runner.on_stop.append(engine.shutdown)
    await runner.run(after_start=started)


def main() -> None:
    run_main(serve)


if __name__ == "__main__":
    main()
