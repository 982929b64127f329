r"""Lion with paged state: :class:`PagedLion` (fp32 momentum) and :class:`PagedLion8bit` (8-bit momentum).

Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), with decoupled weight decay
and bitsandbytes' defaults. For a parameter :math:`\theta` with gradient :math:`g_t`:

.. math::
    c_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
    \theta_t &= \theta_{t-1} (1 - \gamma \lambda) - \gamma \operatorname{sign}(c_t) \\
    m_t &= \beta_2 m_{t-1} + (1 - \beta_2) g_t

with the state ``exp_avg`` (:math:`m`). The update is computed in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..kernels.rules import lion_update_
from ..stochastic_rounding import check_stochastic_rounding, rounding_defaults
from .base import DEFAULT_PAGE_SIZE, PagedOptimizer, check_betas, check_lr, check_weight_decay


class _PagedLionBase(PagedOptimizer):
    state_names = ("exp_avg",)
    signed_states = (True,)

    def check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_weight_decay(group["weight_decay"])
        check_stochastic_rounding(group)

    @staticmethod
    def update_rule():
        return lion_update_

    def rule_scalars(self, group: dict[str, Any], step: float) -> dict[str, float]:
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        return {
            "lr": lr,
            "decay": 1 - lr * group["weight_decay"],
            "direction_weight": 1 - beta1,
            "avg_weight": 1 - beta2,
        }


class PagedLion(_PagedLionBase):
    """Lion (bitsandbytes' defaults) with fp32 momentum in pages under a device budget.

    Args:
        params: parameters or param groups (each group may set its own ``lr``, ``betas``, ``weight_decay``).
        lr: learning rate :math:`\\gamma`.
        betas: :math:`(\\beta_1, \\beta_2)`, each in [0, 1).
        weight_decay: decoupled weight decay :math:`\\lambda` >= 0.
        page_size, device_budget, prefetch, compiled: paging settings, see :class:`PagedOptimizer`.
        bf16_stochastic_round: round bf16 parameters' updated values to bf16 stochastically instead of to nearest,
            so that updates below half a bf16 spacing are kept in expectation (no effect on other dtypes).
        stochastic_round_seed: seed of the rounding bits, an integer in [0, 2**64); saved in the param groups.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        page_size: int | str = DEFAULT_PAGE_SIZE,
        device_budget: int | str | None = None,
        prefetch: int = 2,
        compiled: bool | None = None,
        bf16_stochastic_round: bool = False,
        stochastic_round_seed: int = 0,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        defaults.update(rounding_defaults(bf16_stochastic_round, stochastic_round_seed))
        super().__init__(
            params, defaults, page_size=page_size, device_budget=device_budget, prefetch=prefetch, compiled=compiled
        )


class PagedLion8bit(_PagedLionBase):
    """Lion with blockwise 8-bit momentum (1.02 bytes per parameter) in pages under a device budget.

    Args:
        params, lr, betas, weight_decay: as :class:`PagedLion`.
        block_size: elements per quantization block (one fp32 scale each).
        min_8bit_size: tensors with fewer elements keep fp32 state.
        page_size, device_budget, prefetch, compiled: paging settings, see :class:`PagedOptimizer`.
        bf16_stochastic_round: round bf16 parameters' updated values to bf16 stochastically instead of to nearest,
            so that updates below half a bf16 spacing are kept in expectation (no effect on other dtypes).
        stochastic_round_seed: seed of the rounding bits, an integer in [0, 2**64); saved in the param groups.
        fp32_state_modules: modules whose parameters keep fp32 state whatever their size, in the
            param groups as given (see :class:`~hf_paged.optim.base.PagedOptimizer`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
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
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        defaults.update(rounding_defaults(bf16_stochastic_round, stochastic_round_seed))
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
