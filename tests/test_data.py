"""Data pipeline: built-in corpus, streaming readers, packing (coverage, labels, doc_lens), exact resume,
data-parallel sharding, collation, and the synthetic long-context task."""

import itertools
import json
import random

import numpy as np
import pytest
import torch

from k3.config import K3Config
from k3.data import sources as src_mod
from k3.data.corpus import builtin_corpus
from k3.data.longctx import LongContextTask, answer_accuracy, evaluate
from k3.data.packing import IGNORE_INDEX, Mixture, PackedDataset, collate
from k3.data.sources import Document, expand_paths, open_sources
from k3.io.tokenizer import default_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return default_tokenizer(K3Config.preset("k3-tiny").text_config, cache_dir=tmp_path_factory.mktemp("tok"))


def random_docs(n: int, seed: int, max_len: int = 400) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcdefghij klmnop\nQRSTU 0123 é中🙂<|open|>"
    docs = []
    for i in range(n):
        L = rng.choice([0, 1, 3, rng.randrange(max_len), rng.randrange(4 * max_len)])
        docs.append("".join(rng.choice(alphabet) for _ in range(L)))
    return docs


def expected_stream(tok, docs):
    """Oracle: the token stream and per-token document index of docs packed in order (empty docs skipped)."""
    toks, ids = [], []
    for j, d in enumerate(docs):
        if d:
            t = [tok.bos_token_id, *tok.encode(d), tok.eod_token_id]
            toks += t
            ids += [j] * len(t)
    return np.array(toks), np.array(ids)


def check_rows(rows, tok, docs, T):
    """Every row against the oracle: inputs, labels (−100 exactly across documents and on padding), doc_lens."""
    S, D = expected_stream(tok, docs)
    n = len(S)
    assert len(rows) == -(-n // (T + 1)) - (1 if n % (T + 1) == 1 else 0)
    for k, r in enumerate(rows):
        lo = k * (T + 1)
        seg = S[lo:lo + T + 1]
        did = D[lo:lo + T + 1]
        m = len(seg)
        if m < T + 1:  # final padded row
            did = np.concatenate([did, np.full(T + 1 - m, -1)])
            seg = np.concatenate([seg, np.full(T + 1 - m, tok.pad_token_id)])
        assert r["input_ids"].tolist() == seg[:T].tolist()
        same = (did[1:] == did[:-1]) & (did[1:] >= 0)
        want = np.where(same, seg[1:], IGNORE_INDEX)
        assert r["labels"].tolist() == want.tolist()
        runs = [len(list(g)) for _, g in itertools.groupby(did[:T].tolist())]
        assert r["doc_lens"].tolist() == runs and sum(runs) == T


@pytest.mark.parametrize("T", [1, 7, 64, 333])
def test_packing_covers_every_token_once(tok, T):
    docs = random_docs(60, seed=T)
    rows = list(PackedDataset(docs, tok, T, shuffle_buffer=1, loop=False))
    check_rows(rows, tok, docs, T)


def test_shuffle_is_a_permutation_and_deterministic(tok):
    docs = random_docs(50, seed=3)
    mk = lambda seed: list(PackedDataset(docs, tok, 32, seed=seed, shuffle_buffer=16, loop=False))  # noqa: E731
    a, b, c = mk(0), mk(0), mk(1)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b)) and len(a) == len(b)
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))
    # the documents recovered from the shuffled rows are exactly the corpus's, in another order
    got = _split_docs(a, tok)
    want = [[tok.bos_token_id, *tok.encode(d), tok.eod_token_id] for d in docs if d]
    assert sorted(map(tuple, got)) == sorted(map(tuple, want)) and got != want


def _split_docs(rows, tok):
    """Documents in the rows of one finished (loop=False) pass. A row's last token is its last label, or,
    where that label is −100, a fresh [BOS] (in the final row: padding)."""
    stream = []
    for k, r in enumerate(rows):
        stream += r["input_ids"].tolist()
        last = int(r["labels"][-1])
        stream.append(last if last != IGNORE_INDEX else (tok.pad_token_id if k == len(rows) - 1 else tok.bos_token_id))
    docs = []
    for t in stream:
        if t == tok.bos_token_id:
            docs.append([t])
        elif t != tok.pad_token_id:
            docs[-1].append(t)
    return docs


