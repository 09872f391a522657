"""vLLM's ``fp8_ds_mla`` MLA cache: one packed record per token, as a strided layout.

FlashMLA-sparse's "FP8 with scale" cache stores each token of an MLA layer as one record:
the ``kv_lora_rank`` NoPE latent values quantized to ``fp8_e4m3`` (bytes ``[0, nope)``),
one ``fp32`` scale per 128 of them, then the ``qk_rope_head_dim`` RoPE values kept in
``bf16``. For DeepSeek-V3.2 (rank 512, rope 64) that is 512 + 4*4 + 64*2 = 656 bytes. The
sizes come from the config's fields, so another MLA model with a rank that is a multiple
of 128 gets its own record; the spec gives every dim an explicit byte stride, the token
stride being the record size.

>>> r = DsMlaRecord.of(nope=512, rope=64)
>>> r.scales, r.scale_offset, r.rope_offset, r.nbytes
(4, 512, 528, 656)
>>> r.layout(64)["size"]
41984
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.init.model import Family, InitError, Model

DS_MLA = "fp8_ds_mla"
QUANT_TILE = 128  # NoPE values per fp32 scale
SCALE_BYTES, ROPE_BYTES = 4, 2  # fp32 scales, bf16 RoPE values


@dataclass(frozen=True)
class DsMlaRecord:
    """One token's record: ``nope`` fp8 values, ``scales`` fp32 scales, ``rope`` bf16 values."""

    nope: int
    scales: int
    rope: int

    @classmethod
    def of(cls, nope: int, rope: int) -> "DsMlaRecord":
        return cls(nope, nope // QUANT_TILE, rope)

    @property
    def scale_offset(self) -> int:
        return self.nope

    @property
    def rope_offset(self) -> int:
        return self.nope + SCALE_BYTES * self.scales

    @property
    def nbytes(self) -> int:
        return self.rope_offset + ROPE_BYTES * self.rope

    def sizes(self) -> dict[str, int]:
        return {"nope": self.nope, "scale": self.scales, "rope": self.rope}

    def layout(self, block_size: int) -> dict:
        """The spec layout of one block of ``block_size`` records."""
        token = {"name": "token", "role": "token", "stride": self.nbytes}

        def field(name: str, dtype: str, offset: int, item: int) -> dict:
            return {"name": name, "dtype": dtype, "offset": offset,
                    "dims": [dict(token), {"name": name, "stride": item}]}

        return {"size": block_size * self.nbytes, "fields": [
            field("nope", "fp8_e4m3", 0, 1),
            field("scale", "fp32", self.scale_offset, SCALE_BYTES),
            field("rope", "bf16", self.rope_offset, ROPE_BYTES)]}


def ds_mla_record(m: Model) -> DsMlaRecord:
    """The record of model ``m``, or an :class:`InitError` saying why ``fp8_ds_mla`` cannot hold it."""
    if m.family != Family.MLA:
        raise InitError(f"--kv-dtype {DS_MLA} is vLLM's packed MLA cache (fp8 latent, fp32 scales, bf16 rope per "
                        f"token), but this is a {m.family.value} model (config.json has no 'kv_lora_rank'); "
                        "fix: use a plain KV dtype such as bf16 or fp8_e4m3")
    nope = m.latent - m.rope
    if nope % QUANT_TILE or not nope:
        raise InitError(f"--kv-dtype {DS_MLA} quantizes the latent in tiles of {QUANT_TILE} values with one fp32 "
                        f"scale each; config.json's kv_lora_rank {nope} is not a multiple of {QUANT_TILE}; "
                        "fix: use bf16 for the MLA latent")
    return DsMlaRecord.of(nope, m.rope)
