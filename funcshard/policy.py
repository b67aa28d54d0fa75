"""Mixed-precision policy: a frozen, hashable value, never a pytree leaf.

Every buffer's dtype is a function of the policy and the parameter's own (model) dtype ``m``.
With ``c`` the compute dtype, the promotion table is::

    compute params  c = param_dtype        if set, else m
    master params   p = main_params_dtype  if set, else c   (None: the compute params are master)
    main grads      g = main_grads_dtype   if set, else c   (accumulation over microbatches)
    wire dtype      w = grad_comm_dtype    if set, else g   (reduce-scatter / all-reduce)
    optimizer state     p                                  (moments live beside the master)

Examples (model in fp32 unless noted)::

    param  main_params  main_grads  comm  | compute  master  accumulate  wire
    None   fp32         fp32        None  | fp32     fp32    fp32        fp32
    bf16   fp32         fp32        None  | bf16     fp32    fp32        fp32
    bf16   fp32         fp32        bf16  | bf16     fp32    fp32        bf16
    bf16   None         None        None  | bf16     bf16    bf16        bf16
    bf16   None         fp32        bf16  | bf16     bf16    fp32        bf16
    fp16   fp32         fp32        None  | fp16     fp32    fp32        fp32  (+ loss scaling)
    None   None         None        None  | m        m       m           m     (bf16 model: bf16)

Gradients are cast to ``w`` only on the wire; the reduced result is cast to ``g`` and added to
the accumulator exactly once per microbatch, then cast to ``p`` for the optimizer step.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["MixedPrecisionPolicy", "LeafDtypes"]

_FLOATING = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _check_dtype(field: str, value: torch.dtype | None) -> None:
    if value is not None and value not in _FLOATING:
        raise TypeError(
            f"MixedPrecisionPolicy.{field}: expected None or one of "
            f"{[str(d) for d in _FLOATING]}, got {value!r}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class LeafDtypes:
    """The resolved dtypes of one parameter under a policy (see the module docstring)."""

    model: torch.dtype
    compute: torch.dtype
    master: torch.dtype
    grad: torch.dtype
    comm: torch.dtype


@dataclasses.dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Which dtype each copy of a weight and its gradient lives in.

    Args:
      param_dtype: compute dtype of the gathered params; None keeps the model's dtype.
      main_params_dtype: dtype of the sharded master weights the optimizer updates; None makes
        the compute params the master weights.
      main_grads_dtype: dtype gradients are accumulated and reduced into; None = compute dtype.
      grad_comm_dtype: dtype on the wire for reduce-scatter / all-reduce; None = main grads.
      loss_scale_init: initial dynamic loss scale, used only when the compute dtype is fp16.
      loss_scale_growth_interval: finite steps after which the fp16 loss scale doubles.
    """

    param_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = torch.float32
    grad_comm_dtype: torch.dtype | None = None
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 2000

    def __post_init__(self) -> None:
        for field in ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            _check_dtype(field, getattr(self, field))
        if not self.loss_scale_init > 0:
            raise ValueError(f"loss_scale_init must be > 0, got {self.loss_scale_init}")
        if self.loss_scale_growth_interval < 1:
            raise ValueError(
                f"loss_scale_growth_interval must be >= 1, got {self.loss_scale_growth_interval}"
            )

    def resolve(self, model_dtype: torch.dtype) -> LeafDtypes:
        """Applies the promotion table to a parameter of dtype ``model_dtype``.

        >>> MixedPrecisionPolicy(param_dtype=torch.bfloat16).resolve(torch.float32).compute
        torch.bfloat16
        """
        compute = self.param_dtype or model_dtype
        master = self.main_params_dtype or compute
        grad = self.main_grads_dtype or compute
        comm = self.grad_comm_dtype or grad
        return LeafDtypes(model_dtype, compute, master, grad, comm)