@pytest.mark.parametrize("stop", [0, 1, 5, 17, 40, 83])
def test_exact_resume(tok, stop):
    docs = random_docs(30, seed=11, max_len=40)  # small corpus: 100 rows run through several epochs and windows
    kw = dict(seed=5, shuffle_buffer=7, loop=True)
    ref = list(itertools.islice(iter(PackedDataset(docs, tok, 48, **kw)), 100))
    ds = PackedDataset(docs, tok, 48, **kw)
    it = iter(ds)
    head = list(itertools.islice(it, stop))
    sd = ds.state_dict()
    buf = __import__("io").BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = PackedDataset(docs, tok, 48, **kw)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    tail = list(itertools.islice(iter(fresh), 100 - stop))
    for a, b in zip(head + tail, ref):
        for key in ("input_ids", "labels", "doc_lens"):
            assert torch.equal(a[key], b[key])
    assert fresh.epoch >= 2  # the run crossed epoch boundaries


def test_resume_non_looping_end_and_seq_len_change(tok):
    docs = random_docs(20, seed=2)
    ds = PackedDataset(docs, tok, 40, shuffle_buffer=4, loop=False)
    rows = list(ds)
    again = PackedDataset(docs, tok, 40, shuffle_buffer=4, loop=False)
    again.load_state_dict(ds.state_dict())
    assert list(again) == []  # a finished pass stays finished
    # a curriculum may change seq_len: the carried tokens open the first longer row
    a = PackedDataset(docs, tok, 40, shuffle_buffer=4)
    list(itertools.islice(iter(a), 3))
    sd = a.state_dict()
    b = PackedDataset(docs, tok, 97, shuffle_buffer=4)
    b.load_state_dict(sd)
    first = next(iter(b))
    m = min(97, len(sd["carry"]))
    assert m > 0 and first["input_ids"][:m].tolist() == sd["carry"][:m].tolist()
    bad = PackedDataset(docs, tok, 40, shuffle_buffer=5)
    with pytest.raises(ValueError, match="shuffle_buffer"):
        bad.load_state_dict(sd)
    assert len(rows) > 3


def test_sharding_disjoint_and_complete(tok):
    docs = random_docs(41, seed=9)
    ws = 3
    for r in range(ws):
        rows = list(PackedDataset(docs, tok, 50, rank=r, world_size=ws, shuffle_buffer=1, loop=False))
        check_rows(rows, tok, [d if i % ws == r else "" for i, d in enumerate(docs)], 50)
    # with shuffling too: the ranks' documents partition the corpus
    got = []
    for r in range(ws):
        rows = list(PackedDataset(docs, tok, 50, rank=r, world_size=ws, seed=1, shuffle_buffer=8, loop=False))
        got += _split_docs(rows, tok)
    want = [[tok.bos_token_id, *tok.encode(d), tok.eod_token_id] for d in docs if d]
    assert sorted(map(tuple, got)) == sorted(map(tuple, want))
    with pytest.raises(ValueError, match="no documents"):
        next(iter(PackedDataset(["only one"], tok, 8, rank=1, world_size=2)))
    with pytest.raises(ValueError, match="every document is empty"):
        next(iter(PackedDataset(["", ""], tok, 8)))


