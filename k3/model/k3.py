"""Top-level models with the release's module tree: `K3ForConditionalGeneration` holds `language_model`
(`KimiLinearForCausalLM`: `.model` + `.lm_head`), `vision_tower` and `mm_projector`."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K3Config, K3TextConfig
from ..ops.linear_ce import autocast_cast, linear_cross_entropy
from ..ops.varlen import check_cu_seqlens, doc_ids, remembers_cu_seqlens
from .cache import K3Cache
from .decoder import KimiLinearModel
from .kda import KimiDeltaAttention
from .layers import RMSNorm, no_init_weights
from .moe import MoEGate, StackedExperts
from .state_dict import FP32_SUFFIXES



@dataclass
class K3Output:
    """`logits` / `mtp_logits` are None when the loss came from the fused head (training mode with labels and
    `loss_impl == "fused"`): no [B, T, V] logits are formed then."""
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    mtp_logits: torch.Tensor | None = None
    past_key_values: K3Cache | None = None
    hidden_states: torch.Tensor | None = None  # pre-norm output of the final AttnRes site
    block_states: list | None = None  # per layer, the running block partial sum (EAGLE-3 taps)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, shift: int = 1, ignore_index: int = -100,
            docs: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of logits[t] against labels[t + shift] (fp32), ignoring `ignore_index`; with `docs`
    ([B, T] document ids of packed rows) a target in another document than t is ignored too."""
    lg = logits[:, :-shift].reshape(-1, logits.shape[-1]).float()
    target = labels[:, shift:]
    if docs is not None:
        target = target.masked_fill(docs[:, shift:] != docs[:, :-shift], ignore_index)
    return F.cross_entropy(lg, target.reshape(-1), ignore_index=ignore_index)


def shifted_targets(labels: torch.Tensor, shift: int = 1, ignore_index: int = -100,
                    docs: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] targets aligned with the positions: target[t] = labels[t + shift], `ignore_index` for the last
    `shift` positions of each row and (with `docs`) for a target in another document than t. The same terms
    as `lm_loss`, laid out so the hidden states can be used whole."""
    tgt = labels.new_full(labels.shape, ignore_index)
    nxt = labels[:, shift:]
    if docs is not None:
        nxt = nxt.masked_fill(docs[:, shift:] != docs[:, :-shift], ignore_index)
    tgt[:, :labels.shape[1] - shift] = nxt
    return tgt


def target_loss(hn: torch.Tensor, logits: torch.Tensor | None, head_w: torch.Tensor | None, target: torch.Tensor,
                count: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Σ over positions with a target of the cross-entropy, divided by `count` (not by the local number of
    targets): per-position targets [B, T] with a caller-chosen normaliser, so that the shares of several ranks
    holding parts of one batch add up to its mean loss. From the fused head (`head_w`, hn [B, T, D]) or from
    `logits` [B, T, V]."""
    t = target.reshape(-1)
    if head_w is None:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), t, ignore_index=ignore_index,
                               reduction="sum") / count
    mean = linear_cross_entropy(hn.reshape(-1, hn.shape[-1]), head_w, t, ignore_index=ignore_index)
    n = (t != ignore_index).sum()
    # no target here: the fused mean is 0/0, its backward is safe (it divides by max(n, 1))
    return torch.where(n > 0, mean, torch.zeros_like(mean)) * (n.to(mean.dtype) / count.to(mean.dtype))


