"""What megatron-core 0.16 needs to run on a machine without a GPU (tests, the CPU default run).

megatron-core is written for CUDA: a few of its paths ask the CUDA runtime for the device, keep
dropout seeds in CUDA generators or create small bookkeeping tensors on ``"cuda"``. On a machine
without a GPU, :func:`cpu_megatron` replaces exactly those calls, and nothing else, while the
backend runs; :func:`install` makes the replacements permanent for the process. Neither does
anything when CUDA is available: on a GPU megatron-core runs unchanged.

Each replacement says why it is needed; the model maths (linear layers, attention, norms,
collectives over gloo) is megatron-core's own and runs as written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def needed() -> bool:
    """True when there is no usable CUDA device (then megatron-core needs the replacements)."""
    return not torch.cuda.is_available()


class _CudaTensorsOnCpu(TorchFunctionMode):
    """Creates on the CPU the tensors megatron-core hard-codes onto ``"cuda"``.

    Why: megatron-core 0.16 writes ``device="cuda"`` (or ``.cuda()``) for bookkeeping tensors that
    do not depend on the model: the optimizer's overflow flag (``MegatronOptimizer.__init__``),
    the schedules' token counters (``forward_backward_no_pipelining`` and the pipelined
    schedules), the pipeline's shape messages (``p2p_communication``) and the context-parallel
    rope index (``get_pos_emb_on_this_cp_rank``, which also pins memory). Without a GPU each of
    these raises; with this mode they are made on the CPU, where every other tensor lives.

    Also: the optimizers sort parameters by ``tensor.type()`` strings and accept only
    ``torch.cuda.*Tensor`` (``DistributedOptimizer``, ``Float16OptimizerWithFloat16Params``,
    ``clip_grads``); a CPU tensor answers with the CUDA name of its dtype.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # tensor.cuda(...): already where it must be
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # pinning needs the CUDA driver; it only speeds up copies to a GPU
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _cpu_rng_tracker() -> Any:
    """megatron-core's RNG tracker, keeping its named states in the CPU generator.

    Why: ``CudaRNGStatesTracker`` gives tensor-parallel regions their own dropout seeds by swapping
    CUDA generator states (``torch.cuda.get_rng_state``), which raise without a GPU. The same
    bookkeeping on the CPU generator keeps megatron-core's seeding scheme (one stream per name,
    seeded per tensor-/expert-parallel rank) where the tensors actually are.
    """
    from megatron.core.tensor_parallel import random as megatron_random

    class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f"RNG state {name!r} or seed {seed} is already tracked")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"RNG state {name!r} is not tracked")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker()


def seed_model_parallel(seed: int) -> None:
    """``model_parallel_cuda_manual_seed`` for the CPU: the same three named streams, per rank.

    Why: the original seeds CUDA generators (see :func:`_cpu_rng_tracker`).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = _cpu_rng_tracker()
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    offset = seed + 2718  # megatron-core's own offsets, so seeds match its CUDA scheme
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, offset + tp_rank)
    tracker.add(megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


class _HostStream:
    """The CPU's one "stream": work is done when the call returns, so waiting is a no-op. All
    instances are the same stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HostStream)

    def __hash__(self) -> int:
        return 0

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


class _HostEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_HOST_STREAM = _HostStream()


def install() -> None:
    """Make the module-level replacements (idempotent). No-op when CUDA is available."""
    global _INSTALLED
    if _INSTALLED or not needed():
        return
    from megatron.core.transformer.moe import moe_utils

    # the stand-ins below have other types than torch's stubs give the CUDA API: patch through Any
    cuda: Any = torch.cuda
    # Why: megatron-core asks ``torch.cuda.current_device()`` for the device of buffers it
    # allocates itself (DDP gradient buffers, the attention memory buffer, receive buffers of
    # the pipeline); without a GPU that call raises. "cpu" is a valid ``device=`` everywhere.
    cuda.current_device = lambda: "cpu"
    # Why: the pipeline's p2p exchange (``p2p_communication._communicate_shapes``) waits for the
    # CUDA stream; CPU collectives are already complete when they return.
    cuda.synchronize = lambda device=None: None
    # Why: the MoE all-to-all token dispatcher copies routing counts to the host on a side CUDA
    # stream and waits on an event (``MoEAlltoAllTokenDispatcher``); on the CPU there is one
    # stream and every copy is complete when it returns, so streams and events are no-ops.
    cuda.Stream = _HostStream
    cuda.current_stream = lambda device=None: _HOST_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.Event = _HostEvent
    # Why: the MoE all-to-all dispatcher turns its split sizes into host lists only when they live
    # on a GPU (``maybe_move_tensor_to_cpu``); on the CPU they stay tensors, which
    # ``all_to_all_single`` does not take (also in backward, outside any mode), so they are
    # handed over as lists.
    all_to_all_single = torch.distributed.all_to_all_single

    def all_to_all_with_host_splits(output: Any, input: Any, output_split_sizes: Any = None,
                                    input_split_sizes: Any = None, *args: Any, **kwargs: Any) -> Any:
        def listed(sizes: Any) -> Any:
            return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes

        return all_to_all_single(output, input, listed(output_split_sizes), listed(input_split_sizes), *args, **kwargs)

    torch.distributed.all_to_all_single = all_to_all_with_host_splits
    # Why: ``moe_utils`` reads ``te_general_gemm`` in the router but only defines it when
    # Transformer Engine imports; None is what it means by "not available".
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _INSTALLED = True


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """While inside: megatron-core's hard-coded CUDA tensors are made on the CPU. A no-op on GPU."""
    if not needed():
        yield
        return
    install()
    with _CudaTensorsOnCpu():
        yield
