"""The Hugging Face generation arguments `model.generate` accepts, checked in one place.

Users come with `model.generate(ids, do_sample=True, top_k=50, top_p=0.9, temperature=0.7, max_new_tokens=64,
eos_token_id=..., pad_token_id=...)` or a `transformers.GenerationConfig` (any object with those attributes, or a
dict). `resolve` turns them into one validated `GenerationArgs`; an HF option this loop does not implement
(beam search, repetition penalties, ...) is refused with its name and value unless it has its neutral value, so
nothing is silently ignored. One difference from HF, kept for k3's existing callers: when `do_sample` is not
given, `temperature > 0` means sampling (HF would decode greedily and warn).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# HF options with their neutral values: accepted only at these values (a GenerationConfig carries them all).
_NEUTRAL = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "penalty_alpha": None,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "length_penalty": 1.0, "diversity_penalty": 0.0, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "min_length": 0, "min_new_tokens": None,
    "bad_words_ids": None, "force_words_ids": None, "constraints": None, "sequence_bias": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "guidance_scale": None, "stop_strings": None, "output_scores": False,
    "output_logits": False, "output_attentions": False, "output_hidden_states": False,
    "return_dict_in_generate": False, "assistant_model": None, "prompt_lookup_num_tokens": None,
    "use_cache": True, "renormalize_logits": False, "remove_invalid_values": False, "early_stopping": False,
    "max_time": None, "exponential_decay_length_penalty": None, "watermarking_config": None,
    "streamer": None, "logits_processor": None, "stopping_criteria": None, "prefix_allowed_tokens_fn": None,
    "negative_prompt_ids": None, "negative_prompt_attention_mask": None, "synced_gpus": False,
    "custom_generate": None, "dola_layers": None, "token_healing": False, "low_memory": None,
    "assistant_early_exit": None, "tokenizer": None,
}
# GenerationConfig bookkeeping fields that carry no decoding choice.
_IGNORED = {"bos_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config", "_commit_hash",
            "generation_kwargs", "cache_implementation", "cache_config", "return_legacy_cache", "is_assistant",
            "compile_config", "disable_compile", "num_assistant_tokens", "num_assistant_tokens_schedule",
            "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
            "max_matching_ngram_size", "trust_remote_code", "use_model_defaults"}
SUPPORTED = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
             "pad_token_id")


@dataclass
class GenerationArgs:
    """What the decoding loop needs. `eos_token_ids` may be empty; `pad_token_id` fills rows that finished."""
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None


def _as_dict(generation_config) -> dict:
    if generation_config is None:
        return {}
    if isinstance(generation_config, dict):
        return dict(generation_config)
    if hasattr(generation_config, "to_dict"):
        return dict(generation_config.to_dict())
    if hasattr(generation_config, "__dict__"):
        return {k: v for k, v in vars(generation_config).items() if not k.startswith("__")}
    raise TypeError(f"generation_config must be a GenerationConfig, a dict or None, got "
                    f"{type(generation_config).__name__}")


def _token_ids(name: str, value, vocab_size: int | None) -> list[int]:
    ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{name} must be an int or a list of ints, got {value!r}")
    bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        raise ValueError(f"{name}={value!r}: id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


def resolve(generation_config=None, *, prompt_length: int = 0, vocab_size: int | None = None,
            **kwargs) -> GenerationArgs:
    """Merge a GenerationConfig (or dict) with keyword arguments (keywords win) into validated
    `GenerationArgs`. Raises TypeError for unknown names and ValueError for bad or unsupported values."""
    merged = {k: v for k, v in _as_dict(generation_config).items() if v is not None or k in kwargs}
    merged.update(kwargs)
    unknown = sorted(k for k in merged if k not in SUPPORTED and k not in _NEUTRAL and k not in _IGNORED)
    if unknown:
        raise TypeError(f"generate() got unexpected argument(s) {unknown}; supported: {list(SUPPORTED)}")
    for k, neutral in _NEUTRAL.items():
        if k in merged and merged[k] != neutral and not (neutral is None and merged[k] in ((), [], {})):
            raise ValueError(f"generate() does not support {k}={merged[k]!r} (only {neutral!r}); it decodes "
                             f"greedily or by sampling with {list(SUPPORTED)}")
    a = GenerationArgs()
    if "max_new_tokens" in merged and merged["max_new_tokens"] is not None:
        a.max_new_tokens = merged["max_new_tokens"]
    elif merged.get("max_length") is not None:
        if not isinstance(merged["max_length"], int) or merged["max_length"] < prompt_length:
            raise ValueError(f"max_length={merged['max_length']!r} must be an int >= the prompt length "
                             f"({prompt_length}); or pass max_new_tokens")
        a.max_new_tokens = merged["max_length"] - prompt_length
    if not isinstance(a.max_new_tokens, int) or isinstance(a.max_new_tokens, bool) or a.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {a.max_new_tokens!r}")
    t = merged.get("temperature", None)
    if t is not None:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        a.temperature = float(t)
    ds = merged.get("do_sample", None)
    if ds is None:
        a.do_sample = t is not None and a.temperature > 0
    elif not isinstance(ds, bool):
        raise ValueError(f"do_sample must be True or False, got {ds!r}")
    else:
        a.do_sample = ds
    if a.do_sample and a.temperature == 0:
        raise ValueError("do_sample=True needs temperature > 0 (temperature=0 is greedy: pass do_sample=False)")
    k = merged.get("top_k", None)
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}")
        a.top_k = k
    p = merged.get("top_p", None)
    if p is not None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        a.top_p = float(p)
    if merged.get("eos_token_id") is not None:
        a.eos_token_ids = _token_ids("eos_token_id", merged["eos_token_id"], vocab_size)
    if merged.get("pad_token_id") is not None:
        pad = merged["pad_token_id"]
        a.pad_token_id = _token_ids("pad_token_id", pad, vocab_size)[0] if isinstance(pad, int) else None
        if a.pad_token_id is None:
            raise ValueError(f"pad_token_id must be one int, got {pad!r}")
    return a
