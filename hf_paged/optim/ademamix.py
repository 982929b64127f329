r"""AdEMAMix with paged state: :class:`PagedAdEMAMix` (fp32 state), :class:`PagedAdEMAMix8bit` (8-bit state) and
:class:`PagedAdEMAMix4bit` (4-bit state).

AdEMAMix (Pagliardini, Ablin and Grangier, "The AdEMAMix Optimizer: Better, Faster, Older", 2024) adds to Adam a
slow moving average of the gradient, which remembers gradients for thousands of steps. For a parameter
:math:`\theta` with gradient :math:`g_t` at step :math:`t` (decoupled weight decay, bitsandbytes' defaults):

.. math::
    m_{1,t} &= \beta_1 m_{1,t-1} + (1 - \beta_1) g_t \\
    m_{2,t} &= \beta_3(t) m_{2,t-1} + (1 - \beta_3(t)) g_t \\
    \nu_t &= \beta_2 \nu_{t-1} + (1 - \beta_2) g_t^2 \\
    \theta_t &= \theta_{t-1} - \gamma \left(
        \frac{m_{1,t} / (1 - \beta_1^t) + \alpha(t) \, m_{2,t}}{\sqrt{\nu_t} / \sqrt{1 - \beta_2^t} + \epsilon}
        + \lambda \theta_{t-1} \right)

with learning rate :math:`\gamma`, weight decay :math:`\lambda`, and the state ``exp_avg`` (:math:`m_1`),
``exp_avg_slow`` (:math:`m_2`) and ``exp_avg_sq`` (:math:`\nu`). With ``t_alpha`` and ``t_beta3`` the paper's
schedulers warm the slow average up: :math:`\alpha(t) = \min(t \alpha / T_\alpha, \alpha)` and
:math:`\beta_3(t) = \min(\exp(\ln\beta_1 \ln\beta_3 / ((1 - t/T_{\beta_3}) \ln\beta_3 + (t/T_{\beta_3}) \ln\beta_1)),
\beta_3)`; without them :math:`\alpha(t) = \alpha` and :math:`\beta_3(t) = \beta_3`. The update is computed in fp32
for fp32, bf16 and fp16 parameters.

The functional core is :func:`~hf_paged.kernels.rules.ademamix_update_` (the update of fp32 tensors, which every
kernel family follows) and :func:`~hf_paged.kernels.rules.ademamix_scalars` (its scalars for a param group at a
step); the classes here check the hyperparameters and choose the state format.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ..kernels.rules import ademamix_scalars, ademamix_update_
from ..stochastic_rounding import check_stochastic_rounding, rounding_defaults
from .base import (
    DEFAULT_PAGE_SIZE,
    PagedOptimizer,
    betas_sequence,
    check_eps,
    check_lr,
    check_weight_decay,
    real_number,
)


def check_ademamix_betas(betas: Any, scheduled: bool) -> None:
    """``betas`` must be a triple ``(beta1, beta2, beta3)`` of numbers in [0, 1); with the beta3 scheduler
    (``scheduled``), ``beta1`` and ``beta3`` must be above 0 (it takes their logarithms). A 1-D tensor or array of
    three is taken too, as bitsandbytes' AdEMAMix takes it."""
    betas = betas_sequence(betas)
    sequence = isinstance(betas, (tuple, list))
    for i, beta in enumerate(betas if sequence else ()):
        value = real_number(beta)
        if value is None or not 0.0 <= value < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {beta!r}")
    if not sequence or len(betas) != 3:
        raise ValueError(f"betas must be a triple (beta1, beta2, beta3), got {betas!r}")
    if scheduled and (real_number(betas[0]) == 0 or real_number(betas[2]) == 0):
        raise ValueError(f"with t_beta3, beta1 and beta3 must be in (0, 1), got betas={tuple(betas)!r}")


def check_alpha(alpha: Any) -> None:
    value = real_number(alpha)
    if value is None or not math.isfinite(value) or value < 0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")


def check_schedule_steps(name: str, steps: Any) -> None:
    """``steps`` (``t_alpha`` or ``t_beta3``) must be ``None`` (no scheduler) or an integer >= 1."""
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(f"{name} must be None (no scheduler) or an integer >= 1, got {steps!r}")


class _PagedAdEMAMixBase(PagedOptimizer):
    state_names = ("exp_avg", "exp_avg_slow", "exp_avg_sq")
    signed_states = (True, True, False)

    def check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_schedule_steps("t_alpha", group["t_alpha"])
        check_schedule_steps("t_beta3", group["t_beta3"])
        check_ademamix_betas(group["betas"], group["t_beta3"] is not None)
        check_alpha(group["alpha"])
        check_eps(group["eps"])
        check_weight_decay(group["weight_decay"])
        check_stochastic_rounding(group)

    @staticmethod
    def update_rule():
        return ademamix_update_

    def rule_scalars(self, group: dict[str, Any], step: float) -> dict[str, float]:
        return ademamix_scalars(group, step)


def _defaults(
    lr: float,
    betas: tuple[float, float, float],
    alpha: float,
    t_alpha: int | None,
    t_beta3: int | None,
    eps: float,
    weight_decay: float,
    bf16_stochastic_round: bool,
    stochastic_round_seed: int,
) -> dict[str, Any]:
    defaults = {
        "lr": lr,
        "betas": betas,
        "alpha": alpha,
        "t_alpha": t_alpha,
        "t_beta3": t_beta3,
        "eps": eps,
        "weight_decay": weight_decay,
    }
    defaults.update(rounding_defaults(bf16_stochastic_round, stochastic_round_seed))
    return defaults


