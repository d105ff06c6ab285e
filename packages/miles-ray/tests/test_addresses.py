"""Where a run's processes on Ray listen: loopback when the whole run is on the driver's node (it
used the node's IP, so a one-machine run answered the network), the node's address otherwise. The
decision is a pure function of the placement; the conformance suite runs the executor itself."""

from __future__ import annotations

from miles_ray.addresses import LOOPBACK, process_address


def test_a_run_on_the_drivers_node_only_listens_on_loopback() -> None:
    assert process_address("10.0.0.5", {"head"}, "head") == LOOPBACK
    assert process_address("10.0.0.5", ["head", "head"], "head") == LOOPBACK  # several bundles on one node


def test_a_run_that_spans_nodes_uses_node_addresses() -> None:
    assert process_address("10.0.0.5", {"head", "worker-1"}, "head") == "10.0.0.5"
    assert process_address("10.0.0.7", {"worker-1"}, "head") == "10.0.0.7"  # its GPUs are on another node
    # two Ray nodes of one machine (one IP) are two nodes: their processes reach each other on that IP
    assert process_address("127.0.0.1", {"head", "second"}, "head") == "127.0.0.1"


def test_before_anything_is_placed_the_node_address_is_kept() -> None:
    assert process_address("10.0.0.5", set(), "head") == "10.0.0.5"
