"""Per-token estimators of KL(pi || pi_ref) from tokens sampled by pi.

With ``x = log pi(y) - log pi_ref(y)`` for a token ``y ~ pi`` and ``r = pi_ref(y) / pi(y) = e^-x``:

- ``k1 = x``: unbiased (E_pi[x] = KL), high variance, can be negative per token;
- ``k2 = x^2 / 2``: biased, low variance; its gradient is the gradient of the true KL's
  second-order expansion;
- ``k3 = r - 1 - log r = e^-x - 1 + x``: unbiased (E_pi[r] = 1) and never negative;
- ``low_var_kl``: k3 with x clamped to +-20 and the result clamped to [-10, 10] (the k3 value is
  never negative, so in effect [0, 10]); a bounded loss term for badly diverged tokens.

k3 also clamps x to +-20 before ``exp``: ``e^(1e4)`` is inf in any float format, and a loss term
must stay finite. Within +-20 (a probability ratio of 4.9e8) k3 is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles_algorithms.masking import LOG_RATIO_LIMIT


def _k1(x: torch.Tensor) -> torch.Tensor:
    return x


def _k2(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x.square()


def _k3(x: torch.Tensor) -> torch.Tensor:
    x = x.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.expm1(-x) + x


def _low_var_kl(x: torch.Tensor) -> torch.Tensor:
    return _k3(x).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _low_var_kl,
}


def kl_divergence(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, same shape as the inputs (``[B, T]``).

    Off-mask entries are not special here: callers pass masked inputs or mask the result.

    :param logprobs: log pi of the sampled tokens (the policy that sampled them).
    :param ref_logprobs: log pi_ref of the same tokens.
    :param estimator: ``k1``, ``k2``, ``k3`` or ``low_var_kl``.
    """
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}") from None
    return fn(logprobs.float() - ref_logprobs.float())


def masked_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """``[B, T]``: :func:`kl_divergence` on trainable tokens, 0 elsewhere (off-mask inputs never read)."""
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    kl = kl_divergence(torch.where(mask, logprobs.float(), zero), torch.where(mask, ref_logprobs.float(), zero), estimator)
    return torch.where(mask, kl, zero)