class PagedAdEMAMix(_PagedAdEMAMixBase):
    """AdEMAMix (bitsandbytes' update and defaults) with fp32 state (12 bytes per parameter) in pages under a device
    budget.

    Args:
        params: parameters or param groups (each group may set its own ``lr``, ``betas``, ``alpha``, ``t_alpha``,
            ``t_beta3``, ``eps`` and ``weight_decay``).
        lr: learning rate :math:`\\gamma`.
        betas: :math:`(\\beta_1, \\beta_2, \\beta_3)`, each in [0, 1): the fast average's, the second moment's and the
            slow average's decay.
        alpha: weight :math:`\\alpha` >= 0 of the slow average.
        t_alpha: steps over which alpha warms up from 0 (``None``: no scheduler).
        t_beta3: steps over which beta3 warms up from beta1 (``None``: no scheduler).
        eps: :math:`\\epsilon` >= 0, added to the denominator.
        weight_decay: decoupled weight decay :math:`\\lambda` >= 0.
        page_size, device_budget, prefetch, compiled: paging settings, see :class:`PagedOptimizer`.
        bf16_stochastic_round: round bf16 parameters' updated values to bf16 stochastically instead of to nearest,
            so that updates below half a bf16 spacing are kept in expectation (no effect on other dtypes).
        stochastic_round_seed: seed of the rounding bits, an integer in [0, 2**64); saved in the param groups.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        page_size: int | str = DEFAULT_PAGE_SIZE,
        device_budget: int | str | None = None,
        prefetch: int = 2,
        compiled: bool | None = None,
        bf16_stochastic_round: bool = False,
        stochastic_round_seed: int = 0,
    ) -> None:
        defaults = _defaults(
            lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, bf16_stochastic_round, stochastic_round_seed
        )
        super().__init__(
            params, defaults, page_size=page_size, device_budget=device_budget, prefetch=prefetch, compiled=compiled
        )


class PagedAdEMAMix8bit(_PagedAdEMAMixBase):
    """AdEMAMix with blockwise 8-bit state (3.05 bytes per parameter) in pages under a device budget.

    Both averages use the signed 8-bit map, the second moment the non-negative one (see
    :class:`~hf_paged.codecs.Blockwise8bitCodec`). Tensors with fewer than ``min_8bit_size`` elements keep fp32 state.

    Args:
        params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay: as :class:`PagedAdEMAMix`.
        block_size: elements per quantization block (one fp32 scale each).
        min_8bit_size: tensors with fewer elements keep fp32 state.
        page_size, device_budget, prefetch, compiled: paging settings, see :class:`PagedOptimizer`.
        bf16_stochastic_round, stochastic_round_seed: as :class:`PagedAdEMAMix`.
        fp32_state_modules: modules whose parameters keep fp32 state whatever their size, in the
            param groups as given (see :class:`~hf_paged.optim.base.PagedOptimizer`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        page_size: int | str = DEFAULT_PAGE_SIZE,
        device_budget: int | str | None = None,
        prefetch: int = 2,
        compiled: bool | None = None,
        bf16_stochastic_round: bool = False,
        stochastic_round_seed: int = 0,
        fp32_state_modules: Iterable[torch.nn.Module] = (),
    ) -> None:
        defaults = _defaults(
            lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, bf16_stochastic_round, stochastic_round_seed
        )
        super().__init__(
            params,
            defaults,
            page_size=page_size,
            device_budget=device_budget,
            prefetch=prefetch,
            eight_bit=True,
            block_size=block_size,
            min_8bit_size=min_8bit_size,
            compiled=compiled,
            fp32_state_modules=fp32_state_modules,
        )


class PagedAdEMAMix4bit(_PagedAdEMAMixBase):
    """AdEMAMix with blockwise 4-bit state (1.59 bytes per parameter; 3.09 for rows shorter than a block) in pages
    under a device budget.

    Both averages use the signed quadratic 4-bit map with zero, the second moment the zero-excluding quartic one,
    each with one fp32 scale per block (see :class:`~hf_paged.codecs.Blockwise4bitCodec`). Tensors with fewer than
    ``min_4bit_size`` elements keep fp32 state, and those whose rows are shorter than a block (LoRA's ``B`` matrices)
    blockwise 8-bit state unless ``short_rows="4bit"``, as :class:`~hf_paged.optim.adamw.PagedAdamW4bit` does.

    Args:
        params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay: as :class:`PagedAdEMAMix`.
        block_size: elements per quantization block (one fp32 scale each), a power of two from 16 to 4096.
        min_4bit_size: tensors with fewer elements keep fp32 state.
        short_rows: the state format of tensors whose rows are shorter than a block, ``"8bit"`` or ``"4bit"``.
        page_size, device_budget, prefetch, compiled: paging settings, see :class:`PagedOptimizer`.
        bf16_stochastic_round, stochastic_round_seed: as :class:`PagedAdEMAMix`.
        fp32_state_modules: modules whose parameters keep fp32 state whatever their size, in the
            param groups as given (see :class:`~hf_paged.optim.base.PagedOptimizer`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 128,
        min_4bit_size: int = 4096,
        short_rows: str = "8bit",
        page_size: int | str = DEFAULT_PAGE_SIZE,
        device_budget: int | str | None = None,
        prefetch: int = 2,
        compiled: bool | None = None,
        bf16_stochastic_round: bool = False,
        stochastic_round_seed: int = 0,
        fp32_state_modules: Iterable[torch.nn.Module] = (),
    ) -> None:
        defaults = _defaults(
            lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, bf16_stochastic_round, stochastic_round_seed
        )
        super().__init__(
            params,
            defaults,
            page_size=page_size,
            device_budget=device_budget,
            prefetch=prefetch,
            four_bit=True,
            block_size=block_size,
            min_4bit_size=min_4bit_size,
            short_rows=short_rows,
            compiled=compiled,
            fp32_state_modules=fp32_state_modules,
        )
