"""The element types a spec's fields take, and the bytes of one element of each.

>>> DTYPE_SIZES["bf16"], DTYPE_SIZES["fp8_e4m3"]
(2, 1)
"""

from __future__ import annotations

from typing import Literal, Mapping

DTYPE_SIZES: Mapping[str, int] = {
    "bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1,
}
DType = Literal["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "uint8"]