def test_collate_cu_seqlens(tok):
    docs = random_docs(25, seed=4)
    rows = list(itertools.islice(iter(PackedDataset(docs, tok, 64, shuffle_buffer=1)), 5))
    b = collate(rows)
    assert b["input_ids"].shape == (5, 64) and b["labels"].shape == (5, 64)
    cu = b["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 5 * 64
    assert set(range(0, 5 * 64 + 1, 64)) <= set(cu.tolist())  # every row boundary is a boundary
    lens = torch.cat([r["doc_lens"] for r in rows])
    assert torch.equal(cu[1:].long() - cu[:-1].long(), lens) and bool((lens > 0).all())
    # a label is −100 exactly where the next token lies in another cu_seqlens segment, or is a fresh BOS
    flat_lab = b["labels"].flatten()
    ends = set((cu[1:] - 1).tolist())
    for t in range(5 * 64):
        if t not in ends:
            assert flat_lab[t] != IGNORE_INDEX
    with pytest.raises(ValueError, match="doc_lens"):
        collate([{**rows[0], "doc_lens": torch.tensor([3])}])


def test_builtin_corpus():
    a, b = builtin_corpus(), builtin_corpus()
    assert [d.source for d in a] == [d.source for d in b]
    names = [d.source for d in a]
    assert len(set(names)) == len(names)
    tr, va = builtin_corpus(split="train"), builtin_corpus(split="validation")
    assert {d.source for d in tr}.isdisjoint({d.source for d in va}) and len(tr) + len(va) == len(a)
    assert 0.01 < len(va) / len(a) < 0.08
    assert any(n.startswith("pydoc_data/topics.py#") for n in names) and any(n.endswith(".py") for n in names)
    assert not any("/test/" in n or "site-packages" in n for n in names)
    small = builtin_corpus(max_bytes=100_000, split="train")
    assert [d.source for d in small] == [d.source for d in tr[:len(small)]]
    assert sum(len(d.text.encode()) for d in small[:-1]) < 100_000 <= sum(len(d.text.encode()) for d in small)


def _write_parquet(path, texts, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=row_group_size)


def test_sources_formats_and_order(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("plain text file\nline 2")
    with open(tmp_path / "d" / "b.jsonl", "w") as fh:
        for i in range(5):
            fh.write(json.dumps({"text": f"json doc {i}", "meta": i}) + "\n")
        fh.write("\n")
    _write_parquet(tmp_path / "d" / "c.parquet", [f"parquet row {i}" for i in range(10)], 3)
    (tmp_path / "d" / "ignored.bin").write_bytes(b"\x00")
    docs = list(open_sources(tmp_path / "d"))
    assert [d.text for d in docs] == ["plain text file\nline 2"] + [f"json doc {i}" for i in range(5)] + \
        [f"parquet row {i}" for i in range(10)]
    assert docs[1].source.endswith("b.jsonl:1") and docs[-1].source.endswith("c.parquet#9")
    assert [d.text for d in open_sources(str(tmp_path / "d" / "*.jsonl"))] == [f"json doc {i}" for i in range(5)]
    with pytest.raises(FileNotFoundError):
        expand_paths(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="unknown type"):
        expand_paths(tmp_path / "d" / "ignored.bin")


def test_sources_stream(tmp_path, monkeypatch):
    # JSONL: a bad line far down the file is only hit when reached
    p = tmp_path / "x.jsonl"
    p.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(3)) + '{"no_text": 1}\n')
    it = open_sources(p)
    assert [next(it).text for _ in range(3)] == ["t0", "t1", "t2"]
    with pytest.raises(ValueError, match=r"x.jsonl:4: .*'text'"):
        next(it)
    # Parquet: reading the first document pulls one record batch, not the file
    q = tmp_path / "y.parquet"
    _write_parquet(q, [f"row {i}" for i in range(5000)], 1000)
    import pyarrow.parquet as pq

    pulled = []
    orig = pq.ParquetFile.iter_batches

    def counting(self, *a, **k):
        for batch in orig(self, *a, **k):
            pulled.append(batch.num_rows)
            yield batch
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counting)
    it = src_mod.read_parquet(q, batch_rows=256)
    assert next(it).text == "row 0" and pulled == [256]
    assert sum(1 for _ in it) == 4999 and sum(pulled) == 5000
    with pytest.raises(ValueError, match="no column 'body'"):
        next(src_mod.read_parquet(q, text_field="body"))


