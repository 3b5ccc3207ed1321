"""K3 tokenizer: byte-level BPE run by tiktoken, in the release's file format.

One class serves both cases:
- a real K2/K3 checkpoint directory (`tiktoken.model`: one `base64(token bytes) rank` line per regular
  token; `tokenizer_config.json`: `added_tokens_decoder` naming the special ids from 163584), loaded offline
  with only those two files;
- our own tokenizers, trained with HF `tokenizers` (byte-level BPE, K3's pre-tokenisation pattern) on the
  built-in corpus and saved in the same two-file format.

Special-token layout (K3, generalised to any preset): the ids from `bos_token_id` to `vocab_size - 1` are
special, at the release's offsets — [BOS]+0, [EOS]+1, <|end_of_msg|>+2, <|open|>+3, <|close|>+4, <|sep|>+5,
<|media_begin|>+18, <|media_content|>+19, <|media_end|>+20, <|media_pad|>+21, [UNK] = vocab-2,
[PAD] = vocab-1 — and every other slot is `<|reserved_token_{id}|>`. `eos_token_id` is <|end_of_msg|> (the
config's eos and the generation stop); `eod_token_id` is [EOS], which ends each pre-training document.

`encode(text)` never produces a special id unless `allow_special=True`: with specials disallowed, text such
as "<|open|>" is encoded as ordinary bytes, so user text cannot inject protocol tokens.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from .._atomic import atomic_write

if TYPE_CHECKING:
    from ..config import K3TextConfig

# Kimi's pre-tokenisation pattern (`tokenization_kimi.py`): Han runs split from other letters; the `&&`
# class intersections are understood by tiktoken's (fancy-regex) and by HF tokenizers' (Oniguruma) engines.
K3_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Offsets from bos_token_id of the named K3 specials ([UNK] and [PAD] sit at the end of the vocabulary).
K3_SPECIAL_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5,
    "<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21,
}
K3_NUM_RESERVED_SPECIAL = 256  # the release's special block: ids 163584 … 163839
_MIN_SPECIAL = max(K3_SPECIAL_OFFSETS.values()) + 3  # room for [UNK] and [PAD] after the named offsets

# tiktoken slows down badly (and the reference splits) on very long inputs and very long runs of one class.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(r"\s{%d}|\S{%d}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))

_TOKENIZER_FORMAT = 1  # bump when train_bpe's output for the same inputs changes (invalidates caches)


def k3_special_tokens(bos_token_id: int, vocab_size: int) -> dict[str, int]:
    """The K3 special block [bos_token_id, vocab_size): named tokens at their offsets, the rest reserved."""
    n = vocab_size - bos_token_id
    if n < _MIN_SPECIAL:
        raise ValueError(f"the special block [bos_token_id={bos_token_id}, vocab_size={vocab_size}) has {n} ids; "
                         f"K3's layout needs at least {_MIN_SPECIAL}")
    names = {bos_token_id + off: name for name, off in K3_SPECIAL_OFFSETS.items()}
    names[vocab_size - 2] = "[UNK]"
    names[vocab_size - 1] = "[PAD]"
    return {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(bos_token_id, vocab_size)}


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (the form HF byte-level vocabularies use)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_unicode().items()}


class K3Tokenizer:
    """Byte-level BPE (tiktoken engine) with K3's special tokens.

    `mergeable_ranks` maps each regular token's bytes to its id (the BPE merge rank); it must hold all 256
    single bytes so any text is encodable. `special_tokens` maps names to ids disjoint from the regular ids.
    """

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int], *,
                 pat_str: str = K3_PAT_STR, name: str = "k3", bos_token: str = "[BOS]",
                 eos_token: str | None = None, pad_token: str = "[PAD]", unk_token: str = "[UNK]",
                 eod_token: str = "[EOS]"):
        import tiktoken

        missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
        if missing:
            raise ValueError(f"mergeable_ranks lacks {len(missing)} single-byte tokens (e.g. byte {missing[0]}); "
                             "byte-level BPE needs all 256")
        regular_ids = set(mergeable_ranks.values())
        if len(regular_ids) != len(mergeable_ranks):
            raise ValueError("mergeable_ranks assigns the same id to two tokens")
        clash = regular_ids.intersection(special_tokens.values())
        if clash:
            raise ValueError(f"special ids {sorted(clash)[:5]} are also regular token ids")
        if len(set(special_tokens.values())) != len(special_tokens):
            raise ValueError("special_tokens assigns the same id to two names")
        if eos_token is None:
            eos_token = "<|end_of_msg|>" if "<|end_of_msg|>" in special_tokens else "[EOS]"
        for role, tok in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token), ("unk", unk_token),
                          ("eod", eod_token)):
            if tok not in special_tokens:
                raise ValueError(f"{role} token {tok!r} is not among the special tokens")
        self.name = name
        self.pat_str = pat_str
        self.mergeable_ranks = dict(mergeable_ranks)
        self.special_tokens = dict(special_tokens)
        self._special_names = {i: s for s, i in self.special_tokens.items()}
        self._id_to_bytes = {i: b for b, i in self.mergeable_ranks.items()}
        self._enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=self.mergeable_ranks,
                                      special_tokens=self.special_tokens)
        longest_first = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(s) for s in longest_first))
        self.vocab_size = max(max(regular_ids), max(special_tokens.values(), default=-1)) + 1
        self.num_regular_tokens = len(mergeable_ranks)
        self.bos_token, self.eos_token, self.pad_token, self.unk_token, self.eod_token = \
            bos_token, eos_token, pad_token, unk_token, eod_token
        self.bos_token_id = self.special_tokens[bos_token]
        self.eos_token_id = self.special_tokens[eos_token]
        self.pad_token_id = self.special_tokens[pad_token]
        self.unk_token_id = self.special_tokens[unk_token]
        self.eod_token_id = self.special_tokens[eod_token]

    # ---- encoding / decoding ------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text` (no BOS/EOS added). Special-token text becomes its special id only with
        `allow_special=True`; otherwise it is ordinary text."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        if not allow_special:
            return self._encode_ordinary(text)
        out, pos = [], 0
        for m in self._special_re.finditer(text):
            out += self._encode_ordinary(text[pos:m.start()])
            out.append(self.special_tokens[m.group()])
            pos = m.end()
        out += self._encode_ordinary(text[pos:])
        return out

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False, num_threads: int = 2) -> list[list[int]]:
        """`encode` of many texts; ordinary short texts go through tiktoken's threaded batch encoder."""
        if allow_special or any(len(t) > MAX_RUN_CHARS for t in texts):
            return [self.encode(t, allow_special) for t in texts]
        return self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def _encode_ordinary(self, text: str) -> list[int]:
        if len(text) <= MAX_RUN_CHARS:
            return self._enc.encode_ordinary(text)
        out: list[int] = []
        for i in range(0, len(text), MAX_ENCODE_CHARS):
            chunk = text[i:i + MAX_ENCODE_CHARS]
            for piece in (_split_long_runs(chunk) if _LONG_RUN.search(chunk) else (chunk,)):
                out += self._enc.encode_ordinary(piece)
        return out

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """The bytes of `ids`; special ids contribute their names' UTF-8 (or nothing with `skip_special`)."""
        parts = []
        for i in _as_ints(ids):
            b = self._id_to_bytes.get(i)
            if b is None:
                name = self._special_names.get(i)
                if name is None:
                    raise ValueError(f"token id {i} is not in this tokenizer (vocab_size {self.vocab_size}; "
                                     f"{self.num_regular_tokens} regular ids, specials from "
                                     f"{min(self._special_names)})")
                if skip_special:
                    continue
                b = name.encode("utf-8")
            parts.append(b)
        return b"".join(parts)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; byte sequences that are not valid UTF-8 (e.g. a cut multi-byte char) become U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        """The bytes one id stands for (a special id: its name's UTF-8)."""
        return self.decode_bytes([i])

    def is_special(self, i: int) -> bool:
        return int(i) in self._special_names

    # ---- vocabulary -------------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int:
        """Id of a special-token name, or of a regular token written in GPT-2 byte-level form (as HF does)."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        u2b = _unicode_to_byte()
        try:
            b = bytes(u2b[c] for c in token)
        except KeyError:
            raise ValueError(f"token {token!r} is neither a special token nor a byte-level token string") from None
        if b not in self.mergeable_ranks:
            raise ValueError(f"token {token!r} (bytes {b!r}) is not in the vocabulary")
        return self.mergeable_ranks[b]

    def id_to_token(self, i: int) -> str:
        """Special name, or the regular token's bytes in GPT-2 byte-level form (the inverse of token_to_id)."""
        i = int(i)
        if i in self._special_names:
            return self._special_names[i]
        if i not in self._id_to_bytes:
            raise ValueError(f"token id {i} is not in this tokenizer (vocab_size {self.vocab_size})")
        b2u = _byte_to_unicode()
        return "".join(b2u[b] for b in self._id_to_bytes[i])

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"K3Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, regular={self.num_regular_tokens}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_id}, pad={self.pad_token_id})")

    # ---- files --------------------------------------------------------------------------------------------
    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write `tiktoken.model` and `tokenizer_config.json` (the release's format) into directory `path`."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        by_rank = sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])
        lines = [f"{base64.b64encode(b).decode('ascii')} {r}\n" for b, r in by_rank]
        atomic_write(d / "tiktoken.model", "".join(lines))
        cfg = {
            "tokenizer_class": "TikTokenTokenizer",
            "bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                              "single_word": False, "special": True}
                                     for s, i in sorted(self.special_tokens.items(), key=lambda kv: kv[1])},
            "k3_tokenizer": {"name": self.name, "pat_str": self.pat_str, "eod_token": self.eod_token,
                             "vocab_size": self.vocab_size},
        }
        atomic_write(d / "tokenizer_config.json", json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "K3Tokenizer":
        """Load a directory holding `tiktoken.model` (+ `tokenizer_config.json`): a real K2/K3 checkpoint
        or one written by `save_pretrained`. Offline; reads only those two files.

        Release files: the special ids run from the smallest to the largest id in `added_tokens_decoder`
        (the 256 ids after the regular ones, as in the release, when it lists none); unnamed slots become
        `<|reserved_token_{id}|>`. Files from `save_pretrained` list every special id.
        """
        d = Path(path)
        model = d / "tiktoken.model"
        if not model.is_file():
            raise FileNotFoundError(f"{d}: no tiktoken.model (expected a K3 checkpoint or tokenizer directory)")
        ranks = _read_tiktoken_model(model)
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        extra = cfg.get("k3_tokenizer", {})
        n_base = max(ranks.values()) + 1
        named: dict[int, str] = {}
        for k, v in (cfg.get("added_tokens_decoder") or {}).items():
            content = v.get("content") if isinstance(v, dict) else v
            if not isinstance(content, str):
                raise ValueError(f"{cfg_path}: added_tokens_decoder[{k!r}] has no string 'content'")
            named[int(k)] = content
        below = [i for i in named if i < n_base]
        if below:
            raise ValueError(f"{cfg_path}: special ids {sorted(below)[:5]} collide with tiktoken.model ranks "
                             f"(which run to {n_base - 1})")
        if extra:  # written by save_pretrained: every special is listed
            specials = {name: i for i, name in named.items()}
        else:  # a release: the block [first special, last special] with unnamed slots reserved
            start = min(named) if named else n_base
            end = max(named) + 1 if named else n_base + K3_NUM_RESERVED_SPECIAL
            specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(start, end)}

        def role(key: str, default: str | None) -> str | None:
            v = cfg.get(key, default)
            if isinstance(v, dict):  # HF AddedToken serialisation
                v = v.get("content")
            return v if v is not None else default

        if extra:  # written by save_pretrained: the roles are exactly as saved
            eos = role("eos_token", "<|end_of_msg|>")
        else:  # a release: K3's eos is <|end_of_msg|> (the config's eos_token_id), whatever the file says
            eos = "<|end_of_msg|>" if "<|end_of_msg|>" in specials else role("eos_token", "[EOS]")
        return cls(ranks, specials, pat_str=extra.get("pat_str", K3_PAT_STR), name=extra.get("name", d.name or "k3"),
                   bos_token=role("bos_token", "[BOS]"), eos_token=eos, pad_token=role("pad_token", "[PAD]"),
                   unk_token=role("unk_token", "[UNK]"), eod_token=extra.get("eod_token", "[EOS]"))


