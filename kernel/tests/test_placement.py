"""Placement: which node and GPUs each trainer rank and engine gets, on 1x8, 2x8 and 4x8 GPUs,
colocated and disaggregated, and the errors for layouts that do not fit."""

from __future__ import annotations

import pytest
from miles.config import load_config
from miles.errors import ConfigError
from miles.placement import gpus_needed, plan_placement
from miles.sections import ResourcesSection
from miles_contracts import Node


def cluster(nodes: int, gpus: int = 8) -> list[Node]:
    return [Node(f"n{i}", f"10.0.0.{i + 1}", tuple(str(g) for g in range(gpus))) for i in range(nodes)]


def where(slots) -> list[tuple[str, tuple[str, ...]]]:
    return [(slot.node.name, slot.gpus) for slot in slots]


def test_one_node_disaggregated() -> None:
    plan = plan_placement(ResourcesSection(trainer_ranks=4, engines=2, gpus_per_engine=2, colocate=False), cluster(1))
    assert where(plan.trainer) == [("n0", (g,)) for g in "0123"]
    assert where(plan.engines) == [("n0", ("4", "5")), ("n0", ("6", "7"))]
    assert plan.pushers == (0, 0) and not plan.colocated
    assert plan.local_ranks() == [0, 1, 2, 3]


def test_one_node_colocated_engines_share_the_trainer_gpus() -> None:
    plan = plan_placement(ResourcesSection(trainer_ranks=8, engines=4, gpus_per_engine=2, colocate=True), cluster(1))
    assert where(plan.trainer) == [("n0", (str(g),)) for g in range(8)]
    assert where(plan.engines) == [("n0", ("0", "1")), ("n0", ("2", "3")), ("n0", ("4", "5")), ("n0", ("6", "7"))]
    assert plan.pushers == (0, 2, 4, 6)  # the rank on each engine's first GPU sends it weights (CUDA IPC)


def test_two_nodes_disaggregated_trainer_spills_over_and_engines_keep_to_one_node() -> None:
    plan = plan_placement(ResourcesSection(trainer_ranks=12, engines=2, gpus_per_engine=2, colocate=False), cluster(2))
    assert where(plan.trainer) == [("n0", (str(g),)) for g in range(8)] + [("n1", (str(g),)) for g in range(4)]
    assert plan.local_ranks() == [*range(8), *range(4)]
    assert where(plan.engines) == [("n1", ("4", "5")), ("n1", ("6", "7"))]


def test_two_nodes_colocated() -> None:
    plan = plan_placement(ResourcesSection(trainer_ranks=16, engines=4, gpus_per_engine=4, colocate=True), cluster(2))
    assert where(plan.engines) == [("n0", ("0", "1", "2", "3")), ("n0", ("4", "5", "6", "7")),
                                   ("n1", ("0", "1", "2", "3")), ("n1", ("4", "5", "6", "7"))]
    assert plan.pushers == (0, 4, 8, 12)


def test_four_nodes_disaggregated_trainer_on_two_nodes_engines_on_two() -> None:
    resources = ResourcesSection(trainer_ranks=16, engines=4, gpus_per_engine=4, colocate=False)
    plan = plan_placement(resources, cluster(4))
    assert {slot.node.name for slot in plan.trainer} == {"n0", "n1"}
    assert where(plan.engines) == [("n2", ("0", "1", "2", "3")), ("n2", ("4", "5", "6", "7")),
                                   ("n3", ("0", "1", "2", "3")), ("n3", ("4", "5", "6", "7"))]
    assert gpus_needed(resources) == 32


def test_four_nodes_colocated() -> None:
    plan = plan_placement(ResourcesSection(trainer_ranks=32, engines=16, gpus_per_engine=2, colocate=True), cluster(4))
    assert plan.pushers == tuple(range(0, 32, 2))
    assert [slot.node.name for slot in plan.engines] == [f"n{i // 4}" for i in range(16)]


def test_rank_order_is_by_node_then_gpu_id_whatever_order_ids_come_in() -> None:
    nodes = [Node("a", "10.0.0.1", ("10", "2", "1", "0")), Node("b", "10.0.0.2", ("1", "0"))]
    plan = plan_placement(ResourcesSection(trainer_ranks=6, engines=1, gpus_per_engine=1, colocate=True), nodes)
    assert where(plan.trainer) == [("a", ("0",)), ("a", ("1",)), ("a", ("2",)), ("a", ("10",)), ("b", ("0",)), ("b", ("1",))]


def test_one_gpu_shared_by_default() -> None:
    plan = plan_placement(ResourcesSection(), [Node("local", "127.0.0.1", ("0",))])
    assert where(plan.trainer) == [("local", ("0",))] and where(plan.engines) == [("local", ("0",))]


def test_without_gpus_everything_runs_on_the_first_node() -> None:
    plan = plan_placement(ResourcesSection(trainer_ranks=2, engines=3, colocate=False), [Node("head", "10.0.0.1"), Node("w", "10.0.0.2")])
    assert not plan.uses_gpus
    assert where(plan.trainer) == [("head", ())] * 2 and where(plan.engines) == [("head", ())] * 3


def test_more_gpus_than_exist_says_what_fits() -> None:
    with pytest.raises(ConfigError) as error:
        plan_placement(ResourcesSection(trainer_ranks=4, engines=3, gpus_per_engine=2, colocate=False), cluster(1))
    message = str(error.value)
    assert "needs 10 GPUs (4 trainer + 3 engine(s) x 2)" in message and "offers 8 (1 node(s) x 8 GPUs)" in message
    assert "at most 2 engine(s) of 2 GPUs fit" in message


def test_engine_tp_that_does_not_divide_a_node() -> None:
    with pytest.raises(ConfigError, match=r"gpus_per_engine \(3\) does not divide the 8 GPUs of node 10.0.0.1; use one of 1, 2, 4, 8"):
        plan_placement(ResourcesSection(trainer_ranks=2, engines=1, gpus_per_engine=3, colocate=False), cluster(1))
    with pytest.raises(ConfigError, match="no node has more than 8 GPUs"):
        plan_placement(ResourcesSection(trainer_ranks=8, engines=1, gpus_per_engine=16, colocate=True), cluster(2))


def test_colocated_engine_without_a_trainer_rank_on_its_gpu() -> None:
    with pytest.raises(ConfigError, match="engine 1 would start on GPU 2 where no trainer rank runs"):
        plan_placement(ResourcesSection(trainer_ranks=2, engines=2, gpus_per_engine=2, colocate=True), cluster(1))


def test_more_nodes_than_the_cluster_has() -> None:
    with pytest.raises(ConfigError, match="resources.nodes is 3 but the executor offers 2 node"):
        plan_placement(ResourcesSection(nodes=3), cluster(2))


def test_config_rejects_a_tp_that_does_not_divide_gpus_per_node_and_names_moved_keys() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, ["resources.gpus_per_node=8", "resources.gpus_per_engine=3", "rollout.num_engines=2"])
    message = str(error.value)
    assert "gpus_per_engine (3) does not divide gpus_per_node (8); use one of 1, 2, 4, 8" in message
    assert "rollout.num_engines: moved to resources.engines" in message
