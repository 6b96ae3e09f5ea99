"""Tests of benchctl.core.data: sources, the llama2.c tokenizer recipe, pretokenized layout, the cache, the samplers,
and `benchctl prepare` through the CLI. Everything runs at the `tiny` scale (vocab 512) on small files in tmp_path;
real TinyStories text is used when $BENCHCTL_TEST_DATA names it."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchctl.core import data, sources
from benchctl.core.config import DataConfig, make_config
from benchctl.core.errors import CheckpointError, ConfigError, DataError
from tests.conftest import real_tinystories

VOCAB = 512  # the tiny preset's

_WORDS = (
    "the a little big happy sad dog cat girl boy named Lily Tom Sue Max park tree ball sun moon sky red blue green "
    "ran jumped played saw found wanted said smiled laughed cried looked went came home mom dad friend friends toy "
    "box cake bird fish water rain snow day night once upon time there was were they she he it and but so then "
    "very together because after before every morning garden flower bright warm cold quick slow kind brave"
).split()


def synthetic_stories(n: int, seed: int) -> list[str]:
    """Story-like text with enough distinct words for a 512-piece BPE (used when the shared sample is absent)."""
    rng = random.Random(seed)
    stories = []
    for i in range(n):
        sentences = []
        for _ in range(rng.randint(3, 7)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
        stories.append(f"Story {i}: " + " ".join(sentences) + f' "Yes," said {rng.choice(_WORDS)}.')
    return stories


def write_txt(path: Path, stories: list[str]) -> None:
    path.write_text("".join(f"{s}\n<|endoftext|>\n" for s in stories), encoding="utf-8")


def write_jsonl(path: Path, stories: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in stories), encoding="utf-8")


def write_parquet(path: Path, stories: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": stories, "id": list(range(len(stories)))}), path)


def make_dir(root: Path, fmt: str = "txt", n_train: int = 300, n_valid: int = 60, names=("train", "valid")) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    writer = {"txt": write_txt, "jsonl": write_jsonl, "parquet": write_parquet}[fmt]
    writer(root / f"{names[0]}.{fmt}", synthetic_stories(n_train, seed=1))
    writer(root / f"{names[1]}.{fmt}", synthetic_stories(n_valid, seed=2))
    return root


def tiny_data(source: Path | str, **kw) -> DataConfig:
    base = dict(source=str(source), tokenizer_stories=200, max_train_stories=None, max_valid_stories=None)
    return DataConfig(**{**base, **kw})


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BENCHCTL_DATA", raising=False)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def real_prepared(tmp_path_factory) -> data.Prepared:
    """The tiny preset's data from the real TinyStories sample (or synthetic stories when it is absent)."""
    src = real_tinystories() or make_dir(tmp_path_factory.mktemp("src"), n_train=2000)
    mp = pytest.MonkeyPatch()
    mp.setenv("BENCHCTL_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        cfg = make_config("tiny", overrides={"data.source": str(src)})
        return data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
    finally:
        mp.undo()


# --------------------------------------------------------------------------------------------------------------------
# Sources


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_formats_give_the_same_stories(tmp_path, fmt):
    src = make_dir(tmp_path / fmt, fmt)
    assert data.read_stories(str(src), "train") == synthetic_stories(300, seed=1)
    assert data.read_stories(str(src), "valid") == synthetic_stories(60, seed=2)
    assert data.read_stories(str(src), "train", limit=7) == synthetic_stories(7, seed=1)  # first N, in order


def test_stories_are_stripped_and_empty_entries_dropped(tmp_path):
    (tmp_path / "train.txt").write_text(
        "\n  One.  \n<|endoftext|>\n\n<|endoftext|>\n   \n<|endoftext|>\nTwo\nlines.\n", encoding="utf-8"
    )
    write_jsonl(tmp_path / "valid.jsonl", ["  a  ", "", "b"])
    with open(tmp_path / "valid.jsonl", "a") as f:
        f.write("\n" + json.dumps({"text": None}) + "\n")
    assert data.read_stories(str(tmp_path), "train") == ["One.", "Two\nlines."]
    assert data.read_stories(str(tmp_path), "valid") == ["a", "b"]


def test_txt_stories_split_across_read_chunks(tmp_path, monkeypatch):
    # The txt reader streams in chunks; a separator cut in half by a chunk boundary must still split stories.
    stories = synthetic_stories(50, seed=3)
    write_txt(tmp_path / "train.txt", stories)
    monkeypatch.setattr(sources, "TXT_CHUNK", 7)
    got = list(sources._read_txt(tmp_path / "train.txt"))
    assert got == stories


def test_alternative_names_and_hub_shard_layout(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    write_txt(a / "TinyStories-train.txt", ["t1", "t2"])
    write_txt(a / "TinyStories-valid.txt", ["v1"])
    assert data.read_stories(str(a), "train") == ["t1", "t2"] and data.read_stories(str(a), "valid") == ["v1"]

    b = tmp_path / "b"
    (b / "data").mkdir(parents=True)
    write_parquet(b / "data" / "train-00000-of-00002.parquet", ["s1", "s2"])
    write_parquet(b / "data" / "train-00001-of-00002.parquet", ["s3"])
    write_parquet(b / "data" / "validation-00000-of-00001.parquet", ["v"])
    assert data.read_stories(str(b), "train") == ["s1", "s2", "s3"]
    assert data.read_stories(str(b), "train", limit=2) == ["s1", "s2"]
    assert data.read_stories(str(b), "valid") == ["v"]

    c = make_dir(tmp_path / "c", "jsonl", names=("train", "validation"))
    assert len(data.read_stories(str(c), "valid")) == 60


def _err(fn, *args) -> str:
    with pytest.raises(DataError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_source_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    assert str(missing) in _err(data.read_stories, str(missing), "train")
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert "is a file" in _err(data.read_stories, str(f), "train")
    d = make_dir(tmp_path / "novalid")
    (d / "valid.txt").unlink()
    msg = _err(data.read_stories, str(d), "valid")
    assert "no valid split" in msg and "valid.{txt,jsonl,parquet}" in msg
    write_jsonl(d / "valid.jsonl", ["x"])
    write_txt(d / "validation.txt", ["x"])
    msg = _err(data.read_stories, str(d), "valid")
    assert "valid.jsonl" in msg and "validation.txt" in msg


@pytest.mark.parametrize(
    "name, content, expect",
    [
        ("train.txt", b"", "holds no stories"),
        ("train.txt", b"\n<|endoftext|>\n  \n<|endoftext|>\n", "holds no stories"),
        ("train.txt", b"a story with no separator\nat all\n", "no <|endoftext|> separator"),
        ("train.txt", b"ok\n<|endoftext|>\nbad \xff byte\n<|endoftext|>\n", "line 3: not UTF-8"),
        ("train.jsonl", b"", "holds no stories"),
        ("train.jsonl", b'{"text": "fine"}\n{"text": "broken\n', "line 2: not valid JSON"),
        ("train.jsonl", b'{"text": "fine"}\n\n{"story": "x"}\n', "line 3: expected a JSON object with a 'text' field"),
        ("train.jsonl", b'{"text": 5}\n', "line 1: 'text' must be a string"),
        ("train.parquet", b"", "not a readable parquet file"),
        ("train.parquet", b"PAR1 this is not parquet", "not a readable parquet file"),
    ],
)
def test_empty_and_malformed_files_are_named(tmp_path, name, content, expect):
    (tmp_path / name).write_bytes(content)
    write_txt(tmp_path / "valid.txt", ["v"])
    msg = _err(data.read_stories, str(tmp_path), "train")
    assert str(tmp_path / name) in msg and expect in msg, msg


def test_parquet_without_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"story": ["a"]}), tmp_path / "train.parquet")
    write_txt(tmp_path / "valid.txt", ["v"])
    msg = _err(data.read_stories, str(tmp_path), "train")
    assert "train.parquet" in msg and "no 'text' column" in msg and "story" in msg


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_recipe(real_prepared):
    tok = real_prepared.tokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (VOCAB, 1, 2)
    assert tok._sp.unk_id() == 0 and tok._sp.pad_id() == -1
    ids = tok.encode("Once upon a time")
    assert ids[0] == 1 and 2 not in ids
    assert tok.encode("Once upon a time", bos=False, eos=True)[-1] == 2
    assert tok.encode("Once upon a time", bos=False) == ids[1:]
    assert tok.encode_batch(["a cat", "the dog ran"]) == [tok.encode("a cat"), tok.encode("the dog ran")]
    # byte fallback + identity normalization: anything round-trips exactly, no UNK, no NFKC folding
    for text in ["Zoë's naïve café ☃ 😀 日本語", "a tab\tand a\nnewline", "ﬁ ligature, full-width ＡＢＣ, \u3000!"]:
        assert tok.decode(tok.encode(text)) == text
        assert 0 not in tok.encode(text)
    # ...except runs of spaces: llama2.c keeps SentencePiece's default remove_extra_whitespaces, and so do we
    assert tok.decode(tok.encode("  two  spaces ")) == "two spaces"
    # split_digits: every digit is its own piece (a digit piece, or its byte when the digit is rare in the sample)
    pieces = tok._sp.encode("in 2024 she had 31337 toys", out_type=str)
    digit_bytes = {f"<0x{ord(d):02X}>": d for d in "0123456789"}
    digits = [digit_bytes.get(p, p) for p in pieces if p in digit_bytes or any(c.isdigit() for c in p)]
    assert digits == list("202431337")
    assert tok.decode(torch.tensor(tok.encode("ok"))) == "ok"
    import pickle

    assert pickle.loads(pickle.dumps(tok)).encode("cat") == tok.encode("cat")


