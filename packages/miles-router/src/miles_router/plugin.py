"""Plugin ``router``: the ``router`` service and config section, the ``miles serve router`` command
and the router middlewares ``metrics``, ``access_log`` and ``concurrency_limit``. Light on purpose:
FastAPI and httpx load only when the router runs."""

from __future__ import annotations

import argparse
from typing import Any

from miles import hookimpl
from miles.cli import Command
from miles.registry import Register


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_router.cli import add_arguments

    add_arguments(parser)


def _run(args: argparse.Namespace) -> int:
    from miles_router.cli import run

    return run(args)


def _metrics(options: dict[str, Any]) -> Any:
    from miles_router.middlewares.metrics import metrics

    return metrics(options)


def _access_log(options: dict[str, Any]) -> Any:
    from miles_router.middlewares.access_log import access_log

    return access_log(options)


def _concurrency_limit(options: dict[str, Any]) -> Any:
    from miles_router.middlewares.concurrency import concurrency_limit

    return concurrency_limit(options)


@hookimpl
def miles_register_commands(register: Register) -> None:
    register("serve router", Command(
        help="HTTP router in front of engines: least-in-flight, affinity, health checks, failover, fan-out",
        run=_run, add_arguments=_add_arguments,
        description="Route SGLang-native engine requests over the engines given with --worker "
                    "(more can join with POST /add_worker).",
    ))
    register("bench rollout-path", Command(
        help="HTTP cost of a rollout burst (driver -> router -> engine): lean client vs httpx",
        run=_lazy_bench("run"), add_arguments=_lazy_bench("add_arguments"),
        description="Start an embedded engine and two routers (lean and httpx forwarding), time bursts of "
                    "one-token requests over each path and print JSON with the ratios.",
    ))


def _lazy_bench(name: str):
    def call(*args):
        from miles_router import bench

        return getattr(bench, name)(*args)

    return call


@hookimpl
def miles_register_services(register: Register) -> None:
    from miles_router.service import RouterService

    register("router", RouterService())


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    from miles_router.config import RouterSection

    register("router", RouterSection)


@hookimpl
def miles_register_router_middlewares(register: Register) -> None:
    register("metrics", _metrics)
    register("access_log", _access_log)
    register("concurrency_limit", _concurrency_limit)
