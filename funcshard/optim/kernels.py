"""A one-pass CPU kernel for steps with moments stored narrow (``mu_dtype`` / ``nu_dtype``).

torch's fused kernels take one dtype, so the torch path of a narrow step (``fused._chunked``)
decodes a chunk into fp32 scratch, runs the fused fp32 kernel and encodes it back: several
passes and many torch ops per chunk. ``_kernels.c`` loads, decodes, steps and encodes eight
elements at a time in one loop (8-bit moments: a block into an L1 scratch, encoded while the
next block steps), with the same bits as the torch path: tests/test_kernels.py compares the
two on random, edge and near-tie inputs, and a check at load compares the fp32 step with
torch's fused kernels (their FMAs are those the compiler of torch's build chose).

torch.sqrt, which the torch path's 8-bit encode calls, is MKL's vmsSqrt: within 1 ulp of
IEEE's sqrt but not it. The kernel rounds a fast root and calls that vmsSqrt (from
libtorch_cpu, checked at load) for the codes next to a rounding tie; without it (no MKL in this
torch), 8-bit buffers take the torch path.

The build rule: on first use, ``_kernels.c`` is compiled with the system C compiler (``$CC``,
else ``cc``; plain C, no torch headers: about a second) into ``$FUNCSHARD_CACHE_DIR``
(default ``~/.cache/funcshard``), under a name keyed by a hash of the source, the flags, the
compiler and the CPU (model and flags), written to a temporary name and renamed into place, so
ranks starting together never load a half-written library. The kernel is used when:

* ``$FUNCSHARD_KERNELS`` is not ``0`` (and :data:`enabled` is true);
* the tensors are on the CPU (CUDA always takes the torch path), contiguous, the param fp32 /
  bf16 / fp16, the moments stored fp32, bf16, fp16, int8 or uint8;
* the CPU is x86-64 with AVX2, FMA and F16C and torch's CPU capability is AVX2 or AVX512;
* the library builds and passes the load check. If there is no compiler, the build fails or
  the check finds a difference, one warning says so and every step takes the torch path
  (the same bits, slower); never an error.

Threads: ``torch.get_num_threads()`` threads, each a range of whole tiles of 512 elements (8-bit
blocks never straddle two threads); the result does not depend on the count (elementwise).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from funcshard.optim.moments import MomentFormat

__all__ = ["Args", "adamw_args", "sgd_args", "step", "available", "enabled", "library"]

SWITCH_ENV = "FUNCSHARD_KERNELS"
CACHE_ENV = "FUNCSHARD_CACHE_DIR"
SOURCE = Path(__file__).with_name("_kernels.c")
# -ffp-contract=off: an FMA exactly where the source writes fmaf (torch's bits), none added.
# -fno-math-errno lets sqrtf vectorize (it changes no value).
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-math-errno")
ISA = ("-mavx2", "-mfma", "-mf16c")
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")
# torch.sqrt on the CPU calls MKL's vmsSqrt in this mode (ATen/cpu/vml.h: VML_HA |
# VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE); it is not IEEE's sqrt, and the 8-bit encode needs its bits.
VML_MODE = 0x2 | 0x140000 | 0x100
BUILD_TIMEOUT_S = 300

enabled: bool = os.environ.get(SWITCH_ENV, "1") != "0"
compiler: str = os.environ.get("CC") or "cc"

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.uint8: 4}
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ADAMW, _SGD = 0, 1
_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None  # None: not tried; False: unavailable
_eight_bit = False  # the library has torch's sqrt, so it may encode 8-bit moments


class Args(ctypes.Structure):
    """The step's scalars, as ``fs_args`` in ``_kernels.c``."""

    _fields_ = [
        ("rule", ctypes.c_int32),
        ("param_dtype", ctypes.c_int32),
        ("moments", ctypes.c_int32),
        ("fmt", ctypes.c_int32 * 2),
        ("block", ctypes.c_int32 * 2),
        ("stochastic", ctypes.c_int32 * 2),
        ("scaled", ctypes.c_int32),
        ("write_grad", ctypes.c_int32),
        ("decay", ctypes.c_int32),
        ("lerp_small", ctypes.c_int32),
        ("nesterov", ctypes.c_int32),
        ("inv_scale", ctypes.c_float),
        ("decay_factor", ctypes.c_float),
        ("lerp_weight", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("neg_step_size", ctypes.c_float),
        ("momentum", ctypes.c_float),
        ("neg_lr", ctypes.c_float),
    ]


def _f32(x: float) -> float:
    return ctypes.c_float(x).value


def _scaled(args: Args, grad_scale: float) -> Args:
    if grad_scale != 1.0:  # Scalars.grad_scale_arg: the kernels divide by fp32(1 / grad_scale)
        args.scaled, args.inv_scale = 1, 1.0 / grad_scale
    return args


def adamw_args(
    count: int, lr: float, beta1: float, beta2: float, eps: float, wd: float, grad_scale: float
) -> Args:
    """The scalars of torch's fused AdamW at step ``count + 1``, computed as it does (double
    precision, then fp32)."""
    step = _f32(float(count + 1))  # the kernel reads the step from an fp32 tensor
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    weight = _f32(1 - beta1)
    small = abs(weight) < 0.5
    args = Args(
        rule=_ADAMW,
        moments=2,
        decay=int(wd != 0),
        lerp_small=int(small),
        decay_factor=1 - lr * wd,
        lerp_weight=weight if small else weight - 1.0,  # exact in fp32 (Sterbenz)
        beta2=beta2,
        one_minus_beta2=1 - beta2,
        bc2_sqrt=math.sqrt(bias2),  # std::sqrt, not pow(x, 0.5)
        eps=eps,
        neg_step_size=-(lr / bias1),
    )
    return _scaled(args, grad_scale)


def sgd_args(lr: float, momentum: float, wd: float, nesterov: bool, grad_scale: float) -> Args:
    """The scalars of torch's fused SGD (dampening 0, momentum > 0, not the first step)."""
    args = Args(
        rule=_SGD,
        moments=1,
        decay=int(wd != 0),
        nesterov=int(nesterov),
        decay_factor=wd,
        momentum=momentum,
        neg_lr=-lr,
    )
    return _scaled(args, grad_scale)


# --- the build ----------------------------------------------------------------------------------
def _cpu() -> str:
    """The CPU's model and flags (the first processor of /proc/cpuinfo), for the cache key."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(keep[:2])


def _cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform != "linux":
        return False
    flags = next((ln for ln in _cpu().splitlines() if ln.startswith("flags")), "").split()
    capability = torch.backends.cpu.get_cpu_capability()
    return all(f in flags for f in NEEDED_CPU_FLAGS) and capability in ("AVX2", "AVX512")


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "funcshard")


def _build() -> Path:
    """The compiled library's path, compiling it first if the cache has no copy."""
    source = SOURCE.read_bytes()
    cmd = [compiler, *FLAGS, *ISA]
    key = hashlib.sha256(b"\0".join([source, " ".join(cmd).encode(), _cpu().encode()]))
    target = cache_dir() / f"kernels-{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [*cmd, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: another rank sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it is unavailable (warned once)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib or None


def _load() -> ctypes.CDLL | bool:
    if not _cpu_supported():
        return False  # not an error: the torch path is this machine's reference
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(
            f"funcshard: the CPU optimizer kernel did not build ({e}); narrow-moment steps "
            f"take torch's fused kernels (the same bits, slower). Set {SWITCH_ENV}=0 to skip "
            "the build.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    lib.fs_step.restype = ctypes.c_int
    lib.fs_step.argtypes = [
        ctypes.POINTER(Args),
        *[ctypes.c_void_p] * 6,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    lib.fs_set_sqrt.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    global _eight_bit
    sqrt = _torch_sqrt()
    lib.fs_set_sqrt(sqrt, VML_MODE)
    _eight_bit = sqrt is not None
    problem = _self_check(lib)
    if problem:
        warnings.warn(
            f"funcshard: the CPU optimizer kernel does not reproduce this torch's fused kernels "
            f"({problem}); narrow-moment steps take torch's fused kernels.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return lib


# Hyperparameters of the self-check: both lerp branches, decay on and off, grad_scale on and off.
_CHECK_ADAMW = [
    {"count": 3, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "wd": 0.1, "scale": 1.0},
    {"count": 0, "lr": 3e-2, "beta1": 0.3, "beta2": 0.95, "eps": 1e-6, "wd": 0.0, "scale": 1024.0},
]
_CHECK_SGD = [
    {"lr": 0.1, "momentum": 0.9, "wd": 0.0, "nesterov": False, "scale": 1.0},
    {"lr": 0.05, "momentum": 0.95, "wd": 0.01, "nesterov": True, "scale": 8.0},
]


def _self_check(lib: ctypes.CDLL) -> str | None:
    """None if the kernel's fp32 step equals torch's fused AdamW and SGD bit for bit on random
    inputs, else what differs. The kernel mirrors the FMAs that the compiler of torch's build
    put in, so another build may differ; a few thousand elements, about a millisecond."""
    gen = torch.Generator().manual_seed(0)
    n = 4096  # a multiple of the vector width: torch's vector body only, as in the torch path
    fp32 = MomentFormat(torch.float32)

    def data() -> list[torch.Tensor]:
        g = torch.randn(n, generator=gen) * torch.logspace(-6, 3, n)
        m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
        return [torch.randn(n, generator=gen), g, m, v]

    def scale_arg(h: dict) -> torch.Tensor | None:
        return None if h["scale"] == 1.0 else torch.tensor(1.0 / h["scale"], dtype=torch.float32)

    cases = []
    for h in _CHECK_ADAMW:
        theirs = data()
        p, g, m, v = theirs
        torch._fused_adamw_(
            [p], [g], [m], [v], [], [torch.tensor(float(h["count"] + 1))], amsgrad=False,
            lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], weight_decay=h["wd"], eps=h["eps"],
            maximize=False, grad_scale=scale_arg(h), found_inf=None,
        )  # fmt: skip
        args = adamw_args(
            h["count"], h["lr"], h["beta1"], h["beta2"], h["eps"], h["wd"], h["scale"]
        )
        cases.append(("adamw", args, theirs))
    for h in _CHECK_SGD:
        theirs = data()[:3]
        p, g, m = theirs
        torch._fused_sgd_(
            [p], [g], [m], weight_decay=h["wd"], momentum=h["momentum"], lr=h["lr"],
            dampening=0.0, nesterov=h["nesterov"], maximize=False, is_first_step=False,
            grad_scale=scale_arg(h), found_inf=None,
        )  # fmt: skip
        args = sgd_args(h["lr"], h["momentum"], h["wd"], h["nesterov"], h["scale"])
        cases.append(("sgd", args, theirs))
    gen.manual_seed(0)
    for name, args, theirs in cases:
        ours = data()[: len(theirs)]
        _call(lib, args, ours[0], ours[1], [(fp32, t, None) for t in ours[2:]])
        for what, a, b in zip(("param", "grad", "mu", "nu"), ours, theirs, strict=False):
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                return f"{name}: {int((a != b).sum())} of {n} {what} elements differ"
    return None


def _torch_sqrt() -> int | None:
    """The address of the vmsSqrt that torch.sqrt runs on fp32 CPU tensors, or None (then
    8-bit moments take the torch path): found in libtorch_cpu, checked against torch.sqrt, and
    within 1 ulp of IEEE's sqrt (the kernel's encode assumes it), on random values and on
    values whose roots lie next to the half integers where the 8-bit codes round."""
    try:
        fn = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).vmsSqrt
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    halves = (torch.arange(256.0) + 0.5).square().view(torch.int32)
    near = (halves.unsqueeze(1) + torch.arange(-8, 9, dtype=torch.int32)).view(torch.float32)
    spread = torch.rand(4096, generator=torch.Generator().manual_seed(0))
    x = torch.cat([near.flatten(), spread * 65025.0, spread * 4.3e9])
    out = torch.empty_like(x)
    fn(x.numel(), x.data_ptr(), out.data_ptr(), VML_MODE)
    ieee = x.double().sqrt().float()
    ulps = (out.view(torch.int32) - ieee.view(torch.int32)).abs().max().item()
    if not torch.equal(out, x.sqrt()) or ulps > 1:
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


def available() -> bool:
    """Whether steps may take the kernel (switched on, and it built on this CPU)."""
    return enabled and library() is not None


def reset() -> None:
    """Forgets the loaded library (tests: a new compiler or cache directory)."""
    global _lib
    with _lock:
        _lib = None


# --- a step -------------------------------------------------------------------------------------
def _fits(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.is_contiguous())


def step(
    args: Args,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[tuple[MomentFormat, torch.Tensor, torch.Tensor | None]],
) -> bool:
    """Steps one buffer in place with the kernel; False (nothing done) where it does not apply.

    Args:
      args: :func:`adamw_args` / :func:`sgd_args` of this buffer.
      param, grad: the flat buffer and its gradient (the param's dtype; the grad holds the
        scaled gradient afterwards, as with torch's kernels, when the param is fp32).
      states: per moment its format, stored values and (8-bit) scales, updated in place.
    """
    if not enabled or param.dtype not in _PARAM_DTYPES or grad.dtype != param.dtype:
        return False
    if not all(_fits(t) for t in (param, grad, *[x for _, v, s in states for x in (v, s)])):
        return False
    if any(
        f.dtype not in _CODES or v.dtype != f.dtype or (s is not None and s.dtype != torch.float32)
        for f, v, s in states
    ):
        return False
    if any(f.quantized and not _kernel_block(f.block) for f, _, _ in states):
        return False  # the kernel encodes 32 elements at a time, a block in an L1 scratch
    lib = library()
    if lib is None or (not _eight_bit and any(f.quantized for f, _, _ in states)):
        return False
    _call(lib, args, param, grad, states)
    return True


def _kernel_block(block) -> bool:
    """Whether the kernel takes 8-bit blocks of ``block``: a multiple of 32 up to 256 (its
    tiles hold whole blocks); others (a ragged block, a row of 100) take the torch path."""
    return isinstance(block, int) and block % 32 == 0 and block <= 256


def _call(lib: ctypes.CDLL, args: Args, param: torch.Tensor, grad: torch.Tensor, states) -> None:
    args.param_dtype = _CODES[param.dtype]
    args.write_grad = int(args.scaled and param.dtype == torch.float32)
    ptrs = [None] * 4
    for k, (fmt, values, scales) in enumerate(states):
        args.fmt[k] = _CODES[fmt.dtype]
        args.block[k] = fmt.block or 0
        args.stochastic[k] = int(fmt.stochastic)
        ptrs[2 * k] = values.data_ptr()
        ptrs[2 * k + 1] = None if scales is None else scales.data_ptr()
    n = param.numel()
    if n:
        lib.fs_step(
            ctypes.byref(args),
            param.data_ptr(),
            grad.data_ptr(),
            *ptrs,
            n,
            torch.get_num_threads(),
        )