LOSS_IMPLS = ("fused", "plain")


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: K3TextConfig):
        super().__init__()
        self.config = cfg
        self.model = KimiLinearModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # "fused": in training mode with labels, the LM and MTP losses come from `linear_cross_entropy` (no
        # full-vocabulary logits; out.logits / out.mtp_logits are None). "plain": logits, then `lm_loss`.
        self.loss_impl = "fused"
        # context parallelism, applied from outside (`k3.parallel.cp.enable_context_parallel`): an executor with
        # `.size` (ranks sharing each sequence) and `shift_tokens(x, k)` (x at t + k of the whole sequence).
        # When set, the inputs are this rank's share, cu_seqlens describe the whole sequences and the loss
        # comes from `targets` / `num_targets` (`k3.parallel.cp.shard_batch`).
        self.context_parallel = None

    @remembers_cu_seqlens
    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                past_key_values: K3Cache | None = None, use_cache: bool = False, logits_to_keep: int = 0,
                output_block_states: bool = False, cu_seqlens: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, num_targets: torch.Tensor | None = None) -> K3Output:
        """Causal LM forward. `labels` use the HF convention (same positions as input_ids; shifted here).

        With MTP layers and labels, also returns `mtp_loss` (layer k predicts token t + 1 + k at position t).
        `cu_seqlens` (int32 [N+1] over the flattened B·T tokens) packs documents: no attention, state or
        loss term crosses a document boundary. In training mode with labels and `self.loss_impl == "fused"`
        (the default), the losses come from the fused, chunked linear + cross-entropy (same value and
        gradients, no [B, T, V] logits) and `logits` / `mtp_logits` are None; eval mode or
        `loss_impl = "plain"` returns the logits (the last `logits_to_keep` positions when > 0).
        Instead of labels, `targets` (int64 [1 + M, B, T], M = number of MTP layers; row i holds the target
        of position t for shift 1 + i, -100 where there is none) and `num_targets` ([1 + M], default: the
        valid entries of each row) give each loss as Σ cross-entropy / num_targets[i]: the form context
        parallelism uses (`k3.parallel.cp.shard_batch` computes them from the whole sequences).
        """
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl must be one of {LOSS_IMPLS}, got {self.loss_impl!r}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        cp = self.context_parallel
        T_all = T if cp is None else T * cp.size  # tokens per row of the whole sequences
        if cp is not None and (labels is not None or attention_mask is not None or past_key_values is not None
                               or use_cache):
            raise ValueError("under context parallelism pass targets / num_targets (k3.parallel.cp.shard_batch) "
                             "instead of labels, and no attention_mask or cache")
        if labels is not None and targets is not None:
            raise ValueError("pass labels or targets, not both")
        if attention_mask is not None:
            past = 0 if past_key_values is None else past_key_values.seen_tokens
            if attention_mask.shape != (B, past + T):
                raise ValueError(f"attention_mask must be [B, past + T] = [{B}, {past + T}], "
                                 f"got {tuple(attention_mask.shape)}")
        cache = past_key_values if past_key_values is not None else (K3Cache() if use_cache else None)
        docs = None
        if cu_seqlens is not None:
            if cache is not None or attention_mask is not None:
                raise ValueError("cu_seqlens (packed documents) cannot be combined with a cache or an attention_mask")
            check_cu_seqlens(cu_seqlens, B * T_all)
            docs = doc_ids(cu_seqlens, B, T) if cp is None else None
        h, hn, taps = self.model(inputs_embeds, attention_mask, cache, output_block_states, cu_seqlens)
        if cache is not None:
            cache.seen_tokens += T
        out = K3Output(past_key_values=cache, hidden_states=h, block_states=taps if output_block_states else None)
        # fused: the head weight, cast once for every head call (as autocast's weight cache would)
        wants_loss = labels is not None or targets is not None
        head_w = autocast_cast(self.lm_head.weight) if self.training and wants_loss \
            and self.loss_impl == "fused" else None
        if head_w is None:
            out.logits = self.lm_head(hn[:, -logits_to_keep:] if logits_to_keep else hn)
        if targets is not None:
            n_mtp = len(self.model.mtp_layers) if T_all > 2 else 0
            if tuple(targets.shape) != (1 + n_mtp, B, T):
                raise ValueError(f"targets must be [1 + MTP layers, B, T] = {[1 + n_mtp, B, T]}, "
                                 f"got {list(targets.shape)}")
            if num_targets is None:
                num_targets = (targets != -100).sum((1, 2))
            out.loss = target_loss(hn, out.logits, head_w, targets[0], num_targets[0])
            if n_mtp:
                out.mtp_logits, out.mtp_loss = self._mtp(inputs_embeds, h, None, None, cu_seqlens, None, head_w,
                                                         targets, num_targets)
        elif labels is not None:
            out.loss = (lm_loss(out.logits, labels, docs=docs) if head_w is None
                        else self._fused_loss(hn, head_w, labels, 1, docs))
            if self.model.mtp_layers and T > 2:
                out.mtp_logits, out.mtp_loss = self._mtp(inputs_embeds, h, attention_mask, labels, cu_seqlens, docs,
                                                         head_w)
        return out

    @staticmethod
    def _fused_loss(hn, weight, labels, shift, docs):
        """lm_loss(lm_head(hn), labels, shift, docs) through the fused linear + cross-entropy: targets laid
        out per position (`shifted_targets`) so hn [B, T, D] is used whole, as a [B·T, D] view."""
        return linear_cross_entropy(hn.reshape(-1, hn.shape[-1]), weight,
                                    shifted_targets(labels, shift, docs=docs).reshape(-1))

    def _mtp(self, embeds, h, attention_mask, labels, cu_seqlens=None, docs=None, head_w=None, targets=None,
             num_targets=None):
        shift = None if self.context_parallel is None else self.context_parallel.shift_tokens
        return mtp_losses(self.model.mtp_layers, self.lm_head, embeds, h, attention_mask, labels, cu_seqlens,
                          docs, head_w, targets, num_targets, shift)


