r"""AdamW with paged state: :class:`PagedAdamW` (fp32 moments), :class:`PagedAdamW8bit` (8-bit moments) and
:class:`PagedAdamW4bit` (4-bit moments).

For a parameter :math:`\theta` with gradient :math:`g_t` at step :math:`t` (decoupled weight decay,
Loshchilov and Hutter, as ``torch.optim.AdamW``):

.. math::
    \theta_t &= \theta_{t-1} (1 - \gamma \lambda) \\
    m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
    v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
    \theta_t &= \theta_t - \frac{\gamma}{1 - \beta_1^t} \,
        \frac{m_t}{\sqrt{v_t} / \sqrt{1 - \beta_2^t} + \epsilon}

with learning rate :math:`\gamma`, weight decay :math:`\lambda`, and the state ``exp_avg`` (:math:`m`)
and ``exp_avg_sq`` (:math:`v`). The update is computed in fp32 for fp32, bf16 and fp16 parameters.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..codecs import Float32Codec
from ..kernels.rules import adamw_moments_, adamw_scalars, adamw_update_, adamw_update_multi_
from ..stochastic_rounding import check_stochastic_rounding, rounding_defaults
from ..store import Page
from ._params import check_update_rule_options
from .base import DEFAULT_PAGE_SIZE, PagedOptimizer, check_betas, check_eps, check_lr, check_weight_decay
from .executor import StateViews, WorkItem


def check_torch_options(
    name: str,
    amsgrad: Any,
    maximize: Any,
    foreach: Any,
    capturable: Any,
    differentiable: Any,
    fused: Any,
) -> None:
    """Raise for ``torch.optim.AdamW``'s arguments that a paged AdamW does not have: ``amsgrad`` and ``maximize``
    (another update rule), ``capturable`` (a CUDA graph of the step) and ``differentiable`` (a step autograd follows)
    must be off; ``foreach`` and ``fused`` choose among torch's implementations and may be anything it takes."""
    options = {"amsgrad": amsgrad, "maximize": maximize, "capturable": capturable, "differentiable": differentiable}
    check_update_rule_options(options, name)
    for option, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{option} must be None, True or False, got {value!r}")


