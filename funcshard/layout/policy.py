"""Mixed-precision policy: a frozen, hashable value, never a pytree leaf.

Every buffer's dtype is a function of the policy and the parameter's own (model) dtype ``m``.
With ``c`` the compute dtype, the promotion table is::

    compute params  c = param_dtype        if set, else m
    master params   p = main_params_dtype  if set, else c   (None: the compute params are master)
    main grads      g = main_grads_dtype   if set, else c   (accumulation over microbatches)
    wire dtype      w = grad_comm_dtype    if set, else g   (reduce-scatter / all-reduce)
    param wire          param_comm_dtype   if set, else c   (the params' all-gathers)
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
the accumulator exactly once per microbatch, then cast to ``p`` for the optimizer step. A ``w``
narrower than ``g`` (or 8-bit) is the wire only: each rank's contribution is rounded to it once
and the sum over ranks runs in fp32 (:mod:`funcshard.comm.wires`); ``w == g`` keeps the ring
collectives of ``w``. Both wires also take the 8-bit blockwise formats ``torch.int8`` and
``torch.float8_e4m3fn`` (one fp32 scale per block of at most 256 elements of a row).
"""

from __future__ import annotations

import dataclasses
import platform

import torch

__all__ = ["MixedPrecisionPolicy", "LeafDtypes", "native_bf16", "native_bf16_reason"]

# CPU flags (/proc/cpuinfo) under which oneDNN runs bf16 matmuls natively; without them torch
# emulates bf16 on the CPU, several times slower than fp32.
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (AVX-512 / AMX), aarch64 (Features)


def _cpuinfo() -> str | None:
    """The text of ``/proc/cpuinfo``, or None where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return None


def native_bf16_reason(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Whether ``device`` computes bf16 natively, and why (one line for a log).

    CUDA: compute capability 8.0 or newer (Ampere on). CPU: ``/proc/cpuinfo`` lists
    ``avx512_bf16`` or ``amx_bf16`` (x86) or ``bf16`` (aarch64); without ``/proc/cpuinfo``
    (not Linux) the answer is False.
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if major >= 8:
            return True, f"CUDA device {name} (sm_{major}{minor}) has native bf16"
        return False, f"CUDA device {name} (sm_{major}{minor}) predates native bf16 (sm_80)"
    if device.type != "cpu":
        return False, f"no native bf16 check for device type {device.type!r}"
    text = _cpuinfo()
    if text is None:
        return False, f"no /proc/cpuinfo on {platform.system()}: assuming bf16 is emulated"
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    found = [f for f in _BF16_CPU_FLAGS if f in flags]
    if found:
        return True, f"CPU flags include {', '.join(found)}"
    return False, (
        "CPU flags lack avx512_bf16 / amx_bf16 (capability "
        f"{torch.backends.cpu.get_cpu_capability()}): bf16 matmuls are emulated"
    )


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """True when ``device`` computes bf16 natively (see :func:`native_bf16_reason`)."""
    return native_bf16_reason(device)[0]


_FLOATING = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_WIRES = (*_FLOATING, torch.int8, torch.float8_e4m3fn)  # the comm dtypes: 8-bit blockwise too


def _check_dtype(field: str, value: torch.dtype | None, allowed: tuple = _FLOATING) -> None:
    if value is not None and value not in allowed:
        raise TypeError(
            f"MixedPrecisionPolicy.{field}: expected None or one of "
            f"{[str(d) for d in allowed]}, got {value!r}"
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
        Narrower than main grads (or 8-bit): the wire only, the sum runs in fp32.
      loss_scale_init: initial dynamic loss scale, used only when the compute dtype is fp16.
      loss_scale_growth_interval: finite steps after which the fp16 loss scale doubles.
      param_comm_dtype: dtype of the params on the all-gather wire (ZeRO-3's gathers, ZeRO 0-2's
        compute copies, HFSDP's gather over "replicate", which moves each master encoded
        once); None = the compute dtype. Decoded to the compute dtype on arrival;
        the masters and the optimizer never see it.
    """

    param_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = torch.float32
    grad_comm_dtype: torch.dtype | None = None
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    param_comm_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "main_params_dtype", "main_grads_dtype"):
            _check_dtype(field, getattr(self, field))
        for field in ("grad_comm_dtype", "param_comm_dtype"):
            _check_dtype(field, getattr(self, field), _WIRES)
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
