"""Per-sequence inference cache: short-conv windows and fp32 states for KDA layers, the compressed latent
(`c`, normalised, kv_lora_rank wide) and the shared key slice (`k_pe`) for MLA layers.

AttnRes needs no cache: it mixes representations of the *same* token across depth.
"""

from __future__ import annotations

import torch


class K3Cache:
    def __init__(self):
        self.layers: dict[int, dict[str, torch.Tensor]] = {}
        self.seen_tokens = 0  # tokens (incl. padding columns) already processed

    def layer(self, idx: int) -> dict[str, torch.Tensor]:
        return self.layers.setdefault(idx, {})

    def reorder(self, index: torch.Tensor) -> None:
        """Select / reorder batch rows (e.g. to drop finished sequences)."""
        for d in self.layers.values():
            for k, v in d.items():
                d[k] = v.index_select(0, index.to(v.device))

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for d in self.layers.values() for v in d.values())
