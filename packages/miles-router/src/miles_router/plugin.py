"""Plugin ``router``: the ``router`` service and config section, the ``miles serve router`` command
and the router middlewares ``metrics``, ``access_log`` and ``concurrency_limit``. Light on purpose:
FastAPI and httpx load only when the router runs."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import (
    CommandSpec,
    ConfigSectionSpec,
    RouterMiddleware,
    RouterMiddlewareSpec,
    RunContext,
    ServiceSpec,
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_router.cli import add_arguments

    add_arguments(parser)


def _run(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_router.cli import run

    return run(args)


def _metrics(ctx: RunContext, options: Mapping[str, Any]) -> RouterMiddleware:
    from miles_router.middlewares.metrics import metrics

    return metrics(dict(options))


def _access_log(ctx: RunContext, options: Mapping[str, Any]) -> RouterMiddleware:
    from miles_router.middlewares.access_log import access_log

    return access_log(dict(options))


def _concurrency_limit(ctx: RunContext, options: Mapping[str, Any]) -> RouterMiddleware:
    from miles_router.middlewares.concurrency import concurrency_limit

    return concurrency_limit(dict(options))


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_router.bench import add_arguments

    add_arguments(parser)


def _bench(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_router.bench import run

    return run(args)


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    register("serve router", CommandSpec(
        "HTTP router in front of engines: least-in-flight, affinity, health checks, failover, fan-out",
        _run, add_arguments=_add_arguments,
        description="Route SGLang-native engine requests over the engines given with --worker "
                    "(more can join with POST /add_worker).",
    ))
    register("bench rollout-path", CommandSpec(
        "HTTP cost of a rollout burst (driver -> router -> engine): lean client vs httpx",
        _bench, add_arguments=_bench_arguments,
        description="Start an embedded engine and two routers (lean and httpx forwarding), time bursts of "
                    "one-token requests over each path and print JSON with the ratios.",
    ))


@hookimpl
def miles_register_services(register: Register[ServiceSpec]) -> None:
    from miles_router.service import ROUTER_SERVICE

    register("router", ROUTER_SERVICE)


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_router.config import RouterSection

    register("router", ConfigSectionSpec(RouterSection))


@hookimpl
def miles_register_router_middlewares(register: Register[RouterMiddlewareSpec]) -> None:
    # metrics and concurrency_limit also report to the router's /metrics
    register("metrics", RouterMiddlewareSpec(_metrics, reports=True))
    register("access_log", RouterMiddlewareSpec(_access_log))
    register("concurrency_limit", RouterMiddlewareSpec(_concurrency_limit, reports=True))
