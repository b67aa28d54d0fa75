"""The one-pass CPU kernel of narrow-moment steps (``funcshard.optim.kernels``).

It must give the torch path's bits (decode, torch's fused fp32 kernel, encode) for every moment
format, rule and option, on any thread count; fall back to the torch path with one warning when
it cannot be built; and build safely when several processes start at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import shutil
import threading
import warnings

import pytest
import torch

import funcshard as fs
from funcshard.optim import kernels

BF16, F16, I8, U8, F32 = torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float32

# 2-D leaves with 8-bit blocks of 64, 32 and 256, leaves that keep fp32 moments under 8-bit
# (1-D, 2700 elements), 8-bit rows that the kernel leaves to the torch path (ragged rows of
# 300: blocks of 256 and 44; rows of 129: one block each), sizes that are not a multiple of
# the vector width or of a tile, and two leaves large enough for 3 threads (a thread takes
# at least 64 tiles of 512 elements), split unevenly.
SHAPES = {
    "a": (75, 64),
    "b": (33, 96),
    "c": (18, 256),
    "d": (400, 256),
    "e": (7,),
    "f": (1000,),
    "h": (9, 300),
    "r": (16, 300),
    "o": (37, 129),
    "k": (100_003,),
}


@pytest.fixture
def native():
    """Skips where the kernel is not meant to run; fails where it should but does not (its
    build failed, or its load check found torch's fused kernels rounding differently)."""
    if not kernels._cpu_supported() or not shutil.which(kernels.compiler):
        pytest.skip("no kernel on this machine (not x86-64 AVX2/FMA/F16C, or no compiler)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback's warning, as an error naming the cause
        assert kernels.available()


def _params(seed: int, dtype: torch.dtype = F32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in SHAPES.items():
        n = math.prod(shape)
        spread = torch.logspace(-6, 1, n)[torch.randperm(n, generator=gen)].view(shape)
        out[name] = (torch.randn(shape, generator=gen) * spread).to(dtype)
    return out


def _grads(seed: int, dtype: torch.dtype = F32) -> dict[str, torch.Tensor]:
    g = _params(1000 + seed, dtype)
    g["a"][3] = 0.0  # all-zero blocks
    g["c"][5] = 1e-40  # denormals
    g["c"][6, :10] = 1e15  # huge (x 1024 grad_scale: g^2 still finite)
    g["c"][7] = -(2.0**-140)  # negative denormals
    g["f"][:100] = 0.0
    g["h"][2, 17:33] = -0.0
    return g


@contextlib.contextmanager
def _kernel(use: bool):
    """The kernel switched on or off (the torch path) for the block, then as it was."""
    before = kernels.enabled
    kernels.enabled = use
    try:
        yield
    finally:
        kernels.enabled = before


def _run(make, use: bool, threads: int, *, scale: float = 1.0, dtype=F32, steps: int = 3):
    """``steps`` donated updates; returns (params, state, grads as the step left them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _kernel(use):
            opt = make()
            p = _params(0, dtype)
            s = opt.init(p)
            seen = []
            for t in range(steps):
                g = _grads(t, dtype)
                p, s = opt.update(g, s, p, donate=True, grad_scale=scale)
                seen.append(g)
            return p, s, seen
    finally:
        torch.set_num_threads(before)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return torch.where(t.isnan(), torch.zeros((), dtype=ints), t.view(ints))  # NaN: any NaN


def _assert_same_bits(want, got) -> None:
    wl, gl = fs.tree.leaves(want), fs.tree.leaves(got)
    assert len(wl) == len(gl)
    for i, (w, g) in enumerate(zip(wl, gl, strict=True)):
        if isinstance(w, torch.Tensor):
            assert w.dtype == g.dtype and w.shape == g.shape, i
            assert w.isnan().equal(g.isnan()) if w.is_floating_point() else True, i
            diff = int((_bits(w) != _bits(g)).sum())
            assert diff == 0, f"leaf {i} ({w.dtype}, {tuple(w.shape)}): {diff} elements differ"
        else:
            assert w == g


def _check(make, *, scale: float = 1.0, dtype=F32, steps: int = 3, threads=(1, 3)) -> None:
    want = _run(make, False, 1, scale=scale, dtype=dtype, steps=steps)
    for n in threads:
        _assert_same_bits(want, _run(make, True, n, scale=scale, dtype=dtype, steps=steps))


ADAMW_FORMATS = [
    (BF16, BF16, False),
    (BF16, BF16, True),
    (F16, BF16, False),
    (F16, F16, False),
    (I8, U8, False),
    (I8, BF16, True),
    (None, U8, False),
    (I8, None, False),
    (F32, F32, False),
]
ADAMW_OPTIONS = [  # lr, betas (lerp weight < 0.5 and >= 0.5), weight decay, grad_scale
    (1e-2, (0.9, 0.999), 0.1, 1.0),
    (3e-3, (0.3, 0.9), 0.0, 1024.0),
    (7e-4, (0.9, 0.95), 0.37, 1 / 3),
]


@pytest.mark.parametrize("mu,nu,sr", ADAMW_FORMATS)
@pytest.mark.parametrize("lr,betas,wd,scale", ADAMW_OPTIONS)
def test_adamw_bits(native, mu, nu, sr, lr, betas, wd, scale) -> None:
    _check(
        lambda: fs.optim.adamw(
            lr, betas, 1e-8, wd, mu_dtype=mu, nu_dtype=nu, stochastic_rounding=sr
        ),
        scale=scale,
    )


@pytest.mark.parametrize("mu,sr", [(BF16, False), (BF16, True), (F16, False), (I8, False)])
@pytest.mark.parametrize(
    "nesterov,wd,scale", [(False, 0.0, 1.0), (True, 0.01, 512.0), (False, 0.3, 1.0)]
)
def test_sgd_bits(native, mu, sr, nesterov, wd, scale) -> None:
    _check(
        lambda: fs.optim.sgd(0.05, 0.9, wd, nesterov, mu_dtype=mu, stochastic_rounding=sr),
        scale=scale,
    )


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_narrow_masters(native, dtype) -> None:
    """Params (the masters) in bf16 / fp16: stepped in fp32, rounded once, as the torch path."""
    _check(lambda: fs.optim.adamw(1e-2, weight_decay=0.1, mu_dtype=I8, nu_dtype=BF16), dtype=dtype)
    _check(lambda: fs.optim.sgd(0.1, 0.9, 0.01, mu_dtype=BF16), dtype=dtype, scale=4.0)


def test_scalars_over_many_hyperparameters(native) -> None:
    """The per-step scalars (bias corrections, 1 - lr * wd, ...) as torch computes them."""
    gen = torch.Generator().manual_seed(7)
    for i in range(24):
        lr = 10 ** (-4 + 3 * torch.rand((), generator=gen).item())
        wd = torch.rand((), generator=gen).item()
        betas = (torch.rand((), generator=gen).item(), 1 - 10 ** (-1 - 3 * (i % 4) / 3))
        make = lambda lr=lr, wd=wd, b=betas: fs.optim.adamw(lr, b, 1e-8, wd, mu_dtype=BF16)  # noqa: E731
        _check(make, steps=1 + i % 3, threads=(1,))


def test_overflow_to_inf(native) -> None:
    """A second moment that overflows to inf (gradients ~1e22): inf scales, same bits."""

    def make():
        return fs.optim.adamw(1e-3, mu_dtype=I8, nu_dtype=U8)

    want = _run(make, False, 1, scale=1e7, steps=1)
    assert want[1].nu_scale["c"].isinf().any()
    _assert_same_bits(want, _run(make, True, 2, scale=1e7, steps=1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_8bit_blocks_with_nan_or_inf(native, bad) -> None:
    """A NaN or an inf gradient in a block: the kernel's vector encode (whose absmax skips
    NaNs) finds the root that is not finite and encodes that block as torch does (NaN or inf
    scale, codes from ``safe = 1`` or a zero factor); the other blocks keep their bits."""

    def make():
        return fs.optim.adamw(1e-3, (0.9, 0.999), weight_decay=0.1, mu_dtype=I8, nu_dtype=U8)

    def run(use: bool):
        with _kernel(use):
            opt, p = make(), _params(0)
            s = opt.init(p)
            for t in range(3):
                g = _grads(t)
                g["d"][5 + t, 7] = bad  # a new block each step; the old ones stay NaN / inf
                g["a"][0, 63] = bad if t == 1 else g["a"][0, 63]
                p, s = opt.update(g, s, p, donate=True)
            return p, s

    want = run(False)
    scales = torch.cat([want[1].mu_scale["d"].flatten(), want[1].nu_scale["d"].flatten()])
    assert not scales.isfinite().all()  # the case is reached
    _assert_same_bits(want, run(True))


def test_8bit_random_blocks_many_seeds(native) -> None:
    """int8 / uint8 moments over many random blocks (magnitudes spread over 12 decades, so
    that codes of every size, and many next to a rounding tie, are met): the torch path's
    bits, step after step."""
    shape = (512, 256)
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        spread = 10.0 ** (-8 + 12 * torch.rand(shape, generator=gen))

        def make():
            return fs.optim.adamw(3e-3, (0.8, 0.99), weight_decay=0.01, mu_dtype=I8, nu_dtype=U8)

        def run(use: bool, seed=seed, spread=spread):
            with _kernel(use):
                g0 = torch.Generator().manual_seed(100 + seed)
                opt, p = make(), {"w": torch.randn(shape, generator=g0)}
                s = opt.init(p)
                for _ in range(3):
                    g = {"w": torch.randn(shape, generator=g0) * spread}
                    p, s = opt.update(g, s, p, donate=True)
                return p, s

        _assert_same_bits(run(False), run(True))


def test_8bit_tiny_blocks(native) -> None:
    """Blocks whose absmax is below 2^-64 (each row of the gradient 10x smaller than the last,
    down to fp32's subnormals, so that mu and nu blocks of every magnitude are met) are coded
    shifted by 2^64 (``moments._shift``): the torch path's bits, decoded and encoded again."""
    shape = (48, 256)

    def make():
        return fs.optim.adamw(3e-3, (0.9, 0.999), weight_decay=0.01, mu_dtype=I8, nu_dtype=U8)

    def run(use: bool):
        with _kernel(use):
            g0 = torch.Generator().manual_seed(7)
            opt, p = make(), {"w": torch.randn(shape, generator=g0)}
            s = opt.init(p)
            rows = torch.logspace(0, -47, shape[0]).unsqueeze(1)
            for _ in range(3):
                g = {"w": torch.randn(shape, generator=g0) * rows}
                p, s = opt.update(g, s, p, donate=True)
            return p, s

    want = run(False)
    for scale in (want[1].mu_scale["w"], want[1].nu_scale["w"]):
        assert ((scale > 0) & (scale < 2.0**-64)).sum() >= 5  # the case is reached
    _assert_same_bits(want, run(True))


def _near_ties(top: float, root: float) -> torch.Tensor:
    """Rows of 256 whose absmax is 1 and whose other elements x make the encode's root of
    x * top land next to each half integer k + 0.5 (``root``: 2 for int8's sqrt, 4 for uint8's
    fourth root), a few ulps to either side: where torch's sqrt (MKL's, not IEEE's) decides."""
    k = torch.arange(int(top ** (1 / root)) + 1, dtype=torch.float64) + 0.5
    centre = (k**root / top).float().view(torch.int32)
    x = (centre.unsqueeze(1) + torch.arange(-12, 13, dtype=torch.int32)).view(torch.float32)
    x = x.flatten()[: (x.numel() // 255) * 255].view(-1, 255).clamp(max=1.0)
    return torch.cat([torch.ones(x.shape[0], 1), x], dim=1)


def test_8bit_codes_next_to_rounding_ties(native, monkeypatch) -> None:
    """int8 and uint8 codes whose roots lie next to half integers equal the torch path's, and
    only because the kernel asks torch's sqrt there: with IEEE's sqrt instead, they differ."""
    x8 = _near_ties(127.0**2, 2)  # SGD from a zero momentum: the new momentum is the grad
    g8 = {"w": torch.cat([x8, -x8])}
    c2 = 1 - 0.999  # AdamW from zero moments: nu = (c2 * g) * g
    g_u8 = {"w": (_near_ties(255.0**4, 4) / c2).sqrt()}

    def run(use: bool, make, g) -> tuple:
        with _kernel(use):
            opt = make()
            p = {"w": torch.zeros_like(g["w"])}
            return opt.update({"w": g["w"].clone()}, opt.init(p), p)

    cases = [
        (lambda: fs.optim.sgd(0.1, 0.9, mu_dtype=I8), g8),
        (lambda: fs.optim.adamw(1e-3, (0.9, 0.999), mu_dtype=I8, nu_dtype=U8), g_u8),
    ]
    lib = kernels.library()
    for make, g in cases:
        want = run(False, make, g)
        _assert_same_bits(want, run(True, make, g))
        lib.fs_set_sqrt(None, 0)  # IEEE's sqrt: the near-tie codes must now differ
        try:
            ieee = run(True, make, g)
        finally:
            lib.fs_set_sqrt(kernels._torch_sqrt(), kernels.VML_MODE)
        state_want, state_ieee = fs.tree.leaves(want[1]), fs.tree.leaves(ieee[1])
        assert any(
            isinstance(a, torch.Tensor) and not a.is_floating_point() and not torch.equal(a, b)
            for a, b in zip(state_want, state_ieee, strict=True)
        ), "the inputs did not reach a near-tie where MKL's sqrt and IEEE's round apart"


def test_kernel_is_used(native, monkeypatch) -> None:
    """The narrow step takes the kernel (a test that fails if the wiring is removed)."""
    calls = []
    real = kernels._call
    monkeypatch.setattr(kernels, "_call", lambda *a: calls.append(1) or real(*a))
    _run(lambda: fs.optim.adamw(1e-3, mu_dtype=BF16, nu_dtype=BF16), True, 1, steps=1)
    assert len(calls) == len(SHAPES)


# --- the build ----------------------------------------------------------------------------------
def test_no_compiler_falls_back_with_one_warning(monkeypatch, tmp_path) -> None:
    if not kernels._cpu_supported():
        pytest.skip("the kernel is not built on this CPU")
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, "compiler", str(tmp_path / "no-such-cc"))
    kernels.reset()
    try:
        make = lambda: fs.optim.adamw(1e-2, weight_decay=0.1, mu_dtype=I8, nu_dtype=U8)  # noqa: E731
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _run(make, True, 1)
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and "did not build" in msgs[0], msgs
        assert not kernels.available()
        _assert_same_bits(_run(make, False, 1), got)
    finally:
        kernels.reset()


def test_concurrent_builds(monkeypatch, tmp_path) -> None:
    """Builders racing on an empty cache each rename a whole library into place."""
    if not kernels._cpu_supported():
        pytest.skip("the kernel is not built on this CPU")
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    paths, errors = [], []

    def build() -> None:
        try:
            paths.append(kernels._build())
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(paths)) == 1, paths
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no temporary left
    assert ctypes.CDLL(str(paths[0])).fs_step
