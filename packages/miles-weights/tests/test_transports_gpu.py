"""CUDA paths: CUDA IPC to an engine on the trainer's GPU, NCCL broadcast to an engine on another GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from miles_contracts.testing.transport import check_weight_transport
from miles_weights.bench_models import load_tensors
from miles_weights.broadcast import BroadcastTransport
from miles_weights.launch import EngineLaunch, running_engines
from miles_weights.shared_memory import SharedMemoryTransport
from miles_weights.sync import TransportOptions

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _physical_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return [i.strip() for i in ids][: torch.cuda.device_count()]


@pytest.fixture(scope="module")
def gpu_engines(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    gpus = _physical_gpus()
    launches = [EngineLaunch("cuda", "bfloat16", {"CUDA_VISIBLE_DEVICES": gpus[0]})] * 2  # target, reference
    if len(gpus) > 1:
        launches.append(EngineLaunch("cuda", "bfloat16", {"CUDA_VISIBLE_DEVICES": gpus[1]}))
    with running_engines(tiny_dir, launches, tmp_path_factory.mktemp("gpu-engines")) as engines:
        yield dict(zip(["same_gpu", "reference", "other_gpu"], engines.urls, strict=False))


def test_cuda_ipc_to_an_engine_on_the_same_gpu(gpu_engines: dict[str, str], tiny_dir: Path) -> None:
    tensors = load_tensors(tiny_dir, torch.bfloat16, "cuda:0")
    with SharedMemoryTransport(TransportOptions(bucket_mb=1)) as transport:
        check_weight_transport(transport, gpu_engines["same_gpu"], tensors, reference_url=gpu_engines["reference"])


@pytest.mark.parametrize("layout", ["flattened_bucket", "per_tensor"])
def test_nccl_broadcast_to_an_engine_on_another_gpu(gpu_engines: dict[str, str], tiny_dir: Path, layout: str) -> None:
    if "other_gpu" not in gpu_engines:
        pytest.skip("needs two GPUs: NCCL refuses two ranks on one device")
    tensors = load_tensors(tiny_dir, torch.bfloat16, "cuda:0")
    with BroadcastTransport(TransportOptions(bucket_mb=1), backend="nccl", group_timeout=120, layout=layout) as transport:
        check_weight_transport(transport, gpu_engines["other_gpu"], tensors, reference_url=gpu_engines["reference"])
