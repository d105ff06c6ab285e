"""SGLang engines under Miles: ``rollout.engine: sglang`` starts ``python -m sglang.launch_server``
per engine, in SGLang's own environment, with flags from the ``sglang`` config section.

SGLang's HTTP API is the engine API Miles speaks (``miles_contracts.wire.engine``), so the router,
the session server, the rollout and the weight transports need nothing SGLang-specific; the
contract suite (``miles_contracts.testing.engine``) holds both engines to it.
"""

from miles_sglang.launch import LaunchPlan, SGLangEngine, launch_plan
from miles_sglang.settings import SGLangSection

__all__ = ["LaunchPlan", "SGLangEngine", "SGLangSection", "launch_plan"]
