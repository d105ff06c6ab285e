"""Conformance suites a plugin package runs against its own implementation.

Each suite is a plain function that raises ``AssertionError`` with a precise message on the first
broken rule, so it works under pytest (call it from a test) and from a script. Suites import torch
lazily. Available suites (one module each):

- :mod:`miles_contracts.testing.reward` -- ``check_reward(spec_or_fn)``
- :mod:`miles_contracts.testing.filter` -- ``check_filter(spec_or_fn)``
- :mod:`miles_contracts.testing.advantage` -- ``check_advantage(spec, stage=miles.advantages.estimate_advantages)``
- :mod:`miles_contracts.testing.bridge` -- ``check_model_bridge(bridge, hf_model_dir)``
- :mod:`miles_contracts.testing.megatron` -- ``check_against_megatron(bridge, hf_model_dir)`` (optional:
  builds the megatron-core ``GPTModel`` on CPU and compares names, shapes and logits)
- :mod:`miles_contracts.testing.transport` -- ``check_weight_transport(transport, engine_urls, tensors)``
- :mod:`miles_contracts.testing.backend` -- ``check_train_backend(factory)``
- :mod:`miles_contracts.testing.executor` -- ``check_executor(make_executor, run_dir)`` against an
  executor starting real child processes (launch, health, logs, restarts, supervision, shutdown)
- :mod:`miles_contracts.testing.engine` -- ``check_engine(EngineUnderTest(url, ...))`` against a running
  inference engine's HTTP API (SGLang's), or one check at a time from ``ENGINE_CHECKS``; also
  ``python -m miles_contracts.testing.engine URL``

Test support, not a suite: :mod:`miles_contracts.testing.processes` -- ``LoggedProcess(argv, log)`` and
``wait_ready(check, what)``: start a server for a test and wait until it is ready on its own signals
(its health answering, a line of its log), not on a fixed timeout.
"""