def _as_ints(ids) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


def _split_long_runs(text: str) -> list[str]:
    """Cut `text` so no piece holds a run of more than MAX_RUN_CHARS whitespace or non-whitespace chars."""
    pieces, start, run, prev_space = [], 0, 0, None
    for i, c in enumerate(text):
        sp = c.isspace()
        run = run + 1 if sp == prev_space else 1
        prev_space = sp
        if run > MAX_RUN_CHARS:
            pieces.append(text[start:i])
            start, run = i, 1
    pieces.append(text[start:])
    return pieces


def _read_tiktoken_model(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:80]!r}")
            try:
                tok, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, base64.binascii.Error):
                raise ValueError(f"{path}:{lineno}: bad base64 token or rank in {line[:80]!r}") from None
            if tok in ranks:
                raise ValueError(f"{path}:{lineno}: token {tok!r} listed twice")
            ranks[tok] = rank
    if not ranks:
        raise ValueError(f"{path}: empty tiktoken.model")
    return ranks


# ---- training -------------------------------------------------------------------------------------------
def _check_layout(config: "K3TextConfig") -> None:
    bos, eos, pad, v = config.bos_token_id, config.eos_token_id, config.pad_token_id, config.vocab_size
    if bos < 512:
        raise ValueError(f"bos_token_id {bos} leaves fewer than 512 regular ids; "
                         "byte-level BPE needs the 256 bytes plus merges")
    k3_special_tokens(bos, v)  # validates the block size
    if eos != bos + K3_SPECIAL_OFFSETS["<|end_of_msg|>"] or pad != v - 1:
        raise ValueError(f"config token ids (bos {bos}, eos {eos}, pad {pad}, vocab {v}) do not follow the K3 layout: "
                         f"expected eos = bos + 2 = {bos + 2} (<|end_of_msg|>) and pad = vocab_size - 1 = {v - 1}")


