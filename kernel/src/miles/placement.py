"""Placement: which GPUs of which node each trainer rank and each engine gets. A pure function.

Nodes come from the executor in a stable order and GPUs are taken in id order, so rank ``r`` is
the ``r``-th GPU by (node, GPU id) on every run with the same cluster. Two layouts:

* **disaggregated**: the trainer's ranks take the first ``trainer_ranks`` GPUs, engines the GPUs
  after them (every engine's GPUs on one node, its tensor-parallel group); weights travel by a
  broadcast from trainer rank 0.
* **colocated**: trainer and engines share GPUs from the first one on: engine ``i`` sits on the GPUs
  of trainer ranks ``i*k ... i*k+k-1``, and the rank on its first GPU sends it the weights (CUDA
  IPC needs the same device).

Without GPUs (a CPU machine, or ``model.device: cpu``) nothing is counted: every process runs on
the first node, and the trainer has ``trainer_ranks`` gloo ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles_contracts.cluster import Node

from miles.errors import ConfigError
from miles.sections import ResourcesSection


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one process runs: its node and the GPUs it sees (none on CPU)."""

    node: Node
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Placement:
    """Every process's slot. ``pushers[i]`` is the trainer rank that sends engine ``i`` its weights."""

    trainer: tuple[Slot, ...]
    engines: tuple[Slot, ...]
    pushers: tuple[int, ...]
    colocated: bool

    @property
    def uses_gpus(self) -> bool:
        return any(slot.gpus for slot in (*self.trainer, *self.engines))

    def local_ranks(self) -> list[int]:
        """``LOCAL_RANK`` of each trainer rank: its index among the trainer's ranks on its node."""
        seen: dict[str, int] = {}
        out = []
        for slot in self.trainer:
            out.append(seen.get(slot.node.name, 0))
            seen[slot.node.name] = out[-1] + 1
        return out

    def describe(self) -> str:
        def where(slots: Sequence[Slot]) -> str:
            by_node: dict[str, list[str]] = {}
            for slot in slots:
                node = slot.node
                label = node.address if node.name in (node.address, "local") else f"{node.address} ({node.name[:8]})"
                by_node.setdefault(label, []).extend(slot.gpus)
            return "; ".join(f"{node} GPUs {','.join(g)}" if g else node for node, g in by_node.items())

        layout = "colocated" if self.colocated else "disaggregated"
        if not self.uses_gpus:
            layout = "CPU"
        return (f"{layout}: trainer {len(self.trainer)} rank(s) on {where(self.trainer)}; "
                f"{len(self.engines)} engine(s) on {where(self.engines)}")


def gpus_needed(resources: ResourcesSection) -> int:
    """GPUs the layout takes (when the run uses GPUs at all)."""
    engine_gpus = resources.engines * resources.gpus_per_engine
    if resources.colocate:
        return max(resources.trainer_ranks, engine_gpus)
    return resources.trainer_ranks + engine_gpus


def plan_placement(resources: ResourcesSection, nodes: Sequence[Node]) -> Placement:
    """Assign every trainer rank and engine a slot on ``nodes`` (in the executor's stable order).

    Raises :class:`ConfigError` listing what is wrong with the layout and what would fit.
    """
    if not nodes:
        raise ConfigError(["resources: the executor offers no node to run on"])
    if resources.nodes is not None:
        if resources.nodes > len(nodes):
            raise ConfigError([f"resources.nodes is {resources.nodes} but the executor offers {len(nodes)} node(s); "
                               f"use resources.nodes <= {len(nodes)} or add nodes to the cluster"])
        nodes = nodes[: resources.nodes]
    nodes = [Node(n.name, n.address, tuple(sorted(n.gpus, key=_gpu_order))) for n in nodes]
    if not any(n.gpus for n in nodes):
        return _cpu_placement(resources, nodes[0])
    errors = _layout_errors(resources, nodes)
    if errors:
        raise ConfigError(errors)
    if resources.colocate:
        return _colocated(resources, nodes)
    return _disaggregated(resources, nodes)


def _gpu_order(gpu: str) -> tuple[int, int | str]:
    return (0, int(gpu)) if gpu.isdigit() else (1, gpu)


def _cpu_placement(resources: ResourcesSection, node: Node) -> Placement:
    trainer = tuple(Slot(node) for _ in range(resources.trainer_ranks))
    engines = tuple(Slot(node) for _ in range(resources.engines))
    return Placement(trainer, engines, tuple(0 for _ in engines), resources.colocate)


def _capacity(nodes: Sequence[Node]) -> str:
    counts = sorted({len(n.gpus) for n in nodes})
    if len(counts) == 1:
        return f"{len(nodes)} node(s) x {counts[0]} GPUs"
    return " + ".join(f"{len(n.gpus)}" for n in nodes) + " GPUs on " + f"{len(nodes)} nodes"