def test_tokenizer_training_is_deterministic_and_reports_impossible_vocab(tmp_path):
    stories = synthetic_stories(300, seed=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ta = data.train_tokenizer(stories, VOCAB, tmp_path / "a", n_sample=200)
    tb = data.train_tokenizer(stories, VOCAB, tmp_path / "b", n_sample=200)
    pieces = lambda t: [t._sp.id_to_piece(i) for i in range(t.vocab_size)]  # noqa: E731
    assert pieces(ta) == pieces(tb)
    (tmp_path / "c").mkdir()
    with pytest.raises(DataError, match="tokenizer training failed.*Vocabulary size too high"):
        data.train_tokenizer(stories[:3], 4096, tmp_path / "c", n_sample=3)


# --------------------------------------------------------------------------------------------------------------------
# Pretokenized layout and manifest


def test_pretokenized_layout(tmp_path):
    src = make_dir(tmp_path / "src", "jsonl")
    p = data.prepare(tiny_data(src, max_valid_stories=50), VOCAB, progress=False)
    tok = p.tokenizer()
    train, valid = p.train_tokens(), p.valid_tokens()
    assert train.dtype == np.uint16 and isinstance(train, np.memmap)
    with pytest.raises(ValueError):
        train[0] = 5  # read-only
    stories = synthetic_stories(300, seed=1)
    expected = np.array([t for s in stories for t in [1] + tok.encode(s, bos=False)], dtype=np.uint16)
    np.testing.assert_array_equal(train, expected)
    assert (train == 1).sum() == p.n_train_stories == 300  # one BOS per story
    assert (train == 2).sum() == 0 and (valid == 2).sum() == 0  # no EOS
    assert p.n_valid_stories == 50 and (valid == 1).sum() == 50 and valid[0] == 1
    assert p.valid_stories() == synthetic_stories(50, seed=2)
    assert (p.n_train_tokens, p.n_valid_tokens) == (len(train), len(valid))
    m = json.loads((p.dir / "manifest.json").read_text())
    assert m["fingerprint"] == p.fingerprint and m["settings"]["tokenizer"]["byte_fallback"] is True
    assert m["source"] == str(src.resolve()) == p.source and m["tokenizer_sample"] == 200
    assert p.dir.parent == tmp_path / "cache" and p.dir.name.startswith(f"v{VOCAB}-")
    assert data.load_prepared(p.dir) == p


def test_real_sample_tiny_preset(real_prepared):
    if real_tinystories() is None:
        pytest.skip("the story and split counts are those of real TinyStories text: set $BENCHCTL_TEST_DATA")
    p = real_prepared
    assert (p.n_train_stories, p.n_valid_stories) == (2000, 400)
    stories = p.valid_stories()
    assert len(stories) == 400 and all(s == s.strip() and s for s in stories)
    assert stories[0].startswith(data.read_stories(str(real_tinystories()), "valid", limit=1)[0][:40])
    # about 2-4 characters per token at vocab 512 on children's stories
    assert 1.5 < sum(map(len, stories)) / p.n_valid_tokens < 5


# --------------------------------------------------------------------------------------------------------------------
# Cache


def test_cache_hit_is_instant_and_keys_follow_content(tmp_path, monkeypatch):
    src = make_dir(tmp_path / "src")
    cfg = tiny_data(src)
    first = data.prepare(cfg, VOCAB, progress=False)
    assert not first.cache_hit

    def no_rebuild(*a, **k):
        raise AssertionError("the cache should have been used")

    with monkeypatch.context() as m:
        # a hit neither trains a tokenizer nor encodes a story (what a timing bound would only suggest)
        m.setattr(data, "train_tokenizer", no_rebuild)
        m.setattr(data, "_pretokenize", no_rebuild)
        again = data.prepare(cfg, VOCAB, progress=False)
        assert again.cache_hit and again == first
        # the same bytes elsewhere are the same data (content fingerprint, not path)
        moved = make_dir(tmp_path / "elsewhere")
        assert data.prepare(tiny_data(moved), VOCAB, progress=False).fingerprint == first.fingerprint

    other_vocab = data.prepare(cfg, 600, progress=False)
    capped = data.prepare(tiny_data(src, max_train_stories=100), VOCAB, progress=False)
    fewer_tok = data.prepare(tiny_data(src, tokenizer_stories=100), VOCAB, progress=False)
    with open(src / "valid.txt", "a", encoding="utf-8") as f:
        f.write("One more story.\n<|endoftext|>\n")
    os.utime(src / "valid.txt", ns=(1, time.time_ns() + 10**9))  # a new mtime even on coarse clocks
    edited = data.prepare(cfg, VOCAB, progress=False)
    keys = {p.fingerprint for p in (first, other_vocab, capped, fewer_tok, edited)}
    dirs = {p.dir for p in (first, other_vocab, capped, fewer_tok, edited)}
    assert len(keys) == len(dirs) == 5
    assert edited.n_valid_stories == 61 and not edited.cache_hit
    assert other_vocab.vocab_size == 600 and capped.n_train_stories == 100


def test_killed_prepare_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    src = make_dir(tmp_path / "src")
    cache = tmp_path / "cache"

    def killed(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(data, "_pretokenize", killed)
        m.setattr(data.shutil, "rmtree", lambda *a, **k: None)  # a hard kill (SIGKILL) never runs `finally`
        with pytest.raises(KeyboardInterrupt):
            data.prepare(tiny_data(src), VOCAB, progress=False)
    stale = [d for d in cache.iterdir() if d.name.startswith(".tmp-")]
    assert len(stale) == 1 and (stale[0] / "tokenizer.model").is_file()  # half-built, under a temporary name
    assert not [d for d in cache.iterdir() if d.name.startswith("v")]
    p = data.prepare(tiny_data(src), VOCAB, progress=False)
    assert not p.cache_hit and stale[0].name.startswith(f".tmp-{p.dir.name}-")
    assert not stale[0].exists()  # cleaned up by the next prepare of the same key
    assert data.prepare(tiny_data(src), VOCAB, progress=False).cache_hit


@pytest.mark.parametrize("damage", ["truncate", "token", "missing", "manifest", "tokenizer"])
def test_corrupt_cache_is_reported(tmp_path, damage):
    src = make_dir(tmp_path / "src")
    p = data.prepare(tiny_data(src), VOCAB, progress=False)
    if damage == "truncate":
        named = p.dir / "train.bin"
        named.write_bytes(named.read_bytes()[:-2])
    elif damage == "token":
        named = p.dir / "valid.bin"
        b = bytearray(named.read_bytes())
        b[10:12] = np.array([VOCAB + 3], dtype=np.uint16).tobytes()  # same size, an id >= vocab
        named.write_bytes(bytes(b))
    elif damage == "missing":
        named = p.dir / "valid_stories.jsonl"
        named.unlink()
    elif damage == "manifest":
        named = p.dir / "manifest.json"
        named.unlink()
    else:
        named = p.dir / "tokenizer.model"
        b = bytearray(named.read_bytes())
        b[100] ^= 0xFF
        named.write_bytes(bytes(b))
    for call in (lambda: data.prepare(tiny_data(src), VOCAB, progress=False), lambda: data.load_prepared(p.dir)):
        msg = _err(call)
        assert str(named) in msg and f"delete {p.dir}" in msg and "corrupt" in msg
    if damage == "token":
        assert f"token id {VOCAB + 3} >= vocab size {VOCAB}" in msg


@pytest.mark.parametrize("sampled", [False, True], ids=["whole", "sampled"])
@pytest.mark.parametrize("split", ["valid", "train"])
def test_a_same_size_change_to_the_cache_is_caught(tmp_path, monkeypatch, split, sampled):
    """Every third token overwritten with another valid id: the sizes and the largest id are unchanged, so only the
    content hashes recorded at preparation see it (whole for small files, sampled blocks for large ones), exit 3."""
    if sampled:  # treat every file as large: the sampled-block check alone
        monkeypatch.setattr(data, "FULL_HASH_MAX_BYTES", 0)
        monkeypatch.setattr(data, "SAMPLED_BLOCKS", 4)
        monkeypatch.setattr(data, "SAMPLED_BLOCK_BYTES", 64)
    src = make_dir(tmp_path / "src")
    p = data.prepare(tiny_data(src), VOCAB, progress=False)
    data.verify_prepared(p)  # `prepare --verify`: every file hashed whole, all match
    named = p.dir / f"{split}.bin"
    tokens = np.fromfile(named, dtype=np.uint16)
    tokens[::3] = (tokens[::3] + 1) % (int(tokens.max()) + 1)
    tokens.tofile(named)
    for call in (lambda: data.prepare(tiny_data(src), VOCAB, progress=False), lambda: data.load_prepared(p.dir)):
        with pytest.raises(DataError) as e:
            call()
        assert str(named) in str(e.value) and "content changed" in str(e.value) and e.value.exit_code == 3
    with pytest.raises(DataError, match="content changed"):
        data.verify_prepared(p)


def test_load_prepared_missing_dir(tmp_path):
    assert "does not exist" in _err(data.load_prepared, tmp_path / "gone")


# --------------------------------------------------------------------------------------------------------------------
# The hub


def test_offline_hub_is_one_clear_error(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
        t0 = time.perf_counter()
        msg = _err(data.prepare, DataConfig(source="hub"), VOCAB)
        # offline fails at once; the bound is loose enough for a loaded machine and still catches retries with backoff
        assert time.perf_counter() - t0 < 30
        assert "could not reach the Hugging Face hub" in msg and var in msg
        assert "--data DIR" in msg and "BENCHCTL_DATA" in msg
        monkeypatch.delenv(var)


def test_hub_network_error_is_one_clear_error(monkeypatch):
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors

    def refuse(*a, **k):
        raise hf_errors.OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/datasets/x: network down")

    monkeypatch.setattr(HfApi, "dataset_info", refuse)
    msg = _err(data.prepare, DataConfig(source="hub"), VOCAB)
    assert "could not reach the Hugging Face hub" in msg and "network down" in msg and "--data DIR" in msg


def test_hub_source_and_offline_reuse(tmp_path, monkeypatch):
    """The hub path with the real `datasets` objects, minus the download: load_dataset returns local Datasets."""
    import datasets

    calls = []

    def fake_load(repo, split, revision):
        calls.append((repo, split, revision))
        n, seed = (300, 1) if split == "train" else (60, 2)
        return datasets.Dataset.from_dict({"text": ["  "] + synthetic_stories(n, seed)})

    hub = DataConfig(source="hub", tokenizer_stories=200)
    with monkeypatch.context() as m:
        m.setattr(datasets, "load_dataset", fake_load)
        m.setattr(sources, "_hub_revision", lambda: "rev1")
        p = data.prepare(hub, VOCAB, progress=False)
        assert p.source == "hub:roneneldan/TinyStories" and (p.n_train_stories, p.n_valid_stories) == (300, 60)
        assert calls == [("roneneldan/TinyStories", "train", "rev1"), ("roneneldan/TinyStories", "validation", "rev1")]
        assert p.valid_stories() == synthetic_stories(60, seed=2)
        assert json.loads((p.dir / "manifest.json").read_text())["source_revision"] == "rev1"
        # a new hub revision is new data
        m.setattr(sources, "_hub_revision", lambda: "rev2")
        assert data.prepare(hub, VOCAB, progress=False).fingerprint != p.fingerprint
    # offline later (a compute node): the last revision prepared online is reused (rev2 was seen last)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("must not download"))
    assert data._last_hub_revision() == "rev2"
    monkeypatch.setattr(data, "_last_hub_revision", lambda: "rev1")
    again = data.prepare(hub, VOCAB, progress=False)
    assert again.cache_hit and again.fingerprint == p.fingerprint
    assert "could not reach" in _err(data.prepare, hub, 600)  # never prepared at vocab 600


# --------------------------------------------------------------------------------------------------------------------
# Training and validation windows


TOKENS = np.arange(1000, dtype=np.uint16) % 500  # windows are recognisable slices


def test_sampler_windows_are_shifted_slices():
    s = data.WindowSampler(TOKENS, seq_len=16, batch_size=8, seed=0)
    x, y = s.next_batch()
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):
        start = int(np.flatnonzero(TOKENS[:-16] == row_x[0].item())[0])
        assert torch.equal(row_x, torch.from_numpy(TOKENS[start : start + 16].astype(np.int64)))
        assert row_y[-1].item() == TOKENS[start + 16]


def test_sampler_deterministic_resumable_and_independent_of_global_rng():
    a = data.WindowSampler(TOKENS, 16, 8, seed=3)
    b = data.WindowSampler(TOKENS, 16, 8, seed=3)
    first = [a.next_batch() for _ in range(3)]
    torch.manual_seed(123)
    torch.rand(5)
    assert all(torch.equal(f[0], g[0]) for f, g in zip(first, [b.next_batch() for _ in range(3)]))
    assert not torch.equal(first[0][0], data.WindowSampler(TOKENS, 16, 8, seed=4).next_batch()[0])

    import io

    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    later = [a.next_batch() for _ in range(4)]
    resumed = data.WindowSampler(TOKENS, 16, 8, seed=3)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    resumed.load_state_dict(state)
    assert resumed.batches == 3
    for (x1, y1), (x2, y2) in zip(later, [resumed.next_batch() for _ in range(4)]):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)

    with pytest.raises(CheckpointError, match="seq_len"):
        data.WindowSampler(TOKENS, 8, 8, seed=3).load_state_dict(state)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_shards_are_rows_of_the_single_process_batch(world_size):
    single = data.WindowSampler(TOKENS, 16, 8, seed=5)
    ranks = [data.WindowSampler(TOKENS, 16, 8, seed=5, rank=r, world_size=world_size) for r in range(world_size)]
    for _ in range(3):
        x, y = single.next_batch()
        for r, s in enumerate(ranks):
            xr, yr = s.next_batch()
            assert xr.shape == (8 // world_size, 16)
            assert torch.equal(xr, x[r::world_size]) and torch.equal(yr, y[r::world_size])


def test_sampler_errors():
    with pytest.raises(ConfigError, match="multiple of the number of processes"):
        data.WindowSampler(TOKENS, 16, 6, seed=0, world_size=4)
    with pytest.raises(DataError, match="too small for sequence length 32"):
        data.WindowSampler(TOKENS[:32], 32, 4, seed=0)
    data.WindowSampler(TOKENS[:33], 32, 4, seed=0).next_batch()  # exactly one window fits
    with pytest.raises(DataError, match="too small"):
        data.val_windows(TOKENS[:10], 32, 4, seed=0)


def test_val_windows_fixed():
    w = data.val_windows(TOKENS, 16, 20, seed=1337)
    assert w.shape == (20, 17) and w.dtype == torch.int64
    torch.manual_seed(99)
    assert torch.equal(w, data.val_windows(TOKENS, 16, 20, seed=1337))
    assert torch.equal(w, data.val_windows(TOKENS.copy(), 16, 20, seed=1337))
    assert not torch.equal(w, data.val_windows(TOKENS, 16, 20, seed=1))
    for row in w:
        start = int(np.flatnonzero(TOKENS[:-16] == row[0].item())[0])
        assert torch.equal(row, torch.from_numpy(TOKENS[start : start + 17].astype(np.int64)))


# --------------------------------------------------------------------------------------------------------------------
# CLI


def test_cli_prepare(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from benchctl.cli import app

    src = make_dir(tmp_path / "src", n_train=300)
    runner = CliRunner()
    res = runner.invoke(app, ["prepare", "--preset", "tiny", "--data", str(src), "--set", "data.tokenizer_stories=200"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert str(src.resolve()) in out and str(tmp_path / "cache") in out
    assert "train 300" in out and "valid 60" in out and "512" in out
    res2 = runner.invoke(
        app, ["prepare", "--preset", "tiny", "--set", "data.tokenizer_stories=200"], env={"BENCHCTL_DATA": str(src)}
    )
    assert res2.exit_code == 0 and "already prepared" in res2.output

    bad = runner.invoke(app, ["prepare", "--preset", "tiny", "--data", str(tmp_path / "missing")])
    assert bad.exit_code != 0 and isinstance(bad.exception, DataError)
    assert "\n" not in str(bad.exception) and str(tmp_path / "missing") in str(bad.exception)


def test_cli_main_prints_one_line_error(tmp_path, capsys):
    from benchctl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["prepare", "--preset", "tiny", "--data", str(tmp_path / "missing")])
    assert e.value.code == DataError.exit_code
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "does not exist" in err and "Traceback" not in err


def test_a_finished_run_reads_its_data_once_and_only_the_data_it_trained_on(tmp_path, monkeypatch):
    src = make_dir(tmp_path / "src")
    cfg = tiny_data(src)
    cache: dict[str, data.Prepared] = {}
    first = data.prepared_for_run(cache, "r1", None, cfg, VOCAB, progress=False)
    with monkeypatch.context() as m:  # a second run on the same source is served from `cache`, not prepared again
        m.setattr(data, "prepare", lambda *a, **k: pytest.fail("prepared twice"))
        assert data.prepared_for_run(cache, "r2", first.fingerprint, cfg, VOCAB, progress=False) is first
        with pytest.raises(DataError, match=r"run r3 was trained on data 0123456789ab, but its source .* now gives "):
            data.prepared_for_run(cache, "r3", "0123456789abcdef", cfg, VOCAB, progress=False, to=" to sample it")
