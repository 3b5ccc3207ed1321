"""Decoder layers and the text model, with Block Attention Residuals (K3_SPEC §4) and the MTP layer.

Block bookkeeping follows the release exactly (checkpoint.md §5.4): `blocks` holds finished block
representations (the embedding first), `partial` the running sum of the current block's layer outputs;
every layer has an AttnRes site before attention and one before the MLP, and one more site mixes the
final candidates before `model.norm`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import K3TextConfig
from ..ops.attn_res import attn_res, attn_res_norm
from .kda import KimiDeltaAttention
from .layers import RMSNorm, SituMLP
from .mla import MLAttention
from .moe import LatentMoE


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for x's device, or None. Under autocast the embedding (an fp32 master weight)
    is cast to it, so every AttnRes candidate, the block sums and the residual stream share the activation dtype
    (bf16) instead of being promoted to fp32 by the embedding: half the bytes per pass, and the fused AttnRes
    kernel takes one dtype. Statistics and softmax stay fp32 inside the ops."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def _mix(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear, backend: str = "auto") -> torch.Tensor:
    return attn_res(sources, proj.weight, norm.weight, norm.eps, backend=backend)


def stream_embeddings(inputs_embeds: torch.Tensor, autocast_stream: bool = True) -> torch.Tensor:
    """The embeddings as the first AttnRes block: cast to the autocast dtype when one is active (see
    `_autocast_dtype`). The start of `KimiLinearModel.forward`, also pipeline stage 0's."""
    dt = _autocast_dtype(inputs_embeds) if autocast_stream else None
    if dt is not None and inputs_embeds.is_floating_point() and inputs_embeds.dtype != dt:
        inputs_embeds = inputs_embeds.to(dt)  # one residual-stream dtype (bf16 under autocast)
    return inputs_embeds


