"""K3 tokenizer: special layout, round trips, special-token safety, the tiktoken-format loader, BPE training
and its on-disk cache, checked against a pure-Python BPE reference."""

import base64
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.config import K3Config
from k3.data.corpus import builtin_corpus
from k3.io import tokenizer as tkm
from k3.io.tokenizer import K3_PAT_STR, K3Tokenizer, default_tokenizer, k3_special_tokens, train_bpe

NAMED = {"[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5,
         "<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21}


@pytest.fixture(scope="module")
def cfg():
    return K3Config.preset("k3-tiny").text_config


@pytest.fixture(scope="module")
def tok(cfg, tmp_path_factory):
    return default_tokenizer(cfg, cache_dir=tmp_path_factory.mktemp("tokcache"))


def reference_bpe(tok: K3Tokenizer, text: str) -> list[int]:
    """Slow oracle: HF's Oniguruma pre-split (not tiktoken's regex engine), then textbook BPE — repeatedly
    merge the adjacent pair whose concatenation has the lowest rank."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(K3_PAT_STR), behavior="isolated")
    out = []
    for piece, _ in split.pre_tokenize_str(text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: tok.mergeable_ranks.get(parts[i] + parts[i + 1], 1 << 62))
            if parts[best] + parts[best + 1] not in tok.mergeable_ranks:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        out += [tok.mergeable_ranks[p] for p in parts]
    return out


def test_special_layout_tiny(tok, cfg):
    assert tok.vocab_size == cfg.vocab_size == 4096
    assert tok.bos_token_id == cfg.bos_token_id == 4000
    assert tok.eos_token_id == cfg.eos_token_id == 4002 == tok.token_to_id("<|end_of_msg|>")
    assert tok.pad_token_id == cfg.pad_token_id == 4095 == tok.token_to_id("[PAD]")
    assert tok.unk_token_id == 4094 and tok.eod_token_id == 4001
    for name, off in NAMED.items():
        assert tok.special_tokens[name] == 4000 + off
    assert tok.special_tokens["<|media_pad|>"] == K3Config.preset("k3-tiny").media_placeholder_token_id
    assert sorted(tok.special_tokens.values()) == list(range(4000, 4096))
    assert tok.id_to_token(4006) == "<|reserved_token_4006|>"
    assert max(tok.mergeable_ranks.values()) < 4000 and tok.num_regular_tokens == 4000


def test_special_layout_release():
    sp = k3_special_tokens(163584, 163840)
    assert len(sp) == 256
    assert {n: sp[n] - 163584 for n in NAMED} == NAMED
    assert sp["[UNK]"] == 163838 and sp["[PAD]"] == 163839 and sp["<|media_pad|>"] == 163605
    with pytest.raises(ValueError, match="special block"):
        k3_special_tokens(4000, 4010)


def test_round_trip_corpus(tok):
    docs = builtin_corpus(split="validation")
    text = "".join(d.text for d in docs[:6])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(text.encode()) / len(ids) > 2.5  # a trained BPE compresses (bytes per token)
    assert all(0 <= i < tok.bos_token_id for i in ids)


def test_matches_reference_bpe(tok):
    docs = builtin_corpus(split="validation")
    rng = random.Random(0)
    samples = [d.text[s:s + 3000] for d in docs[:8] for s in [rng.randrange(max(1, len(d.text) - 3000))]]
    samples.append("Unicode: 中文English混合 Ünïcödé café — naïve 𝔘𝔫𝔦 🙂 don't HTTPResponse 12345\r\n\t x")
    for s in samples:
        assert tok.encode(s) == reference_bpe(tok, s)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=300))
def test_round_trip_unicode(tok, s):
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert tok.decode_bytes(ids) == s.encode("utf-8")
    assert b"".join(tok.token_bytes(i) for i in ids) == s.encode("utf-8")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300))
def test_round_trip_bytes(tok, b):
    s = b.decode("utf-8", errors="replace")
    assert tok.decode(tok.encode(s)) == s


def test_specials_disallowed_by_default(tok):
    text = "user says <|open|>message role=\"system\"<|sep|> and [BOS]<|end_of_msg|>"
    ids = tok.encode(text)
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(ids) == text
    assert tok.special_tokens["<|open|>"] not in tok.encode("<|open|>")


def test_allow_special(tok):
    sp = tok.special_tokens
    ids = tok.encode("<|open|>message<|sep|>hi<|close|>message<|sep|><|end_of_msg|>", allow_special=True)
    assert ids == [sp["<|open|>"], *tok.encode("message"), sp["<|sep|>"], *tok.encode("hi"), sp["<|close|>"],
                   *tok.encode("message"), sp["<|sep|>"], sp["<|end_of_msg|>"]]
    assert tok.decode(ids) == "<|open|>message<|sep|>hi<|close|>message<|sep|><|end_of_msg|>"
    assert tok.decode(ids, skip_special=True) == "messagehimessage"
    assert tok.encode("<|reserved_token_4010|>", allow_special=True) == [4010]


def test_vocab_lookup_inverse(tok):
    for i in list(range(0, 4000, 7)) + list(range(4000, 4096)):
        assert tok.token_to_id(tok.id_to_token(i)) == i
    with pytest.raises(ValueError, match="not in this tokenizer"):
        tok.id_to_token(5000)
    with pytest.raises(ValueError, match="not in this tokenizer"):
        tok.decode([4096])


def test_long_runs_are_chunked(tok):
    s = "x" * 60_000 + " " * 30_000 + "end"
    assert tok.decode(tok.encode(s)) == s
    assert tkm._split_long_runs("a" * 25_001 + "b") == ["a" * 25_000, "ab"]


def test_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    t2 = K3Tokenizer.from_pretrained(tmp_path)
    assert t2.mergeable_ranks == tok.mergeable_ranks and t2.special_tokens == tok.special_tokens
    assert (t2.bos_token_id, t2.eos_token_id, t2.pad_token_id, t2.eod_token_id) == \
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.eod_token_id)
    s = "def f(x):\n    return x ** 2  # <|sep|>"
    assert t2.encode(s) == tok.encode(s)


def _write_release_dir(d, ranks: dict[bytes, int], n_base: int, full_decoder: bool):
    """A tokenizer directory in the release's format, written by hand (not by save_pretrained)."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "tiktoken.model", "w") as fh:
        for b, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            fh.write(f"{base64.b64encode(b).decode()} {r}\n")
    sp = k3_special_tokens(n_base, n_base + 256)
    if not full_decoder:  # only the named tokens: reserved slots must be filled in by the loader
        sp = {k: v for k, v in sp.items() if not k.startswith("<|reserved")}
    cfg = {"added_tokens_decoder": {str(i): {"content": n, "special": True} for n, i in sp.items()},
           "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
           "tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_tiktoken_loader_small(tok, tmp_path):
    # a small real BPE (first 600 ranks of ours) written in the release's file format
    ranks = {b: r for b, r in tok.mergeable_ranks.items() if r < 600}
    _write_release_dir(tmp_path, ranks, 600, full_decoder=True)
    t = K3Tokenizer.from_pretrained(tmp_path)
    assert t.num_regular_tokens == 600 and t.vocab_size == 856
    assert t.bos_token_id == 600 and t.eos_token_id == 602 and t.eod_token_id == 601 and t.pad_token_id == 855
    s = "class Foo:\n    def bar(self):  # 中文 <|open|>\n        return 42"
    ids = t.encode(s)
    assert ids == reference_bpe(t, s) and max(ids) < 600 and t.decode(ids) == s
    assert t.encode("<|open|>x", allow_special=True)[0] == 603


def test_tiktoken_loader_release_ids(tmp_path):
    # the full-size id layout: 163584 regular ranks, specials from 163584, reserved slots named by the loader
    rng = random.Random(1)
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < 163584:
        ranks.setdefault(rng.randbytes(rng.randint(2, 6)), len(ranks))
    _write_release_dir(tmp_path, ranks, 163584, full_decoder=False)
    t = K3Tokenizer.from_pretrained(tmp_path)
    assert t.vocab_size == 163840 and t.bos_token_id == 163584
    assert t.eos_token_id == 163586 and t.id_to_token(163586) == "<|end_of_msg|>"
    assert t.pad_token_id == 163839 and t.unk_token_id == 163838
    assert t.token_to_id("<|media_pad|>") == 163605 and t.id_to_token(163700) == "<|reserved_token_163700|>"
    s = "hello world"
    assert t.decode(t.encode(s)) == s


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        K3Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tiktoken.model").write_text("!!notbase64 0\n")
    with pytest.raises(ValueError, match=":1:"):
        K3Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(200)))
    with pytest.raises(ValueError, match="256"):
        K3Tokenizer.from_pretrained(tmp_path)


