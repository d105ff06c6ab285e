"""Record which experts each MoE router picks, for ``return_routed_experts``.

transformers' MoE models route through a module per MoE layer (``Qwen3MoeTopKRouter`` is
``layer.mlp.gate``) whose forward returns ``(router_logits, routing_weights, expert_indices)``;
the indices ``[tokens, top_k]`` are exactly what the experts module then runs. A forward hook on
each router keeps the indices of the current forward; nothing is recomputed, so what the engine
reports is what it used. Routers are found by shape, not by model name: a module with a ``top_k``
attribute whose class name ends in ``Router``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


def find_routers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Router") and hasattr(m, "top_k")]


class RoutingCapture:
    """Hooks on every router; :meth:`take` returns the last forward's choices."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        # nn.Module.__getattr__ types every unknown attribute as Tensor | Module; a router's top_k is an int
        self.top_k = int(self.routers[0].top_k) if self.routers else 0  # type: ignore[arg-type]
        self._latest: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def _hook(self, index: int):
        def record(module: nn.Module, args: Any, output: Any) -> None:
            self._latest[index] = _indices(output)

        return record

    def take(self) -> torch.Tensor:
        """``[tokens, moe_layers, top_k]`` int32 for every token of the last forward, in the
        order the model saw them (row-major over ``[batch, seq]``)."""
        import torch

        missing = [i for i, t in enumerate(self._latest) if t is None]
        if missing:
            raise RuntimeError(f"MoE routers {missing} did not run in the last forward")
        out = torch.stack([t.to(torch.int32) for t in self._latest if t is not None], dim=1)  # all are, see above
        self._latest = [None] * len(self.routers)
        return out

    def clear(self) -> None:
        self._latest = [None] * len(self.routers)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _indices(output: Any) -> torch.Tensor:
    import torch

    items = output if isinstance(output, tuple) else (output,)
    for item in reversed(items):
        if isinstance(item, torch.Tensor) and not item.is_floating_point():
            return item.reshape(-1, item.shape[-1])
    raise RuntimeError(f"a MoE router returned no expert indices (got {type(output).__name__})")
