"""A worker declares its model pool and the priority classes the pool serves; the scheduler reads both from
GetModelInfo."""

from __future__ import annotations

import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2
from prometheus_client import CollectorRegistry

from goodput_inference.config import InferenceSettings
from goodput_inference.servicer import InferenceServicer, WorkerMetrics
from goodput_inference.sim_engine import SimEngine


def test_pool_classes_are_normalised_and_an_unknown_class_is_refused() -> None:
    assert InferenceSettings(pool_classes=" p1, P0 ").pool_classes == "P0,P1"
    assert InferenceSettings().pool == "default" and InferenceSettings().pool_classes == ""
    with pytest.raises(ValueError, match="unknown priority class P3"):
        InferenceSettings(pool_classes="P0,P3")


async def test_model_info_reports_the_pool() -> None:
    settings = InferenceSettings(engine="sim", pool="interactive", pool_classes="P0,P1")
    engine = SimEngine(settings)
    servicer = InferenceServicer(engine, worker_id="w1", metrics=WorkerMetrics(CollectorRegistry(), engine),
                                 pool=settings.pool, pool_classes=settings.pool_classes)
    info = await servicer.GetModelInfo(inference_pb2.GetModelInfoRequest(), None)
    assert info.pool == "interactive"
    assert list(info.pool_classes) == [types_pb2.PRIORITY_P0, types_pb2.PRIORITY_P1]
