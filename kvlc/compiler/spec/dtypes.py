"""The element types a spec's fields take, and the bytes of one element of each.

``fp4_e2m1`` packs two values in a byte: its storage item is one byte holding two consecutive values
of the field's innermost dim (``PACKED``), so that dim's byte extent is half its size.

>>> DTYPE_SIZES["bf16"], DTYPE_SIZES["fp8_e4m3"], DTYPE_SIZES["fp4_e2m1"], PACKED["fp4_e2m1"]
(2, 1, 1, 2)
>>> field_bytes("fp4_e2m1", 16 * 128), field_bytes("bf16", 16 * 128)
(1024, 4096)
"""

from __future__ import annotations

from typing import Literal, Mapping

DTYPE_SIZES: Mapping[str, int] = {
    "bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "ue8m0": 1, "int8": 1, "uint8": 1,
    "fp4_e2m1": 1,
}
# values per storage item of the packed dtypes (the rest hold one value per item)
PACKED: Mapping[str, int] = {"fp4_e2m1": 2}
DType = Literal["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "ue8m0", "int8", "uint8", "fp4_e2m1"]


def field_bytes(dtype: str, values: int) -> int:
    """Bytes of ``values`` elements of ``dtype`` (a packed dtype rounds a half-filled byte up)."""
    per = PACKED.get(dtype, 1)
    return DTYPE_SIZES[dtype] * -(-values // per)