def test_train_deterministic_and_cached(cfg, tok, tmp_path, monkeypatch):
    texts = [d.text for d in builtin_corpus(max_bytes=300_000, split="train")]
    a, b = train_bpe(texts, cfg), train_bpe(texts, cfg)
    assert a.mergeable_ranks == b.mergeable_ranks
    # a second default_tokenizer on a fresh cache dir is identical; a third one is read from that cache
    t2 = default_tokenizer(cfg, cache_dir=tmp_path)
    assert t2.mergeable_ranks == tok.mergeable_ranks and t2.special_tokens == tok.special_tokens
    monkeypatch.setattr(tkm, "train_bpe", lambda *a, **k: pytest.fail("cache miss: retrained"))
    t3 = default_tokenizer(cfg, cache_dir=tmp_path)
    assert t3.mergeable_ranks == tok.mergeable_ranks
    assert len([p for p in tmp_path.iterdir()]) == 1


def test_bad_layout_rejected(cfg):
    bad = K3Config.preset("k3-tiny").text_config
    bad.eos_token_id = 4001
    with pytest.raises(ValueError, match="K3 layout"):
        train_bpe(["abc"], bad)


def test_small_training_text_leaves_unused_ids(cfg, tmp_path):
    t = train_bpe(["hello world, hello there"] * 5, cfg)
    assert 256 < t.num_regular_tokens < 300 and t.vocab_size == 4096 and len(t.special_tokens) == 96
    t.save_pretrained(tmp_path)
    t2 = K3Tokenizer.from_pretrained(tmp_path)
    assert t2.special_tokens == t.special_tokens and t2.mergeable_ranks == t.mergeable_ranks
    with pytest.raises(ValueError, match="not in this tokenizer"):
        t2.decode([3000])
    s = "hello world 🙂"
    assert t2.decode(t2.encode(s)) == s and len(t2.encode("hello world")) < len(b"hello world")
