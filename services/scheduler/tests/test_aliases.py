"""A model answers to its served name and to its aliases (``ModelInfo.aliases``): the ``serves_model`` filter places a
request that names either on that model's workers, and never on another model's."""

from __future__ import annotations

from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2

from goodput_scheduler.placement import CycleState, PlacementRequest
from goodput_scheduler.placement.filters import ServesModel
from goodput_scheduler.registry import Worker


def worker(name: str, model: str, *aliases: str) -> Worker:
    info = inference_pb2.ModelInfo(served_model_name=model, aliases=aliases)
    return Worker(worker_id=name, address=name, channel=None, healthy=True, model=info)  # type: ignore[arg-type]


def kept(model: str, workers: list[Worker]) -> list[str]:
    state = CycleState(PlacementRequest("r", "t", types_pb2.PRIORITY_P0, model, 10, 10), workers)
    return [w.worker_id for w in ServesModel().filter(state, workers)]


def test_a_request_by_name_or_alias_goes_to_that_models_workers() -> None:
    fleet = [worker("small-1", "qwen-0.5b", "chat-small", "default"), worker("large-1", "qwen-72b", "chat-large")]
    assert kept("qwen-0.5b", fleet) == ["small-1"]
    assert kept("chat-small", fleet) == ["small-1"]
    assert kept("default", fleet) == ["small-1"]
    assert kept("chat-large", fleet) == ["large-1"]
    assert kept("chat-medium", fleet) == []  # an unknown name matches nothing (the gateway refuses it first)
    assert kept("", fleet) == ["small-1", "large-1"]
