"""The dtypes a state can be checkpointed in: each torch dtype and its zarr v2 name (Orbax's
and tensorstore's). ``fs.init`` refuses a model buffer of any other dtype; the checkpoint
format (:mod:`funcshard.checkpoint.format`) writes and reads these."""

from __future__ import annotations

import torch

__all__ = ["ZARR_DTYPE"]

ZARR_DTYPE = {
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.float16: "<f2",
    torch.bfloat16: "bfloat16",
    torch.int8: "|i1",  # 8-bit optimizer moments (their fp32 scales are arrays beside them)
    torch.uint8: "|u1",
    # the model's buffers (funcshard.state.buffers): counters, masks, rotary tables beside
    # float ones; float8 under the names of ml_dtypes (and of tensorstore's zarr driver)
    torch.int64: "<i8",
    torch.int32: "<i4",
    torch.int16: "<i2",
    torch.uint16: "<u2",
    torch.uint32: "<u4",
    torch.uint64: "<u8",
    torch.bool: "|b1",
    torch.complex64: "<c8",
    torch.complex128: "<c16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz",
    torch.float8_e5m2fnuz: "float8_e5m2fnuz",
    torch.float8_e8m0fnu: "float8_e8m0fnu",
}
