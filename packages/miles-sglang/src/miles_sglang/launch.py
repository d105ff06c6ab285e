"""How one SGLang engine is started: ``python -m sglang.launch_server`` with flags from the config.

:func:`launch_plan` is a pure function from (engine spec, ``sglang`` section, whether the run has a
token, GPUs) to the argv and the environment of the process, so any launcher can use it: :class:`SGLangEngine` folds
the environment into the argv (``env K=V ... python -m sglang.launch_server ...``), and
:data:`SGLANG_SERVICE` (an :class:`SGLangService`'s spec) is what the package registers through ``miles_register_services`` (role
``engine``): the executor picks host, port and GPUs (``CUDA_VISIBLE_DEVICES``), the service the rest.

SGLang runs in its own environment (``sglang.python``, ``sglang.env``): it pins a transformers
version Miles does not use, and the two must never share a Python process.

The run token reaches SGLang as ``--api-key``: SGLang checks ``Authorization: Bearer`` against it on
every route but ``/health*`` and ``/metrics``, the header Miles' clients send. SGLang (0.5.13) reads
the key from its argv or a ``--config`` file only, and argv is what every user of the host sees
(``/proc/<pid>/cmdline``) and what an executor writes into the engine's log. So the token is never
in argv: an authenticated engine is started as ``python -c <API_KEY_FROM_ENV> <flags>``, a line that
takes the token out of ``MILES_AUTH_TOKEN`` (the process inherits it from the run) and appends
``--api-key`` to ``sys.argv`` inside the process before it runs ``sglang.launch_server`` as
``python -m`` would. (A 0600 YAML for ``--config`` would work too, but is a file holding the token
that must be cleaned up, on every node.) SGLang still prints its ``server_args``, the key included,
when it logs at ``info``; the executor redacts the run's secrets from every log line
(``miles.executor.output``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles_contracts import ServiceSpec
from miles_contracts.cluster import ENGINE

from miles_sglang.settings import SGLangSection

if TYPE_CHECKING:
    from miles_contracts import EngineSpec, ServiceLaunch
    from miles_contracts.lora import LoRASpec

TOKEN_ENV = "MILES_AUTH_TOKEN"
API_KEY_FROM_ENV = (
    f"import os, runpy, sys; key = os.environ.pop({TOKEN_ENV!r}, '') or sys.exit('miles: {TOKEN_ENV} is not set, "
    "and this SGLang engine must not serve without a token'); sys.argv += ['--api-key', key]; "
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)"
)
"""The launcher of an authenticated engine (``python -c``): the token from the environment becomes
``--api-key`` in ``sys.argv`` only, never in the command line of the process. The variable is removed
before SGLang runs, so its own processes do not inherit it."""
_DTYPES = {"bfloat16", "float16", "float32", "half", "float"}


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """The process of one SGLang engine: ``argv`` run in the parent's environment without ``unset``
    and with ``env`` on top."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()

    def environment(self, parent: Mapping[str, str]) -> dict[str, str]:
        return {**{k: v for k, v in parent.items() if k not in self.unset}, **self.env}

    def command(self) -> list[str]:
        """``argv`` with the environment changes folded in through ``env(1)``, for launchers that
        take an argv only."""
        if not self.env and not self.unset:
            return list(self.argv)
        removals = [part for name in self.unset for part in ("-u", name)]
        return ["env", *removals, *(f"{key}={value}" for key, value in sorted(self.env.items())), *self.argv]


_GRPC_OFFSET = 10000  # SGLang's native gRPC port is --port + this
_HEALTH_GENERATION = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


def launch_plan(spec: EngineSpec, section: SGLangSection, *, authenticated: bool = False,
                gpus: Sequence[int | str] | None = None, lora: LoRASpec | None = None) -> LaunchPlan:
    """The argv and environment that serve ``spec`` with SGLang.

    :param spec: model folder, host, port, device and dtype (``auto`` leaves SGLang's default),
        ``deterministic`` (``--enable-deterministic-inference``).
    :param section: the run's ``sglang`` section.
    :param authenticated: SGLang requires the run token (``--api-key``), which it reads from
        ``MILES_AUTH_TOKEN`` in its environment when it starts (:data:`API_KEY_FROM_ENV`); the token
        is in neither the argv nor the ``env`` of the plan. ``False``: an open server.
    :param gpus: the GPUs this engine may use, as ``CUDA_VISIBLE_DEVICES`` entries; ``None`` leaves
        the inherited ones. Their number must be what the layout needs (``tp_size * dp_size``).
    :param lora: serve LoRA adapters of these settings next to the base (:mod:`miles_sglang.lora`).
    """
    if gpus is not None and len(gpus) != gpus_needed(section):
        raise ValueError(f"an engine with tp_size={section.tp_size} and dp_size={section.dp_size} runs on "
                         f"{gpus_needed(section)} GPUs, but {len(gpus)} were given ({list(gpus)})")
    entry = ["-c", API_KEY_FROM_ENV] if authenticated else ["-m", "sglang.launch_server"]
    argv = [section.python or sys.executable, *entry,
            "--model-path", str(spec.model_path), "--host", spec.host, "--port", str(spec.port),
            "--tp-size", str(section.tp_size), "--dp-size", str(section.dp_size), "--ep-size", str(section.ep_size),
            "--weight-version", "0",  # as the embedded engine: the first weight sync makes it 1
            "--log-level", section.log_level]
    argv += _value_flags(spec, section) + _switches(spec, section)
    if lora is not None:
        from miles_sglang.lora import lora_flags

        argv += lora_flags(lora)
    argv += list(section.sglang_args)
    env = dict(section.env)
    if spec.port + _GRPC_OFFSET > 65535 and "SGLANG_GRPC_PORT" not in env:
        # SGLang 0.5.13 derives its native gRPC port as --port + 10000 and refuses to start when that
        # passes 65535, even with gRPC off (sgl-project/sglang#29416); the executor's free ports can
        # be that high. Off by default, the gRPC port is only checked: give it one that passes.
        env["SGLANG_GRPC_PORT"] = str(spec.port - _GRPC_OFFSET)
    if not section.health_generates:
        # The router probes /health every few seconds. Generating there costs ~1 s a probe, and its
        # greedy request joins the rollout's batch, whose sampling flags then keep the top-k path
        # (a flashinfer kernel that is JIT-built on first use) for every decode step after.
        env.setdefault(_HEALTH_GENERATION, "false")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    # Another Python is another environment: Miles' own PYTHONPATH must not reach it (its
    # transformers would shadow SGLang's), unless the section gives SGLang one of its own.
    unset = ("PYTHONPATH",) if section.python and "PYTHONPATH" not in env else ()
    return LaunchPlan(argv, env, unset)


