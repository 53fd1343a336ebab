"""When a fused forward (:mod:`.fused_norms`, :mod:`.fused_rotary`, :mod:`.fused_projections`)
runs in place of transformers' own: one :class:`FusedPath` per fusion, read at every call
(a CUDA graph keeps what its capture ran); and the model families they take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: transformers model families whose norm, rotary embedding, attention projections and MLP
#: are the Llama ones (the fusions' tests check each class's source in the installed
#: transformers): class names are ``f"{family}RMSNorm"``, ``f"{family}Attention"``, ...
LLAMA_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe")


@dataclass
class FusedPath:
    """``enabled``: the process-wide switch (benchmarks compare both); ``devices``: the
    device types whose inputs take the fused kernels (CUDA; tests add ``"cpu"`` under
    Triton's interpreter). The kernels have no backward, so a forward under autograd
    never takes them."""

    enabled: bool = True
    devices: frozenset[str] = frozenset({"cuda"})

    def takes(self, x: torch.Tensor) -> bool:
        """Whether a forward on ``x`` runs fused."""
        return self.enabled and x.device.type in self.devices and not torch.is_grad_enabled()
