"""Storage precision of a KV cell, as plans and telemetry name it."""

from __future__ import annotations

from enum import IntEnum


class Precision(IntEnum):
    """What a plan decides for one (layer, KV head, position) cell; the value is the bits a
    cell keeps (``EVICTED`` = 0: redirected to the dead slot, its memory freed).

    ``FULL`` is the model dtype (bf16 on GPU, fp32 on CPU), not literally 16 bits.
    """

    EVICTED = 0
    INT2 = 2
    INT4 = 4
    FULL = 16

    @property
    def label(self) -> str:
        return {0: "evicted", 2: "int2", 4: "int4", 16: "full"}[int(self)]
