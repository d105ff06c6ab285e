"""The address a run's processes on Ray listen on and are reached at.

Ray names each node by its IP, and a process started there listened on that IP, even when the
whole run was on one machine: its engines, router and session server then answered the network
rather than loopback only. A run whose every process is on the driver's node needs no other
machine to reach it: there they listen on 127.0.0.1, as under the local executor, and the trainer's
rendezvous and the ranks' channel to the driver use loopback too. Only a layout that spans nodes
(or puts its GPUs on a node other than the driver's) uses node addresses.

One machine can hold several Ray nodes (the test cluster does): they have one IP but run separate
processes, and count as separate nodes here, so such a run keeps node addresses; they reach each
other on that IP as before.
"""

from __future__ import annotations

from collections.abc import Collection

LOOPBACK = "127.0.0.1"


def process_address(node_address: str, nodes_in_use: Collection[str], driver_node: str) -> str:
    """Where a process on a node whose IP is ``node_address`` listens and is reached.

    :param nodes_in_use: ids of every node the run's processes are placed on (the nodes of its
        reserved GPUs, or the one that runs processes without GPUs); empty before reservation.
    :param driver_node: the id of the node the driver runs on.
    """
    on_driver_node_only = bool(nodes_in_use) and all(node == driver_node for node in nodes_in_use)
    return LOOPBACK if on_driver_node_only else node_address
