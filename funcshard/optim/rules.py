"""``sgd`` and ``adamw``: torch.optim's exact rules as pure optimizers on torch's fused kernels.

Each is a :class:`funcshard.optim.spec.Spec` (its moment fields, where weight decay applies)
with a :class:`funcshard.optim.fused.Fused` step (torch's kernel, the one-pass CPU kernel's
scalars). ``init(params)`` is numerically inert (zeros, count 0: no synthetic step, no weight
decay). Leaves are grouped by (device, dtype, rule) and each group is stepped by ONE fused
kernel call over lists of tensors. With ``donate=True`` the input params, state and gradient
buffers are updated in place and returned (the caller must treat them as consumed); otherwise
the inputs are left untouched.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from funcshard.optim import kernels
from funcshard.optim.base import Mask, Optimizer, PyTree, Schedule, not_negative
from funcshard.optim.fused import Fused, fused_step, in_fp32
from funcshard.optim.moments import NARROW
from funcshard.optim.spec import Moments, Spec, build, check_stochastic

__all__ = ["SgdState", "AdamWState", "sgd", "adamw"]


class SgdState(NamedTuple):
    count: int
    momentum: PyTree  # None when momentum == 0, as torch keeps no buffer then
    momentum_scale: PyTree = None  # mu_dtype=torch.int8: the blocks' fp32 scales


class AdamWState(NamedTuple):
    count: int
    mu: PyTree
    nu: PyTree
    mu_scale: PyTree = None  # mu_dtype=torch.int8: the blocks' fp32 scales (BlockScales)
    nu_scale: PyTree = None  # nu_dtype=torch.uint8: likewise


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    mask: Mask = None,
    *,
    mu_dtype: torch.dtype | None = None,
    stochastic_rounding: bool = False,
) -> Optimizer:
    """torch.optim.SGD's rule (dampening 0) as a pure optimizer.

    Args:
      lr: a float or a schedule ``step -> float`` (step = updates done before this one).
      momentum: torch's momentum (a buffer is kept only when > 0).
      weight_decay: L2 penalty added to the gradient, where ``mask`` says so.
      nesterov: Nesterov momentum, as ``torch.optim.SGD(nesterov=True)``.
      mask: which parameters decay: None (all), ``(name, shape) -> bool`` or ``{name: bool}``.
      mu_dtype: the dtype the momentum buffer is stored in (as ``adamw``'s ``mu_dtype``).
      stochastic_rounding: a bf16 momentum buffer is rounded stochastically.

    >>> opt = sgd(0.1, momentum=0.9)
    >>> p = {"w": torch.ones(2)}
    >>> p, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
    >>> p["w"].tolist()
    [0.8999999761581421, 0.8999999761581421]
    """
    not_negative("momentum", momentum)
    not_negative("weight_decay", weight_decay)
    if nesterov and momentum <= 0:
        raise ValueError("sgd: nesterov=True needs momentum > 0 (as torch.optim.SGD)")
    mu_rule = Moments(mu_dtype, "sgd mu_dtype", signed=True, stochastic=stochastic_rounding)
    check_stochastic(stochastic_rounding, "sgd", mu_dtype)

    def kernel(s, wd: float, device: torch.device, params, grads, *moments) -> None:
        """torch's fused SGD on one group of same-device buffers (no moment: no momentum)."""
        columns, write_back = [params, grads, *moments], None
        if device.type == "cpu" and params[0].dtype in NARROW:
            columns, write_back = in_fp32(columns)
        torch._fused_sgd_(
            columns[0],
            columns[1],
            columns[2] if moments else [],
            weight_decay=wd,
            momentum=momentum,
            lr=s.lr,
            dampening=0.0,
            nesterov=nesterov,
            maximize=False,
            # zero-initialised buffers make step 1 (buf = g) and later steps one formula
            is_first_step=False,
            grad_scale=s.grad_scale_arg(device),
            found_inf=None,
        )
        if write_back is not None:
            write_back()

    native = lambda s, wd: kernels.sgd_args(s.lr, momentum, wd, nesterov, s.grad_scale)
    return build(
        Spec(
            "sgd",
            lr,
            SgdState,
            {"momentum": mu_rule if momentum > 0 else None},
            fused_step(Fused(kernel, native)),
            weight_decay,
            mask,
        )
    )


def adamw(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Mask = None,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    stochastic_rounding: bool = False,
) -> Optimizer:
    """torch.optim.AdamW's rule as a pure optimizer (fused kernel on CPU and CUDA).

    Args:
      lr: a float or a schedule ``step -> float`` (step = updates done before this one).
      betas, eps: as torch (eps added after the square root, bias correction).
      weight_decay: decoupled weight decay, where ``mask`` says so.
      mask: which parameters decay: None (all), ``(name, shape) -> bool`` or ``{name: bool}``;
        ``fs.optim.decay_mask`` is nanoGPT's rule (matrices and embeddings only).
      mu_dtype, nu_dtype: the dtype the first / second moment is STORED in; None the master
        dtype (torch's bits). ``torch.bfloat16`` / ``torch.float16``: computed in fp32, stored
        narrow. ``torch.int8`` (mu) / ``torch.uint8`` (nu): 8-bit blockwise with fp32 scales
        (:mod:`funcshard.optim.moments`; parameters :func:`~funcshard.optim.moments.block_of`
        gives no block keep the master dtype). An fp16 second moment flushes values below
        6e-8 (squared gradients under 2.4e-4) to zero: prefer bf16.
      stochastic_rounding: bf16 moments are rounded stochastically (dithered) instead of to
        nearest.

    >>> opt = adamw(0.1)
    >>> p = {"w": torch.zeros(2)}
    >>> p, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
    >>> [round(x, 4) for x in p["w"].tolist()], s.count
    ([-0.1, -0.1], 1)
    """
    beta1, beta2 = betas
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"adamw: betas must lie in [0, 1), got {betas}")
    not_negative("eps", eps)
    not_negative("weight_decay", weight_decay)
    mu_rule = Moments(mu_dtype, "adamw mu_dtype", signed=True, stochastic=stochastic_rounding)
    nu_rule = Moments(nu_dtype, "adamw nu_dtype", signed=False, stochastic=stochastic_rounding)
    check_stochastic(stochastic_rounding, "adamw", mu_dtype, nu_dtype)

    def kernel(s, wd: float, device: torch.device, params, grads, mu, nu) -> None:
        """torch's fused AdamW on one group of same-device buffers."""
        torch._fused_adamw_(
            params,
            grads,
            mu,
            nu,
            [],
            [s.step_tensor(device)] * len(params),
            amsgrad=False,
            lr=s.lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=wd,
            eps=eps,
            maximize=False,
            grad_scale=s.grad_scale_arg(device),
            found_inf=None,
        )

    native = lambda s, wd: kernels.adamw_args(s.count, s.lr, beta1, beta2, eps, wd, s.grad_scale)
    return build(
        Spec(
            "adamw",
            lr,
            AdamWState,
            {"mu": mu_rule, "nu": nu_rule},
            fused_step(Fused(kernel, native)),
            weight_decay,
            mask,
        )
    )