def test_sources_split(tmp_path):
    with open(tmp_path / "x.jsonl", "w") as fh:
        for i in range(400):
            fh.write(json.dumps({"text": f"doc {i}"}) + "\n")
    alld = list(open_sources(tmp_path, validation_percent=10))
    tr = [d.text for d in open_sources(tmp_path, split="train", validation_percent=10)]
    va = [d.text for d in open_sources(tmp_path, split="validation", validation_percent=10)]
    assert sorted(tr + va) == sorted(d.text for d in alld) and not set(tr) & set(va)
    assert 15 <= len(va) <= 70 and [d.text for d in alld if d.split == "validation"] == va
    with pytest.raises(ValueError, match="split"):
        next(open_sources(tmp_path, split="test"))


def test_packing_from_sources(tok, tmp_path):
    _write_parquet(tmp_path / "c.parquet", [f"parquet row {i} " * (i % 7) for i in range(40)], 8)
    factory = lambda: open_sources(tmp_path / "c.parquet")  # noqa: E731
    rows = list(PackedDataset(factory, tok, 32, shuffle_buffer=1, loop=False))
    check_rows(rows, tok, [d.text for d in factory()], 32)


# ---- long-context task ---------------------------------------------------------------------------------

def test_longctx_format_and_labels(tok):
    task = LongContextTask(tok, 700, seed=3, n_facts=12, hops=3)
    for i in range(6):
        s, spec = task.sample(i), task.spec(i)
        assert s["input_ids"].shape == (700,) and s["labels"].shape == (700,) and s["doc_lens"].tolist() == [700]
        assert s["input_ids"][0] == tok.bos_token_id
        lab = s["labels"]
        assert torch.equal(lab != IGNORE_INDEX, s["answer_mask"])
        assert tok.decode(lab[lab != IGNORE_INDEX]) == spec.answer
        text = tok.decode(s["input_ids"])
        assert text.rstrip().endswith(spec.question + spec.answer)
        assert all(f.text in text for f in spec.facts)
    same = LongContextTask(tok, 700, seed=3, n_facts=12, hops=3)
    assert torch.equal(task.sample(4)["input_ids"], same.sample(4)["input_ids"])
    assert not torch.equal(task.sample(4)["input_ids"], task.sample(5)["input_ids"])
    full = LongContextTask(tok, 700, seed=3, n_facts=12, hops=3, label_mode="all").sample(0)
    assert torch.equal(full["labels"][:-1], full["input_ids"][1:])
    assert {task.spec(i).kind for i in range(10)} == {"kv", "chain"}
    with pytest.raises(ValueError, match="too short"):
        LongContextTask(tok, 60, n_facts=12)


def _follow(spec):
    """Solve a spec from its fact texts alone (an independent reader of the generated facts)."""
    val, ptr = {}, {}
    for f in spec.facts:
        w = f.text.rstrip(".").split()
        if w[0] == "The":
            val[w[4]] = w[6]
        else:
            ptr[w[0]] = w[3]
    q = spec.question.split()
    k = q[q.index("key") + 1].rstrip("?")
    while k in ptr:
        k = ptr[k]
    return " " + val[k]


def test_longctx_answer_depends_on_distant_facts(tok):
    T = 2000
    task = LongContextTask(tok, T, seed=0, n_facts=10, hops=2, needle_depth=(0.0, 0.15))
    for i in range(8):
        spec = task.spec(i)
        assert _follow(spec) == spec.answer
        s = task.sample(i)
        # the needed facts sit in the first ~15 % of the context, the question at the very end
        text = tok.decode(s["input_ids"])
        q_at = text.index(spec.question)
        for f in (f for f in spec.facts if f.needed):
            assert text.index(f.text) < 0.25 * q_at
        # changing the value in the (distant) needed fact changes the answer, and nothing but the two
        needed_val = next(f for f in spec.facts if f.needed and f.text.startswith("The value"))
        old = needed_val.text.split()[-1].rstrip(".")
        n_old = (len(tok.encode(" " + needed_val.text)), len(tok.encode(spec.answer)))
        new = next(v for v in map(str, range(1000, 10000)) if v != old and  # same token counts: aligned rows
                   (len(tok.encode(" " + needed_val.text.replace(old, v))), len(tok.encode(" " + v))) == n_old)
        needed_val.text = needed_val.text.replace(old, new)
        spec.answer = " " + new
        s2 = task.build(spec)
        assert tok.decode(s2["labels"][s2["labels"] != IGNORE_INDEX]) == " " + new
        diff = (s["input_ids"] != s2["input_ids"]).nonzero().flatten()
        ans = s2["answer_mask"].nonzero().flatten()
        far = diff[diff < ans[0]]
        assert len(far) > 0 and int(far.max()) < 0.3 * T  # the only context change is the early fact


