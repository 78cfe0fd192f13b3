"""The GPU catalogue `goodput size` chooses from: memory, bandwidth, relative price and the node label of each type.

``memory_gib`` is the capacity as sold; ``usable_gib`` is what the driver hands to CUDA with ECC on (what
``torch.cuda.get_device_properties(0).total_memory`` reports, rounded down), which is the total vLLM's
``gpu_memory_utilization`` takes its share of. The two differ by up to 2 GiB on GDDR cards (an A10 sold as 24 GB
shows 22.2 GiB). ``cost_per_hour`` is relative (A10 = 1.0), in the proportions of public on-demand prices; put your
own with ``goodput size --cost A100-80=2.4``. ``product`` is the ``nvidia.com/gpu.product`` label GPU Feature
Discovery puts on the node, for a pool's ``nodeSelector`` (SXM variants for A100/H100; PCIe cards differ).

    >>> GPUS["A100-80"].usable_gib, GPUS["A100-80"].product
    (79.1, 'NVIDIA-A100-SXM4-80GB')
    >>> find_gpu("a10").name, find_gpu("h100").name
    ('A10', 'H100-80')
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPUS", "Gpu", "find_gpu"]


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # as sold
    usable_gib: float  # what CUDA sees (ECC on): the total vLLM's gpu_memory_utilization applies to
    bandwidth_gbs: float  # HBM/GDDR bandwidth, GB/s (decode is bound by it)
    cost_per_hour: float  # relative, A10 = 1.0
    product: str  # nvidia.com/gpu.product node label
    compute_capability: float  # bf16 and vLLM's Marlin kernels (AWQ/GPTQ/fp8 weight-only) need 8.0

    @property
    def large_engine_defaults(self) -> bool:
        """Whether vLLM (0.32, ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``) gives this GPU its
        larger serving defaults: 70 GiB or more and not an A100 (max_num_batched_tokens 8192, max_num_seqs 1024;
        else 2048 and 256)."""
        return self.usable_gib >= 70 and not self.name.startswith("A100")


GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("T4", 16, 14.7, 320, 0.45, "Tesla-T4", 7.5),
    Gpu("L4", 24, 22.1, 300, 0.80, "NVIDIA-L4", 8.9),
    Gpu("A10", 24, 22.2, 600, 1.00, "NVIDIA-A10", 8.6),
    Gpu("A30", 24, 23.5, 933, 1.10, "NVIDIA-A30", 8.0),
    Gpu("L40S", 48, 44.5, 864, 1.90, "NVIDIA-L40S", 8.9),
    Gpu("A100-40", 40, 39.4, 1555, 3.00, "NVIDIA-A100-SXM4-40GB", 8.0),
    Gpu("A100-80", 80, 79.1, 2039, 3.70, "NVIDIA-A100-SXM4-80GB", 8.0),
    Gpu("H100-80", 80, 79.1, 3350, 6.50, "NVIDIA-H100-80GB-HBM3", 9.0),
    Gpu("H200", 141, 139.8, 4800, 8.00, "NVIDIA-H200", 9.0),
)}


def find_gpu(name: str) -> Gpu:
    """The catalogue entry named ``name`` (case-insensitive; a unique prefix such as ``h100`` will do)."""
    wanted = name.strip().upper()
    if wanted in GPUS:
        return GPUS[wanted]
    matches = [g for key, g in GPUS.items() if key.startswith(wanted)]
    if len(matches) == 1:
        return matches[0]
    raise KeyError(f"unknown GPU type {name!r} (known: {', '.join(GPUS)})" if not matches else
                   f"GPU type {name!r} is ambiguous: {', '.join(g.name for g in matches)}")
