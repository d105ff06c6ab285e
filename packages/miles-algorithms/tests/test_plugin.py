"""The plugin registers every name through the hooks, stays light, and checks the GSPO pairing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from miles.config import build_config
from miles.errors import ConfigError
from miles.kernel import Kernel


def test_every_name_is_registered():
    kernel = Kernel.load()
    assert kernel.advantages().names() == ["grpo", "gspo", "ppo", "reinforce_pp", "reinforce_pp_baseline"]
    assert kernel.policy_losses().names() == ["ppo_clip", "gspo", "cispo"]
    assert kernel.mismatch_corrections().names() == ["none", "tis", "mis"]
    assert kernel.advantages().get("ppo").needs_critic is True
    assert kernel.advantages().get("grpo").needs_critic is False


def test_importing_the_plugin_does_not_import_torch():
    code = "import sys, miles_algorithms.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_collecting_the_registries_does_not_import_torch():
    # validating a config collects them (`miles config show`); torch waits for the first call
    code = ("import sys; from miles.kernel import Kernel; k = Kernel.load(); "
            "k.advantages(); k.policy_losses(); k.mismatch_corrections(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_catalog_names_every_implementation_and_calls_it():
    import torch
    from miles_algorithms.catalog import ADVANTAGE_SPECS, CORRECTION_SPECS, POLICY_LOSS_SPECS
    from miles_algorithms.corrections import CORRECTIONS
    from miles_algorithms.estimators import ESTIMATORS
    from miles_algorithms.losses import POLICY_LOSSES
    from miles_contracts import AlgorithmParams

    assert list(ADVANTAGE_SPECS) == list(ESTIMATORS)
    assert list(POLICY_LOSS_SPECS) == list(POLICY_LOSSES)
    assert list(CORRECTION_SPECS) == list(CORRECTIONS)
    proximal, rollout = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, -1.5, -1.0]])
    mask, params = torch.tensor([[0, 1, 1]]), AlgorithmParams(correction_high=1.5)
    weights, _ = CORRECTION_SPECS["mis"].correct(proximal, rollout, mask, params)
    expected, _ = CORRECTIONS["mis"](proximal, rollout, mask, params)
    assert torch.equal(weights, expected)


def test_gspo_advantage_needs_the_gspo_loss():
    # the pairing is the spec's (AdvantageSpec.policy_loss), checked by the kernel with the config
    assert Kernel.load().advantages().get("gspo").policy_loss == "gspo"
    with pytest.raises(ConfigError, match="algorithm.advantage 'gspo' needs train.policy_loss: gspo, got 'ppo_clip'"):
        build_config({"algorithm": {"advantage": "gspo"}, "train": {"policy_loss": "ppo_clip"}})
    build_config({"algorithm": {"advantage": "gspo"}, "train": {"policy_loss": "gspo"}})
    # GRPO advantages with sequence ratios: allowed
    build_config({"algorithm": {"advantage": "grpo"}, "train": {"policy_loss": "gspo"}})