def run_decoder_layers(layers, blocks: list[torch.Tensor], partial: torch.Tensor | None, block_size: int,
                       attention_mask=None, cache=None, cu_seqlens=None, checkpoint: bool = False,
                       taps: list | None = None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Run decoder `layers` (consecutive, in order) on an explicit AttnRes state: `blocks` (finished block
    representations, the embedding first) and `partial` (the current block's running sum; None before layer
    0) → the state after the last layer. The layer loop of `KimiLinearModel.forward`, also a pipeline stage's
    body (the state is what crosses a stage boundary). `checkpoint`: recompute each layer in the backward;
    `taps`: a list that receives each layer's partial sum.

    Without autograd a layer may add its attention output onto `partial` in place (its o_proj GEMM accumulates
    into it: no copy of the residual stream first), but only onto a partial sum made inside this call and not
    handed out as a tap: the caller's `partial` and the taps stay as they were."""
    own = False  # whether `partial` was made here (the caller's may be held elsewhere)
    for layer in layers:
        lc = None if cache is None else cache.layer(layer.layer_idx)
        if checkpoint:
            blocks, partial = torch.utils.checkpoint.checkpoint(
                layer.forward_attn_res, blocks, partial, block_size, attention_mask, lc, cu_seqlens,
                use_reentrant=False)
        else:
            blocks, partial = layer.forward_attn_res(blocks, partial, block_size, attention_mask, lc, cu_seqlens,
                                                     inplace=own and taps is None)
        own = True
        if taps is not None:
            taps.append(partial)
    return blocks, partial


def attn_res_output(blocks: list[torch.Tensor], partial: torch.Tensor, norm: RMSNorm, proj: nn.Linear,
                    backend: str = "auto") -> torch.Tensor:
    """The output AttnRes site: mix the final candidates (blocks + [partial]) into the pre-norm hidden."""
    return _mix(blocks + [partial], norm, proj, backend)


class KimiDecoderLayer(nn.Module):
    def __init__(self, cfg: K3TextConfig, layer_idx: int, attn_res_sites: bool = True):
        super().__init__()
        D = cfg.hidden_size
        self.layer_idx = layer_idx
        self.attn_res_backend = "auto"  # k3.ops.attn_res backend ("reference": the stacked fp32 oracle)
        self.is_kda = cfg.is_kda_layer(layer_idx) if layer_idx < cfg.num_hidden_layers else False
        self.self_attn = KimiDeltaAttention(cfg, layer_idx) if self.is_kda else MLAttention(cfg, layer_idx)
        if cfg.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = SituMLP(D, cfg.intermediate_size, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        if attn_res_sites:
            self.self_attention_res_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        return self._mlp(self.post_attention_layernorm(h))

    def attn(self, h: torch.Tensor, attention_mask, cache, cu_seqlens=None) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(h), attention_mask, cache, cu_seqlens)

    def forward_attn_res(self, blocks: list[torch.Tensor], partial: torch.Tensor | None, block_size: int,
                         attention_mask=None, cache=None, cu_seqlens=None, inplace: bool = False
                         ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One layer of the AttnRes stream. `partial` is None only before layer 0, when blocks = [embedding].
        inplace: `partial` is the caller's own, so the attention may accumulate onto it without autograd (the MLP
        always may onto the attention's output, which this layer made)."""
        x = self.input_layernorm(blocks[0]) if partial is None else self._mix_norm(
            blocks + [partial], self.self_attention_res_norm, self.self_attention_res_proj, self.input_layernorm)
        if self.layer_idx % block_size == 0 and partial is not None:
            blocks = blocks + [partial]
            partial = None
        # each sublayer returns partial + its output (inference adds it in the output projection's epilogue)
        partial = self.self_attn(x, attention_mask, cache, cu_seqlens, residual=partial, residual_inplace=inplace)
        x = self._mix_norm(blocks + [partial], self.mlp_res_norm, self.mlp_res_proj, self.post_attention_layernorm)
        return blocks, self._mlp(x, residual=partial, residual_inplace=True)

    def _mix_norm(self, sources: list[torch.Tensor], res_norm: RMSNorm, res_proj: nn.Linear,
                  norm: RMSNorm) -> torch.Tensor:
        """norm(AttnRes(sources)): a sublayer's input. In CPU training the pair is recomputed in the backward
        (memory-lean, like the CPU MLPs): only the sources are kept, which the stream holds anyway, not the
        AttnRes output that the norm would save (≈ 13 KB per token of k3-tiny at 64K tokens)."""
        def f(*srcs):  # one kernel in inference on CUDA (`attn_res_norm`), else the two ops
            return attn_res_norm(list(srcs), res_proj.weight, res_norm.weight, res_norm.eps, norm.weight, norm.eps,
                                 backend=self.attn_res_backend)
        if torch.is_grad_enabled() and not sources[0].is_cuda:
            return torch.utils.checkpoint.checkpoint(f, *sources, use_reentrant=False)
        return f(*sources)

    def _mlp(self, x: torch.Tensor, residual: torch.Tensor | None = None, residual_inplace: bool = False
             ) -> torch.Tensor:
        return (self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp)(
            x, residual=residual, residual_inplace=residual_inplace)

    def forward(self, x: torch.Tensor, attention_mask=None, cache=None, cu_seqlens=None) -> torch.Tensor:
        """Plain pre-norm residual layer (used by the MTP block, where AttnRes is off); each sublayer adds x in its
        output projection."""
        x = self.self_attn(self.input_layernorm(x), attention_mask, cache, cu_seqlens, residual=x)
        return self._mlp(self.post_attention_layernorm(x), residual=x)


class MTPLayer(KimiDecoderLayer):
    """DeepSeek-style multi-token-prediction layer at `layers.{num_hidden_layers + k}`.

    h' = Layer(eh_proj([enorm(emb(x_{t+1})) ; hnorm(h_t)])), logits = head(shared_head.norm(h')),
    predicting token t+2 at position t. Its decoder layer is MLA + LatentMoE with AttnRes off. As in vLLM's
    K3 MTP, the next MTP step receives the pre-norm h' (not shared_head.norm(h')), and `head` is the
    layer's own `shared_head.head` when a checkpoint carries one (the loader attaches it), else lm_head.
    """

    def __init__(self, cfg: K3TextConfig, layer_idx: int):
        nn.Module.__init__(self)
        D = cfg.hidden_size
        self.layer_idx, self.is_kda = layer_idx, False
        self.self_attn = MLAttention(cfg, layer_idx)
        self.block_sparse_moe = LatentMoE(cfg)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.shared_head.head = None   # optional own output head (`shared_head.head.weight` in a checkpoint)

    def forward_mtp(self, next_embeds: torch.Tensor, hidden: torch.Tensor, attention_mask=None, cache=None,
                    cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm h' — the state the next MTP step reads —, shared_head.norm(h') — the head's input)."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        h = KimiDecoderLayer.forward(self, x, attention_mask, cache, cu_seqlens)
        return h, self.shared_head.norm(h)


class KimiLinearModel(nn.Module):
    """`language_model.model`: embeddings, the 93 (or preset's) decoder layers, MTP layers, output AttnRes."""

    def __init__(self, cfg: K3TextConfig):
        super().__init__()
        self.config = cfg
        D, N = cfg.hidden_size, cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
        layers: list[nn.Module] = [KimiDecoderLayer(cfg, i) for i in range(N)]
        layers += [MTPLayer(cfg, N + k) for k in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(D, 1, bias=False)
        self.gradient_checkpointing = False
        self.attn_res_backend = "auto"  # the output AttnRes site's backend
        self.autocast_stream = True  # under autocast, cast the embeddings to the autocast dtype (see _autocast_dtype)

    @property
    def decoder_layers(self) -> list[KimiDecoderLayer]:
        return list(self.layers[: self.config.num_hidden_layers])

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.layers[self.config.num_hidden_layers:])

    def forward(self, inputs_embeds: torch.Tensor, attention_mask=None, cache=None,
                output_block_states: bool = False, cu_seqlens: torch.Tensor | None = None,
                rows: torch.Tensor | None = None):
        """inputs_embeds [B, T, D] → (pre-norm hidden [B, T, D], final normed hidden, per-layer block info).

        `cu_seqlens` (int32 [N+1] over the flattened B·T tokens) packs several documents per row: KDA state,
        short convs and MLA attention then never cross a document boundary. `cache`: a `K3Cache` or a
        `PagedCache` (the engine's pool; its batch is one packed row [1, N]). `rows` (long [R], B = 1): keep
        only these positions for the output AttnRes site and norm (the hidden outputs are then [1, R, D])."""
        if rows is not None and inputs_embeds.shape[0] != 1:
            raise ValueError(f"rows needs one packed row (B = 1), got B = {inputs_embeds.shape[0]}")
        taps = []
        blocks, partial = run_decoder_layers(
            self.decoder_layers, [stream_embeddings(inputs_embeds, self.autocast_stream)], None,
            self.config.attn_res_block_size, attention_mask, cache, cu_seqlens,
            self.gradient_checkpointing and self.training, taps if output_block_states else None)
        if rows is not None:
            blocks, partial = [b[:, rows] for b in blocks], partial[:, rows]
        h = attn_res_output(blocks, partial, self.output_attn_res_norm, self.output_attn_res_proj,
                            self.attn_res_backend)
        return h, self.norm(h), taps