def _layout_errors(resources: ResourcesSection, nodes: Sequence[Node]) -> list[str]:
    k = resources.gpus_per_engine
    errors = []
    largest = max(len(n.gpus) for n in nodes)
    if k > largest:
        errors.append(f"resources.gpus_per_engine is {k} but no node has more than {largest} GPUs "
                      f"(an engine's GPUs share one node); use gpus_per_engine <= {largest}")
    for node in nodes:
        if node.gpus and len(node.gpus) % k:
            divisors = [d for d in range(1, len(node.gpus) + 1) if len(node.gpus) % d == 0]
            errors.append(f"resources.gpus_per_engine ({k}) does not divide the {len(node.gpus)} GPUs of node "
                          f"{node.address or node.name}; use one of {', '.join(map(str, divisors))}")
            break
    if errors:
        return errors
    total = sum(len(n.gpus) for n in nodes)
    need = gpus_needed(resources)
    if need > total:
        errors.append(f"resources: the layout needs {need} GPUs ({_describe_ask(resources)}) but the executor "
                      f"offers {total} ({_capacity(nodes)}); {_what_fits(resources, nodes)}")
        return errors
    # (with k dividing every node's GPUs and the trainer on a prefix, engines that fit in number
    # also fit node by node: at most one node is partly taken)
    if resources.colocate and resources.engines * k > resources.trainer_ranks:
        # engine i's first GPU must hold a trainer rank to receive weights by CUDA IPC
        first_bare = -(-resources.trainer_ranks // k)
        if first_bare < resources.engines:
            errors.append(
                f"resources.colocate: engine {first_bare} would start on GPU {first_bare * k} where no trainer rank runs "
                f"({resources.trainer_ranks} trainer rank(s)); colocated engines need a trainer rank on their first GPU: "
                f"use at most {first_bare} engine(s) or more trainer_ranks"
            )
    return errors


def _describe_ask(resources: ResourcesSection) -> str:
    engines = f"{resources.engines} engine(s) x {resources.gpus_per_engine}"
    if resources.colocate:
        return f"colocated: max of {resources.trainer_ranks} trainer and {engines}"
    return f"{resources.trainer_ranks} trainer + {engines}"


def _what_fits(resources: ResourcesSection, nodes: Sequence[Node]) -> str:
    total = sum(len(n.gpus) for n in nodes)
    if resources.trainer_ranks > total:
        return f"at most {total} trainer ranks fit"
    fitting = _engines_that_fit(resources, nodes, limit=total)
    if resources.colocate:
        fitting = min(fitting, total // resources.gpus_per_engine)
    return (f"with {resources.trainer_ranks} trainer GPUs at most {fitting} engine(s) of "
            f"{resources.gpus_per_engine} GPUs fit; lower resources.engines or trainer_ranks, or add nodes")


def _engines_that_fit(resources: ResourcesSection, nodes: Sequence[Node], limit: int | None = None) -> int:
    free = _free_after_trainer(resources, nodes)
    k = resources.gpus_per_engine
    return min(sum(len(gpus) // k for gpus in free), limit if limit is not None else resources.engines)


def _free_after_trainer(resources: ResourcesSection, nodes: Sequence[Node]) -> list[list[str]]:
    """GPUs per node not taken by the trainer (colocated: all of them, engines share)."""
    free = [list(n.gpus) for n in nodes]
    if resources.colocate:
        return free
    left = resources.trainer_ranks
    for gpus in free:
        taken = min(left, len(gpus))
        del gpus[:taken]
        left -= taken
    return free


def _trainer_slots(resources: ResourcesSection, nodes: Sequence[Node]) -> tuple[Slot, ...]:
    slots = [Slot(node, (gpu,)) for node in nodes for gpu in node.gpus]
    return tuple(slots[: resources.trainer_ranks])


def _disaggregated(resources: ResourcesSection, nodes: Sequence[Node]) -> Placement:
    k = resources.gpus_per_engine
    engines: list[Slot] = []
    for node, gpus in zip(nodes, _free_after_trainer(resources, nodes), strict=True):
        while len(gpus) >= k and len(engines) < resources.engines:
            engines.append(Slot(node, tuple(gpus[:k])))
            del gpus[:k]
    return Placement(_trainer_slots(resources, nodes), tuple(engines), tuple(0 for _ in engines), False)


def _colocated(resources: ResourcesSection, nodes: Sequence[Node]) -> Placement:
    k = resources.gpus_per_engine
    trainer = _trainer_slots(resources, nodes)
    rank_of = {(slot.node.name, slot.gpus[0]): rank for rank, slot in enumerate(trainer)}
    engines: list[Slot] = []
    pushers: list[int] = []
    for node in nodes:
        gpus = list(node.gpus)
        while len(gpus) >= k and len(engines) < resources.engines:
            engines.append(Slot(node, tuple(gpus[:k])))
            pushers.append(rank_of[(node.name, gpus[0])])
            del gpus[:k]
    return Placement(trainer, tuple(engines), tuple(pushers), True)


__all__ = ["Placement", "Slot", "gpus_needed", "plan_placement"]
