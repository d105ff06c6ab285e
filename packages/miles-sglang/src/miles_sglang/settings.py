"""The ``sglang`` config section: how each SGLang engine of a run is started (``rollout.engine: sglang``).

The model, its device and dtype come from the ``model`` section, host and port from the executor,
the API key from the run token (``MILES_AUTH_TOKEN``), the GPUs from the executor
(``CUDA_VISIBLE_DEVICES``). Everything else SGLang takes is here, and what is not here goes
through ``sglang_args`` unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from miles.sections import Privileged, Section
from pydantic import Field, model_validator

from miles_sglang.owned_flags import owned_flags

if TYPE_CHECKING:
    from miles.config import MilesConfig


class SGLangSection(Section):
    python: Annotated[str | None, Privileged("the Python interpreter that runs SGLang")] = Field(
        default=None, description="Python of SGLang's environment (default: the one running Miles); SGLang pins "
        "its own transformers, so it usually has a virtual environment of its own",
    )
    env: Annotated[dict[str, str], Privileged("the SGLang process's environment (PYTHONPATH, LD_PRELOAD, ... "
                                               "choose the code it loads)")] = Field(
        default_factory=dict, description="environment of the SGLang process on top of Miles' own, e.g. "
        "{PYTHONPATH: /opt/sglang-site} (a PYTHONPATH here replaces Miles', never joins it)",
    )
    tp_size: int = Field(default=1, ge=1, description="tensor-parallel ranks (GPUs) per engine")
    dp_size: int = Field(default=1, ge=1, description="data-parallel replicas inside one engine (each tp_size GPUs)")
    ep_size: int = Field(default=1, ge=1, description="expert-parallel ranks of MoE layers (divides tp_size)")
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1,
                                              description="GPU memory for weights and KV cache (SGLang's default when unset)")
    context_length: int | None = Field(default=None, ge=2)
    max_running_requests: int | None = Field(default=None, ge=1)
    attention_backend: str | None = Field(default=None, description="fa3, flashinfer, triton, ... (SGLang picks when unset)")
    return_routed_experts: bool = Field(default=False, description="MoE: record each token's experts (R3 replay)")
    skip_tokenizer_init: bool = Field(default=False, description="token ids only, no text in or out (no stop strings)")
    disable_radix_cache: bool = Field(default=False, description="no prefix cache (agentic runs want it on)")
    enable_memory_saver: bool = Field(default=False, description="colocated runs: /release_memory_occupation frees GPU memory")
    weights_cpu_backup: bool = Field(default=False, description="keep a host copy of the weights while they are released")
    load_format: str | None = Field(default=None, description="'dummy' serves random weights (benchmarks)")
    random_seed: int | None = None
    log_level: str = "warning"
    health_generates: bool = Field(
        default=False, description="SGLang's /health runs a one-token greedy generation (its default); off here, "
        "/health only says the server is up and /health_generate keeps the deep check (docs/design/sglang.md)",
    )
    sglang_args: Annotated[list[str], Privileged("flags passed to SGLang as they are (--trust-remote-code runs the "
                                                 "model folder's Python)")] = Field(
        default_factory=list, description="more launch_server flags, passed as they are, last",
    )

    @model_validator(mode="after")
    def _check(self) -> SGLangSection:
        errors = []
        if self.tp_size % self.ep_size:
            errors.append(f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size}): SGLang's expert-parallel "
                          "ranks are a split of its tensor-parallel ones")
        clash = owned_flags(self.sglang_args)
        if clash:
            names = [(arg.split("=", 1)[0], option) for arg, option in clash]  # never echo a value given
            spelled = ", ".join(name if name == option else f"{name} (SGLang reads {option})" for name, option in names)
            errors.append(f"sglang_args sets {spelled}, which Miles sets itself (use model.name, the executor, the "
                          "run token and sglang.tp_size / dp_size / ep_size)")
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @property
    def gpus_per_engine(self) -> int:
        """GPUs one engine occupies: SGLang runs ``tp_size`` ranks in each of ``dp_size`` replicas."""
        return self.tp_size * self.dp_size

    def options(self) -> dict[str, Any]:
        """As ``EngineSpec.options`` (what ``SGLangEngine.command`` reads back)."""
        return self.model_dump(mode="json")


def run_errors(config: MilesConfig) -> list[str]:
    """What a run's other sections ask of SGLang that its ``sglang`` section does not give."""
    section = config.section("sglang", SGLangSection)
    errors = []
    release = config.resources.release_engine_memory
    if release != "none" and not section.enable_memory_saver:
        errors.append(f"resources.release_engine_memory ({release}) needs SGLang's memory saver: set "
                      f"sglang.enable_memory_saver: true (without --enable-memory-saver SGLang's "
                      f"/release_memory_occupation frees nothing)")
    if config.train.lora is not None and config.weights.transport != LORA_TRANSPORT:
        # SGLang's model has no parameters named like the adapters: it loads them as adapters
        errors.append(f"train.lora on SGLang engines needs weights.transport: {LORA_TRANSPORT} (got "
                      f"{config.weights.transport!r}): SGLang loads LoRA adapters by name from a PEFT folder, "
                      "not as weight updates")
    return errors


LORA_TRANSPORT = "sglang_lora"
"""The weight transport of ``train.lora`` runs on SGLang engines (``miles_weights.adapters``)."""
