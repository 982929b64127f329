"""The update rules: one optimizer step of fp32 tensors in place, written in PyTorch operations.

The kernels of every family (PyTorch, host, Triton) compute these formulas; the optimizers in
:mod:`hf_paged.optim` choose a rule and the scalars it reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..rounding import ieee_sqrt

UpdateRule = Callable[..., None]
"""An update rule: ``rule(param, grad, *states, **scalars)`` updating fp32 tensors in place."""


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    decay: float,
    avg_weight: float,
    beta2: float,
    sq_weight: float,
    eps: float,
    step_size: float,
    inv_bias_correction2_sqrt: float,
) -> None:
    """One AdamW update of fp32 tensors in place; the scalars come from :func:`adamw_scalars`.

    Scalars enter only tensor arithmetic, so that ``torch.compile`` keeps them symbolic. The parameter is
    written once, at the end, so that a compiled kernel updates it in the same pass as the state.
    """
    adamw_moments_(grad, exp_avg, exp_avg_sq, avg_weight=avg_weight, beta2=beta2, sq_weight=sq_weight)
    denom = (ieee_sqrt(exp_avg_sq) * inv_bias_correction2_sqrt).add_(eps)
    param.mul_(decay).sub_(exp_avg / denom * step_size)


def adamw_moments_(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    avg_weight: float,
    beta2: float,
    sq_weight: float,
    **unused: float,
) -> None:
    """The moments' part of :func:`adamw_update_`, the same operations: ``exp_avg`` and ``exp_avg_sq`` of fp32
    tensors updated in place (what a step must know of the new state before it encodes it, see
    :class:`~hf_paged.codecs.Rank1Statistics`); takes every scalar of :func:`adamw_scalars` and uses three. The
    squared gradient is weighted first, ``(g (1 - beta2)) g`` as torch's AdamW rounds it, so that it overflows fp32
    where torch's does (|g| above ``sqrt(3.4e38 / (1 - beta2))``, 5.8e20 with beta2 0.999)."""
    exp_avg.lerp_(grad, avg_weight)
    exp_avg_sq.mul_(beta2).add_(grad * sq_weight * grad)


def adamw_scalars(group: dict[str, Any], step: float) -> dict[str, float]:
    """The scalar arguments of :func:`adamw_update_` for ``group``'s hyperparameters at ``step``.

    ``decay`` is :math:`1 - \\gamma \\lambda`, ``avg_weight`` and ``sq_weight`` are :math:`1 - \\beta_1` and
    :math:`1 - \\beta_2`, ``step_size`` is :math:`\\gamma / (1 - \\beta_1^t)`.
    """
    lr = float(group["lr"])
    beta1, beta2 = group["betas"]
    return {
        "decay": 1 - lr * group["weight_decay"],
        "avg_weight": 1 - beta1,
        "beta2": beta2,
        "sq_weight": 1 - beta2,
        "eps": group["eps"],
        "step_size": lr / (1 - beta1**step),
        "inv_bias_correction2_sqrt": 1 / math.sqrt(1 - beta2**step),
    }


def adamw_update_multi_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """:func:`adamw_update_` on lists of fp32 tensors in one call of PyTorch's fused AdamW kernel.

    ``steps`` are the step counts (fp32 scalar tensors on the tensors' device) after this update.
    """
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


ADEMAMIX_SCALAR_NAMES = (
    "beta1",
    "avg_weight",
    "beta3",
    "slow_weight",
    "beta2",
    "sq_weight",
    "eps",
    "bias_correction1",
    "bias_correction2_sqrt",
    "alpha",
    "weight_decay",
    "neg_lr",
)
"""The scalars of :func:`ademamix_update_`, in the order the host and Triton kernels take them."""


def ademamix_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_slow: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    beta1: float,
    avg_weight: float,
    beta3: float,
    slow_weight: float,
    beta2: float,
    sq_weight: float,
    eps: float,
    bias_correction1: float,
    bias_correction2_sqrt: float,
    alpha: float,
    weight_decay: float,
    neg_lr: float,
) -> None:
    """One AdEMAMix update of fp32 tensors in place; the scalars come from :func:`ademamix_scalars`.

    The operations and their order are those of bitsandbytes' reference (``_ReferenceAdEMAMix``): each moving
    average is ``m beta + g (1 - beta)`` rounded as ATen's ``add(alpha=)`` and ``addcmul`` round it (one fused
    multiply-add where the CPU has one), the bias corrections divide, and the decoupled weight decay joins the update
    before the learning rate scales it: ``theta + (-lr) (u + lambda theta)``.
    """
    _add_scaled_(exp_avg.mul_(beta1), grad, avg_weight)
    _add_scaled_(exp_avg_slow.mul_(beta3), grad, slow_weight)
    exp_avg_sq.mul_(beta2).addcmul_(grad * sq_weight, grad)
    denom = (ieee_sqrt(exp_avg_sq) / bias_correction2_sqrt).add_(eps)
    update = (exp_avg / bias_correction1 + exp_avg_slow * alpha) / denom
    param.add_(_add_scaled_(update, param, weight_decay).mul_(neg_lr))


