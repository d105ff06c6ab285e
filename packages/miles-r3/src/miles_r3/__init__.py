"""miles-r3: rollout routing replay (R3) for mixture-of-experts models.

During rollout, engines report the experts every MoE layer chose for every token
(``return_routed_experts``); the samples keep them compactly (``miles_r3.experts``), through
multi-turn sessions, trimming and merging, into the training batch; in training a ``miles_forward``
wrapper forces every router to the recorded experts (``miles_r3.hf`` for transformers models,
``miles_r3.megatron`` for megatron-core), so the trainer computes log-probs through the same experts
the engine sampled with. Switched on by ``r3.enabled: true``; see ``docs/design/r3.md``.

Importing this package is cheap (no torch): the plugin module loads the rest when used.
"""

ROUTED_EXPERTS_NAME = "r3.routed_experts"
"""Stash key name of a sample's routed experts, and key of their ``TrainBatch.extras`` tensor."""