def mtp_losses(mtp_layers, lm_head: nn.Linear, embeds, h, attention_mask, labels, cu_seqlens=None, docs=None,
               head_w=None, targets=None, num_targets=None, shift=None):
    """(last layer's logits or None, mean MTP loss). Chain the MTP layers: layer k sees the pre-norm output
    h_{k-1} of the step before (the main model's pre-norm hidden for k = 1, as vLLM's K3 MTP chains) and the
    embedding of token t + k (zero past the end); its logits come from its own `shared_head.head` if loaded,
    else `lm_head`. With `head_w` (the fused path: lm_head's weight, cast once) each layer's loss goes through
    `_fused_loss` and no logits are returned; autograd sums the head-weight gradients of all heads.
    A function (not only a method) so a pipeline's last stage, which holds the MTP layers and the head but no
    `KimiLinearForCausalLM`, runs the same code. With `targets` / `num_targets` layer k's loss is `target_loss`
    on row k; `shift(x, k)` (context parallelism: the next tokens may sit on another rank) replaces the local
    shift of the embeddings."""
    losses, logits_k = [], None
    mask = None if attention_mask is None else attention_mask[:, -embeds.shape[1]:]
    for k, layer in enumerate(mtp_layers, start=1):
        if shift is not None:
            nxt = shift(embeds, k)
        else:
            nxt = torch.cat([embeds[:, k:], embeds.new_zeros(embeds.shape[0], k, embeds.shape[2])], dim=1)
        h, hn = layer.forward_mtp(nxt, h, mask, None, cu_seqlens)
        head = layer.shared_head.head if layer.shared_head.head is not None else lm_head
        if targets is not None:
            w = None if head_w is None else (head_w if head is lm_head else autocast_cast(head.weight))
            logits_k = None if w is not None else head(hn)
            losses.append(target_loss(hn, logits_k, w, targets[k], num_targets[k]))
        elif head_w is None:
            logits_k = head(hn)
            losses.append(lm_loss(logits_k, labels, shift=1 + k, docs=docs))
        else:
            w = head_w if head is lm_head else autocast_cast(head.weight)
            losses.append(KimiLinearForCausalLM._fused_loss(hn, w, labels, 1 + k, docs))
    return logits_k, torch.stack(losses).mean()