def gpus_needed(section: SGLangSection) -> int:
    """GPUs one engine occupies (with ``--enable-dp-attention`` the replicas share the TP ranks)."""
    return section.tp_size if "--enable-dp-attention" in section.sglang_args else section.gpus_per_engine


def _value_flags(spec: EngineSpec, section: SGLangSection) -> list[str]:
    if spec.dtype != "auto" and spec.dtype not in _DTYPES:
        raise ValueError(f"dtype {spec.dtype!r} is not one SGLang takes; use auto or one of {sorted(_DTYPES)}")
    values = {
        "--dtype": None if spec.dtype == "auto" else spec.dtype,
        "--device": None if spec.device == "auto" else spec.device.split(":")[0],
        "--mem-fraction-static": section.mem_fraction_static,
        "--context-length": section.context_length,
        "--max-running-requests": section.max_running_requests,
        "--attention-backend": section.attention_backend,
        "--load-format": section.load_format,
        "--random-seed": section.random_seed,
    }
    return [part for flag, value in values.items() if value is not None for part in (flag, str(value))]


def _switches(spec: EngineSpec, section: SGLangSection) -> list[str]:
    switches = {
        "--enable-deterministic-inference": spec.deterministic,  # run.deterministic
        "--enable-return-routed-experts": section.return_routed_experts,
        "--skip-tokenizer-init": section.skip_tokenizer_init,
        "--disable-radix-cache": section.disable_radix_cache,
        "--enable-memory-saver": section.enable_memory_saver,
        "--enable-weights-cpu-backup": section.weights_cpu_backup,
    }
    return [flag for flag, on in switches.items() if on]


class SGLangEngine:
    """``command(spec)``: the argv (environment folded in) of the SGLang server that serves ``spec``.

    ``spec.options`` holds the ``sglang`` section (:attr:`config_section`); with ``MILES_AUTH_TOKEN``
    in the launcher's environment the engine requires that token, which it inherits from the
    environment the executor starts it in, as it does its GPUs.
    """

    config_section = "sglang"

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ

    def command(self, spec: EngineSpec, *, lora: LoRASpec | None = None) -> list[str]:
        """``lora``: make room for the run's adapters (``train.lora``), which weight syncs load."""
        section = SGLangSection.model_validate(dict(spec.options))
        return launch_plan(spec, section, authenticated=bool(self._environ.get(TOKEN_ENV)), lora=lora).command()


class SGLangService:
    """The ``sglang`` engine as a service of the run (role ``engine``, ``rollout.engine: sglang``).

    Each engine gets the GPUs placement gave it (``resources.gpus_per_engine``, which must be what
    the ``sglang`` section's layout occupies: ``tp_size * dp_size``) through
    ``CUDA_VISIBLE_DEVICES``, set by the executor.

    SGLang is not a Miles process: it cannot read the run's config file
    (``ServiceLaunch.config_path``, what Miles' own servers are started with), so its argv is
    derived here, in the driver, from ``launch.config`` (the ``sglang`` and ``model`` sections,
    ``run.deterministic``), and with ``train.lora`` the flags that make room for its adapters
    (:mod:`miles_sglang.lora`; the ``sglang_lora`` weight transport loads them).
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._engine = SGLangEngine(environ)

    def spec(self) -> ServiceSpec:
        """This engine as the service spec the package registers."""
        return ServiceSpec(ENGINE, self.command, config_sections=("model", "sglang"))

    def command(self, launch: ServiceLaunch) -> list[str]:
        from miles_contracts import EngineSpec

        config = launch.config
        section = config.section("sglang", SGLangSection)
        if launch.gpus and launch.gpus != gpus_needed(section):
            raise ValueError(f"an SGLang engine with tp_size={section.tp_size} and dp_size={section.dp_size} runs on "
                             f"{gpus_needed(section)} GPUs, but placement gives it {launch.gpus}; set "
                             f"resources.gpus_per_engine={gpus_needed(section)}")
        spec = EngineSpec(model_path=launch.model_path, port=launch.endpoint.port, host=launch.endpoint.host,
                          device=config.model.device, dtype=config.model.dtype, options=section.options(),
                          deterministic=config.run.deterministic)
        return self._engine.command(spec, lora=config.train.lora)


SGLANG_SERVICE = SGLangService().spec()
"""What this package registers as service ``sglang``."""