def test_longctx_accuracy_helpers(tok):
    task = LongContextTask(tok, 300, seed=1, n_facts=4, hops=1)
    V = tok.vocab_size

    def oracle(input_ids, cu_seqlens):  # perfect next-token logits (peeks at the answer)
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1)
        return torch.nn.functional.one_hot(nxt, V).float()

    assert evaluate(oracle, task, n=6, batch_size=4) == {"exact_match": 1.0, "token_accuracy": 1.0}
    s = [task.sample(i) for i in range(2)]
    x = torch.stack([a["input_ids"] for a in s])
    mask = torch.stack([a["answer_mask"] for a in s])
    logits = oracle(x, None)
    pos = int(mask[1].nonzero()[-1])
    logits[1, pos] = logits[1, pos].roll(1)  # break the last answer token of sample 1
    r = answer_accuracy(logits, x, mask)
    assert r["exact_match"] == 0.5 and r["token_accuracy"] == 1 - 1 / int(mask.sum())
    # resume of the task iterator, and mixing with packed rows in one batch
    it = iter(task)
    [next(it) for _ in range(3)]
    t2 = LongContextTask(tok, 300, seed=1, n_facts=4, hops=1)
    t2.load_state_dict(task.state_dict())
    assert torch.equal(next(iter(t2))["input_ids"], next(it)["input_ids"])
    packed = next(iter(PackedDataset(random_docs(10, 0), tok, 300)))
    b = collate([packed, task.sample(0)])
    assert b["input_ids"].shape == (2, 300) and b["cu_seqlens"][-1] == 600


def test_document_type():
    d = Document("x", "src")
    assert d.split == "train"
    with pytest.raises(TypeError):
        list(PackedDataset([3], None, 4))


def test_mixture_exact_resume(tok):
    docs = random_docs(20, seed=6, max_len=80)

    def make():
        return Mixture([PackedDataset(docs, tok, 256, seed=2, shuffle_buffer=5),
                        LongContextTask(tok, 256, seed=4, n_facts=3, hops=1)], [0.7, 0.3], seed=8)

    ref = list(itertools.islice(iter(make()), 30))
    m = make()
    head = list(itertools.islice(iter(m), 13))
    m2 = make()
    m2.load_state_dict(m.state_dict())
    tail = list(itertools.islice(iter(m2), 17))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
               for a, b in zip(head + tail, ref))
    kinds = ["answer_mask" in r for r in ref]
    assert 3 <= sum(kinds) <= 20  # both sources used
    assert collate(ref[:4])["input_ids"].shape == (4, 256)


def test_labels_agree_with_model_varlen_convention(tok):
    """Our shifted labels match what the model's packed loss derives from input_ids and cu_seqlens."""
    from k3.ops.varlen import doc_ids, row_aligned

    rows = list(itertools.islice(iter(PackedDataset(random_docs(40, seed=8), tok, 96, shuffle_buffer=3)), 6))
    b = collate(rows)
    B, T = b["input_ids"].shape
    assert row_aligned(b["cu_seqlens"], B, T)
    docs = doc_ids(b["cu_seqlens"], B, T)
    model_target = b["input_ids"][:, 1:].masked_fill(docs[:, 1:] != docs[:, :-1], IGNORE_INDEX)
    assert torch.equal(b["labels"][:, :-1], model_target)