class K3ForConditionalGeneration(nn.Module):
    """Kimi K3: text model + optional MoonViT-V2 vision tower and projector."""

    def __init__(self, config: K3Config, init: bool = True, dtype: torch.dtype | None = None):
        """init=False skips the training init (for loading); dtype builds directly in that dtype
        (the release's fp32 parameters stay fp32)."""
        super().__init__()
        self.config = config
        with contextlib.nullcontext() if init else no_init_weights():
            self.language_model = KimiLinearForCausalLM(config.text_config)
            if config.vision_config is not None:
                from .vision import MoonViTVisionTower, PatchMergerV2Projector
                self.vision_tower = MoonViTVisionTower(config.vision_config)
                self.mm_projector = PatchMergerV2Projector(config.vision_config)
            else:
                self.vision_tower = self.mm_projector = None
        if dtype is not None:
            self.cast(dtype)
        if init:
            self.init_weights()

    # ---- construction helpers --------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """Training-from-scratch init: N(0, initializer_range) matrices, unit norms, zero AttnRes queries,
        zero selection bias, KDA gate parameters as in `KimiDeltaAttention.reset_gate_parameters`."""
        std = self.config.text_config.initializer_range
        for name, mod in self.language_model.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                if name.endswith("_res_proj"):
                    mod.weight.zero_()
                else:
                    nn.init.normal_(mod.weight, std=std)
            elif isinstance(mod, StackedExperts):
                for p in (mod.w1, mod.w2, mod.w3):
                    nn.init.normal_(p, std=std)
            elif isinstance(mod, MoEGate):
                nn.init.normal_(mod.weight, std=std)
                mod.e_score_correction_bias.zero_()
            elif isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)
            elif isinstance(mod, KimiDeltaAttention):
                mod.reset_gate_parameters()
        # a finite std for convs: fan-in of a depthwise kernel
        for name, p in self.language_model.named_parameters():
            if name.endswith("conv1d.weight"):
                bound = 1.0 / math.sqrt(p.shape[-1])
                nn.init.uniform_(p, -bound, bound)

    def cast(self, dtype: torch.dtype) -> "K3ForConditionalGeneration":
        """Cast to `dtype` but keep the release's fp32 parameters (A_log, dt_bias, o_norm, convs, router bias)."""
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if name.endswith(FP32_SUFFIXES) else dtype)
        return self

    def gradient_checkpointing_enable(self, enable: bool = True) -> None:
        """Recompute each decoder layer in the backward instead of storing its activations (training only)."""
        self.language_model.model.gradient_checkpointing = enable

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- forward -------------------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.model.embed_tokens

    def embed(self, input_ids: torch.Tensor, attention_mask=None, labels=None, pixel_values=None, grid_thws=None):
        """Token embeddings, with each `<|media_pad|>` expanded into its image's projected feature block."""
        embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is None:
            return embeds, attention_mask, labels
        if self.vision_tower is None:
            raise ValueError("pixel_values given but this model has no vision tower (vision_config is null)")
        from .media import merge_media_embeddings
        feats = [self.mm_projector(f) for f in self.vision_tower(pixel_values.to(embeds.dtype), grid_thws)]
        m = merge_media_embeddings(input_ids, embeds, feats, self.config.media_placeholder_token_id,
                                   attention_mask, labels)
        return m["inputs_embeds"], m["attention_mask"], m["labels"]

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                grid_thws: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                past_key_values: K3Cache | None = None, use_cache: bool = False, logits_to_keep: int = 0,
                output_block_states: bool = False, cu_seqlens: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, num_targets: torch.Tensor | None = None) -> K3Output:
        """See `KimiLinearForCausalLM.forward` (targets / num_targets: per-position targets, e.g. from
        `k3.parallel.cp.shard_batch`)."""
        if cu_seqlens is not None and pixel_values is not None:
            raise ValueError("cu_seqlens (packed documents) with pixel_values is not supported: media expansion "
                             "changes the token count")
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            inputs_embeds, attention_mask, labels = self.embed(input_ids, attention_mask, labels, pixel_values,
                                                               grid_thws)
        return self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, labels=labels,
                                   past_key_values=past_key_values, use_cache=use_cache,
                                   logits_to_keep=logits_to_keep, output_block_states=output_block_states,
                                   cu_seqlens=cu_seqlens, targets=targets, num_targets=num_targets)

    # ---- generation / checkpoints ----------------------------------------------------------------
    def generate(self, *args, **kwargs) -> torch.Tensor:
        from .generation import generate
        return generate(self, *args, **kwargs)

    def save_pretrained(self, directory: str | os.PathLike, **kwargs):
        from .state_dict import save_pretrained
        return save_pretrained(self, directory, **kwargs)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **kwargs) -> "K3ForConditionalGeneration":
        from .state_dict import load_pretrained
        return load_pretrained(directory, **kwargs)