def _add_scaled_(target: torch.Tensor, tensor: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """``target + weight * tensor`` in place, as ATen's ``add(tensor, alpha=weight)`` rounds it (once where the CPU
    has fused multiply-adds). A compiled kernel's scalars are 0-d tensors, which ``alpha`` does not take: it
    multiplies first (compiled kernels follow the eager ones within rounding)."""
    if isinstance(weight, torch.Tensor):
        return target.add_(tensor * weight)
    return target.add_(tensor, alpha=weight)


def ademamix_alpha(alpha: float, t_alpha: int | None, step: float) -> float:
    """The weight of the slow average at ``step``: ``alpha`` warmed up linearly over ``t_alpha`` steps (the paper's
    scheduler), or ``alpha`` from the start where ``t_alpha`` is ``None``."""
    if t_alpha is None:
        return alpha
    return min(step * alpha / t_alpha, alpha)


def ademamix_beta3(beta1: float, beta3: float, t_beta3: int | None, step: float) -> float:
    """The slow average's decay at ``step``: from ``beta1`` to ``beta3`` over ``t_beta3`` steps so that its half-life
    grows linearly (the paper's scheduler, ``exp(ln b1 ln b3 / ((1 - t/T) ln b3 + (t/T) ln b1))``, at most
    ``beta3``), or ``beta3`` from the start where ``t_beta3`` is ``None``. Needs ``beta1`` and ``beta3`` in (0, 1)
    with a scheduler."""
    if t_beta3 is None:
        return beta3
    log_beta1, log_beta3 = math.log(beta1), math.log(beta3)
    fraction = step / t_beta3
    return min(math.exp(log_beta1 * log_beta3 / ((1 - fraction) * log_beta3 + fraction * log_beta1)), beta3)


def ademamix_scalars(group: dict[str, Any], step: float) -> dict[str, float]:
    """The scalar arguments of :func:`ademamix_update_` for ``group``'s hyperparameters at ``step`` (alpha and beta3
    as their schedulers give them, :func:`ademamix_alpha` and :func:`ademamix_beta3`).

    ``avg_weight``, ``slow_weight`` and ``sq_weight`` are :math:`1 - \\beta_1`, :math:`1 - \\beta_3(t)` and
    :math:`1 - \\beta_2`; ``bias_correction1`` is :math:`1 - \\beta_1^t`, ``bias_correction2_sqrt``
    :math:`\\sqrt{1 - \\beta_2^t}`; ``neg_lr`` is :math:`-\\gamma`.
    """
    lr = float(group["lr"])
    beta1, beta2, beta3 = group["betas"]
    beta3 = ademamix_beta3(beta1, beta3, group["t_beta3"], step)
    return {
        "beta1": beta1,
        "avg_weight": 1 - beta1,
        "beta3": beta3,
        "slow_weight": 1 - beta3,
        "beta2": beta2,
        "sq_weight": 1 - beta2,
        "eps": group["eps"],
        "bias_correction1": 1 - beta1**step,
        "bias_correction2_sqrt": (1 - beta2**step) ** 0.5,
        "alpha": ademamix_alpha(group["alpha"], group["t_alpha"], step),
        "weight_decay": group["weight_decay"],
        "neg_lr": -lr,
    }


def lion_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    decay: float,
    direction_weight: float,
    avg_weight: float,
) -> None:
    """One Lion update of fp32 tensors in place; ``decay`` is :math:`1 - \\gamma \\lambda`,
    ``direction_weight`` and ``avg_weight`` are :math:`1 - \\beta_1` and :math:`1 - \\beta_2`. A NaN momentum (from
    a NaN gradient) moves nothing (``sign(nan)`` is 0); a NaN or infinite momentum (from a NaN or infinite gradient) is
    stored as zero, whatever the state's format, so that its parameter element moves with its gradients again at the
    next step (an infinite one would give a NaN direction, inf - inf, and a blockwise state would keep it as its
    block's largest code)."""
    direction = exp_avg.lerp(grad, direction_weight).sign_()
    param.mul_(decay).sub_(direction * lr)
    exp_avg.lerp_(grad, avg_weight).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
