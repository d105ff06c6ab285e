"""Miles: agentic-first reinforcement-learning post-training for LLMs.

The kernel is small: hook specs (:mod:`miles.hookspecs`), the plugin manager
(:mod:`miles.plugins`), a typed facade over it (:class:`miles.kernel.Kernel`), typed config
(:mod:`miles.config`) and the ``miles`` CLI. Everything a user chooses -- generators, rewards,
advantages, backends, engines, transports -- is a plugin found through the ``miles`` entry-point
group. Importing ``miles`` imports none of torch, ray, transformers, fastapi or megatron.
"""

from miles.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl"]