class _PagedAdamWBase(PagedOptimizer):
    state_names = ("exp_avg", "exp_avg_sq")
    signed_states = (True, False)

    def check_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_eps(group["eps"])
        check_weight_decay(group["weight_decay"])
        check_stochastic_rounding(group)

    @staticmethod
    def update_rule():
        return adamw_update_

    @staticmethod
    def moments_rule():
        return adamw_moments_

    def rule_scalars(self, group: dict[str, Any], step: float) -> dict[str, float]:
        return adamw_scalars(group, step)

    def takes_pages_fast(self, page: Page, dtypes: set[tuple[torch.dtype, torch.dtype]]) -> bool:
        """Pages of fp32 state on CPU or CUDA with fp32 tensors of fp32 gradients (a page's other tensors are left to
        the rule kernels)."""
        return (
            page.device[0].device.type in ("cpu", "cuda")
            and all(isinstance(codec, Float32Codec) for codec in page.format.codecs)
            and (torch.float32, torch.float32) in dtypes
        )

    def update_pages_fast(
        self,
        batch: list[tuple[Page, list[WorkItem]]],
        step_tensors: dict[tuple[torch.device, float], torch.Tensor],
        finished: Callable[[list[WorkItem]], None],
        state_views: StateViews,
    ) -> list[tuple[Page, list[WorkItem]]]:
        """fp32 parameters with fp32 state on CPU or CUDA: PyTorch's fused AdamW kernel, one call for the
        segments of each param group and device in the batch, each with its own group's hyperparameters (a
        tensor moved to another group keeps its page, which then holds segments of both groups). The kernel
        allocates nothing, so each call updates its segments whole; they are ``finished`` before the next call.
        The pages are those :meth:`takes_pages_fast` took; each tensor takes the kernel or not by its own dtypes, so that
        an fp32 parameter gets torch's result whatever shares its page: a page's work items of other dtypes are left
        to the rule kernels, with the page."""
        calls: dict[tuple[int, torch.device], list[tuple[WorkItem, torch.Tensor, torch.Tensor]]] = defaultdict(list)
        left = []
        for page, work in batch:
            device = page.device[0].device
            others = []
            for item in work:
                segment, param, grad, _, group = item
                if param.dtype == torch.float32 and grad.dtype == torch.float32:
                    (exp_avg,), (exp_avg_sq,) = state_views(page, segment)
                    calls[id(group), device].append((item, exp_avg, exp_avg_sq))
                else:
                    others.append(item)
            if others:
                left.append((page, others))
        for entries in calls.values():
            items = [item for item, _, _ in entries]
            group = items[0][4]
            beta1, beta2 = group["betas"]
            adamw_update_multi_(
                [param for _, param, _, _, _ in items],
                [grad for _, _, grad, _, _ in items],
                [exp_avg for _, exp_avg, _ in entries],
                [exp_avg_sq for _, _, exp_avg_sq in entries],
                [step_tensors[param.device, step] for _, param, _, step, _ in items],
                lr=float(group["lr"]),
                weight_decay=group["weight_decay"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
            )
            finished(items)
        return left


class PagedAdamW(_PagedAdamWBase):
    """AdamW (``torch.optim.AdamW``'s update and defaults) with fp32 moments in pages under a device budget.

    Args:
        params: parameters or param groups (each group may set its own ``lr``, ``betas``, ``eps`` and
            ``weight_decay``).
        lr: learning rate :math:`\\gamma`.
        betas: :math:`(\\beta_1, \\beta_2)`, each in [0, 1).
        eps: :math:`\\epsilon` >= 0, added to the denominator.
        weight_decay: decoupled weight decay :math:`\\lambda` >= 0.
        amsgrad, maximize, foreach, capturable, differentiable, fused: ``torch.optim.AdamW``'s, so that a call written
            for it runs: ``foreach`` and ``fused`` (which of its implementations) are ignored, the others must be off.
        page_size, device_budget, prefetch, compiled: paging settings, see :class:`PagedOptimizer`.
        bf16_stochastic_round: round bf16 parameters' updated values to bf16 stochastically instead of to nearest,
            so that updates below half a bf16 spacing are kept in expectation (no effect on other dtypes).
        stochastic_round_seed: seed of the rounding bits, an integer in [0, 2**64); saved in the param groups.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        page_size: int | str = DEFAULT_PAGE_SIZE,
        device_budget: int | str | None = None,
        prefetch: int = 2,
        compiled: bool | None = None,
        bf16_stochastic_round: bool = False,
        stochastic_round_seed: int = 0,
    ) -> None:
        check_torch_options(type(self).__name__, amsgrad, maximize, foreach, capturable, differentiable, fused)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        defaults.update(rounding_defaults(bf16_stochastic_round, stochastic_round_seed))
        super().__init__(
            params, defaults, page_size=page_size, device_budget=device_budget, prefetch=prefetch, compiled=compiled
        )


class PagedAdamW8bit(_PagedAdamWBase):
    """AdamW with blockwise 8-bit moments (2.03 bytes per parameter) in pages under a device budget.

    Tensors with fewer than ``min_8bit_size`` elements keep fp32 moments.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable, differentiable, fused: as
            :class:`PagedAdamW`.
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
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
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
        check_torch_options(type(self).__name__, amsgrad, maximize, foreach, capturable, differentiable, fused)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
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


class PagedAdamW4bit(_PagedAdamWBase):
    """AdamW with blockwise 4-bit moments (1.06 bytes per parameter) in pages under a device budget.

    The first moment uses a signed quadratic map with zero, the second a zero-excluding quartic map, each
    with one fp32 scale per block (see :class:`~hf_paged.codecs.Blockwise4bitCodec`), or with
    ``normalization="rank1"`` each element of a 2-D tensor by its row's and column's largest magnitude (see
    :class:`~hf_paged.codecs.Rank1Normalized4bitCodec`), which follows fp32 AdamW more closely. Tensors with fewer
    than ``min_4bit_size`` elements keep fp32 moments, and those whose rows are shorter than a block (LoRA's ``B``
    matrices, ``out x r``) blockwise 8-bit ones (2.06 bytes per parameter, as :class:`PagedAdamW8bit` with blocks of
    ``block_size``): 4-bit state for them trained LoRA measurably faster than fp32 AdamW (README.md, Fidelity).
    ``short_rows="4bit"`` or a param group naming ``"state_format": "4bit"`` keeps them 4-bit, as do pages too small
    for a block of 8-bit state.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable, differentiable, fused: as
            :class:`PagedAdamW`.
        block_size: elements per quantization block (one fp32 scale each), a power of two from 16 to 4096.
        min_4bit_size: tensors with fewer elements keep fp32 state.
        normalization: ``"block"`` (one scale per block) or ``"rank1"`` (rank-1 statistics for 2-D tensors whose
            statistics take no more memory than block scales, block scales for the others).
        short_rows: the state format of tensors whose rows are shorter than a block: ``"8bit"`` (blockwise 8-bit
            moments with blocks of ``block_size``) or ``"4bit"``.
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
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        block_size: int = 128,
        min_4bit_size: int = 4096,
        normalization: str = "block",
        short_rows: str = "8bit",
        page_size: int | str = DEFAULT_PAGE_SIZE,
        device_budget: int | str | None = None,
        prefetch: int = 2,
        compiled: bool | None = None,
        bf16_stochastic_round: bool = False,
        stochastic_round_seed: int = 0,
        fp32_state_modules: Iterable[torch.nn.Module] = (),
    ) -> None:
        check_torch_options(type(self).__name__, amsgrad, maximize, foreach, capturable, differentiable, fused)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        defaults.update(rounding_defaults(bf16_stochastic_round, stochastic_round_seed))
        super().__init__(
            params,
            defaults,
            page_size=page_size,
            device_budget=device_budget,
            prefetch=prefetch,
            four_bit=True,
            block_size=block_size,
            min_4bit_size=min_4bit_size,
            normalization=normalization,
            short_rows=short_rows,
            compiled=compiled,
            fp32_state_modules=fp32_state_modules,
        )