def train_bpe(texts: Iterable[str], config: "K3TextConfig", *, min_frequency: int = 2,
              name: str = "k3-bpe") -> K3Tokenizer:
    """Train a byte-level BPE with HF `tokenizers` (K3's pre-tokenisation pattern) for `config`'s layout:
    regular ids 0 … bos_token_id-1 (the 256 bytes at their byte values, then merges in merge order) and
    the K3 special block from bos_token_id. Deterministic for the same texts. If the texts are too small to
    learn that many merges, the unused regular ids stay empty (decoding them is an error)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    _check_layout(config)
    n_regular = config.bos_token_id
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(K3_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=n_regular, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    u2b = _unicode_to_byte()
    ranks = {bytes([b]): b for b in range(256)}
    for m in merges:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        t = bytes(u2b[c] for c in a + b)
        if t not in ranks and len(ranks) < n_regular:
            ranks[t] = len(ranks)
    return K3Tokenizer(ranks, k3_special_tokens(config.bos_token_id, config.vocab_size), name=name)


DEFAULT_TRAIN_BYTES = 3_000_000


def default_cache_dir() -> Path:
    return Path(os.environ.get("K3_CACHE_DIR", Path.home() / ".cache" / "k3")) / "tokenizers"


def default_tokenizer(config: "K3TextConfig", cache_dir: str | os.PathLike | None = None,
                      train_bytes: int = DEFAULT_TRAIN_BYTES) -> K3Tokenizer:
    """The tokenizer for `config` trained on the first `train_bytes` of the built-in corpus's train split,
    cached under `cache_dir/<hash>` (default `~/.cache/k3/tokenizers`, or `$K3_CACHE_DIR/tokenizers`).
    The hash covers the layout, the training text and the format version, so a different Python (hence a
    different corpus) gets its own entry. Concurrent callers are safe: the entry appears atomically."""
    from ..data.corpus import builtin_corpus

    _check_layout(config)
    texts = [d.text for d in builtin_corpus(max_bytes=train_bytes, split="train")]
    h = hashlib.sha256(json.dumps([_TOKENIZER_FORMAT, config.vocab_size, config.bos_token_id,
                                   config.eos_token_id, config.pad_token_id]).encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode("utf-8")).digest())
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = root / h.hexdigest()[:16]
    if (entry / "tiktoken.model").is_file() and (entry / "tokenizer_config.json").is_file():
        return K3Tokenizer.from_pretrained(entry)
    tok = train_bpe(texts, config, name=f"k3-builtin-{config.vocab_size}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{entry.name}."))
    try:
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:  # another process won the race: its entry is identical
            if not (entry / "tiktoken.model").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return K3Tokenizer.from_pretrained(entry)


# ---- incremental detokenization ---------------------------------------------------------------------------
def safe_decode(tokenizer, ids: Sequence[int]) -> str:
    """`tokenizer.decode(ids)`, leaving out ids the tokenizer cannot decode (e.g. regular ids a small trained
    BPE left empty, which an untrained model may still sample) instead of raising."""
    try:
        return tokenizer.decode(ids)
    except (ValueError, KeyError):
        ok = []
        for i in ids:
            try:
                tokenizer.decode([i])
            except (ValueError, KeyError):
                continue
            ok.append(i)
        return tokenizer.decode(ok)


def decode_stable(tokenizer, ids: list[int], final: bool = False) -> tuple[str, list[int]]:
    """(text, held ids): the text of `ids` except a tail of at most 3 ids that ends in an incomplete UTF-8
    sequence, which is held back for the next call (everything is emitted when `final`)."""
    if not ids:
        return "", []
    text = safe_decode(tokenizer, ids)
    if final or not text.endswith("\ufffd"):
        return text, []
    for k in range(1, min(3, len(ids) - 1) + 1):
        head = safe_decode(tokenizer, ids[:-k])
        if not head.endswith("\ufffd"):
            return head, list(ids[-k:])
    return ("", list(ids)) if len(ids) < 4 else (text, [])
