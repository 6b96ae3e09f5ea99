"""`benchctl export`: the exported model checked against code benchctl did not write.

- hf: transformers' own LlamaForCausalLM and AutoTokenizer load the folder; its logits equal benchctl's on real
  validation sequences (fp32), its tokenizer encodes them as the run's SentencePiece model does, and lm-eval's own
  `hf` model gives the same tinystories_ppl as `benchctl eval`.
- llama2c: a reader written here from llama2.c's documented layout (the 7-int32 header, then the tensors in run.c's
  order) reads model.bin back into LlamaForCausalLM, whose greedy continuation equals benchctl's.
- An architecture that declares no format is refused in one line (exit 2).
"""

from __future__ import annotations

import json
import shlex
import struct
from pathlib import Path

import pytest
import torch

from architectures.generate import generate
from benchctl import stages
from benchctl.cli import main
from benchctl.core import data as datamod
from benchctl.core.checkpoint import CKPT_NAME, load_model, run_dir
from benchctl.core.config import RunConfig, make_config, run_id
from benchctl.stages.train import tables as train_tables

transformers = pytest.importorskip("transformers")

CONTEXT = 96  # room for a prompt and 64 greedy tokens without sliding the window
PROMPT = "Once upon a time, there was a little"


def run_cli(argv: list[str]) -> None:
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), f"benchctl {' '.join(argv)} exited with {e.code}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tinystories_dir):
    root = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BENCHCTL_CACHE", str(root / "cache"))
        mp.delenv("BENCHCTL_DB", raising=False)
        db = root / "results.db"
        run_cli(
            [
                "train-all",
                "--preset",
                "tiny",
                "--archs",
                "control,relaxed,frailt",
                "--data",
                str(tinystories_dir),
                "--db",
                str(db),
                "--set",
                "train.max_steps=6",
                "--set",
                "train.warmup_steps=1",
                "--set",
                f"model.max_seq_len={CONTEXT}",
                "--set",
                "train.dtype=float32",  # benchctl eval then scores in fp32, as the exported model does
                "--no-progress",
                "--yes",
            ]
        )
        rows = train_tables.runs(stages.connect(db), status="done")
        yield {"root": root, "db": db, "runs": {r["arch"]: r for r in rows}}


def export(trained, arch: str, fmt: str) -> Path:
    out = trained["root"] / f"{fmt}_{arch}"
    if not out.exists():
        run_cli(["export", trained["runs"][arch]["id"], "--format", fmt, "--out", str(out), "--db", str(trained["db"])])
    return out


def benchctl_model(trained, arch: str):
    model, cfg, tok_path = load_model(run_dir(trained["db"], trained["runs"][arch]["id"]) / CKPT_NAME)
    return model, cfg, datamod.Tokenizer(tok_path)


def validation_batch(tinystories_dir: Path, tok: datamod.Tokenizer, n: int = 8) -> torch.Tensor:
    """The first n validation stories that fill the context, as the model saw text: BOS + story, (n, CONTEXT)."""
    rows = []
    for story in (tinystories_dir / "valid.txt").read_text().split("<|endoftext|>"):
        ids = tok.encode(story.strip(), bos=True)
        if len(ids) >= CONTEXT:
            rows.append(ids[:CONTEXT])
        if len(rows) == n:
            break
    assert len(rows) == n
    return torch.tensor(rows)


@pytest.mark.parametrize("arch", ["control", "relaxed"])
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_hf_logits_equal_benchctl(trained, tinystories_dir, arch):
    out = export(trained, arch, "hf")
    model, cfg, tok = benchctl_model(trained, arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config.num_hidden_layers == cfg.model.n_layers * cfg.model.n_recur  # relaxed: unrolled
    ids = validation_batch(tinystories_dir, tok)
    with torch.no_grad():
        ours, _ = model(ids)
        theirs = hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{arch}: max abs logit difference {diff:.3g} over {tuple(ids.shape)} tokens")
    assert diff <= 1e-4
    # a wrong RoPE layout would still give close logits at position 0 only: the difference must be small everywhere
    assert ours[:, 0].abs().max() > 0 and ours.std() > 1e-3


def test_hf_tokenizer_encodes_as_sentencepiece(trained, tinystories_dir):
    out = export(trained, "control", "hf")
    _, _, tok = benchctl_model(trained, "control")
    auto = transformers.AutoTokenizer.from_pretrained(out)
    stories = (tinystories_dir / "valid.txt").read_text().split("<|endoftext|>")[:300]
    extra = ["  two  spaces  ", "\n leading newline", "digits 12345 and ü 日本", "", " "]
    for text in stories + extra:
        assert auto(text)["input_ids"] == tok.encode(text, bos=True), repr(text[:60])
    assert auto.bos_token_id == tok.bos_id


def test_model_card_names_the_run_and_its_training_command(trained):
    out = export(trained, "relaxed", "hf")
    row = trained["runs"]["relaxed"]
    card = (out / "README.md").read_text()
    assert row["data_fingerprint"] in card and f"{row['final_val_loss']:.4f}" in card
    model, cfg, _ = benchctl_model(trained, "relaxed")
    unique = sum(p.numel() for p in model.parameters())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    exported = sum(p.numel() for p in hf.parameters())  # the tied head counted once
    assert f"{unique:,}" in card and f"{exported:,}" in card and exported > unique
    # the command on the card trains this very run: same config, same data, same run id
    command = next(line for line in card.splitlines() if line.startswith("benchctl train "))
    argv = shlex.split(command)[2:]
    opts = {argv[i]: argv[i + 1] for i in range(0, len(argv), 2) if argv[i] != "--set"}
    sets = dict(argv[i + 1].split("=", 1) for i in range(0, len(argv), 2) if argv[i] == "--set")
    sets["data.source"] = opts["--data"]
    again = make_config(opts["--preset"], opts["--arch"], int(opts["--seed"]), sets)
    assert run_id(again, row["data_fingerprint"]) == row["id"]
    assert RunConfig.from_json(row["config_json"]) == cfg


def test_architecture_without_a_format_is_refused_in_one_line(trained, capsys):
    out = trained["root"] / "refused"
    with pytest.raises(SystemExit) as e:
        main(["export", trained["runs"]["frailt"]["id"], "-f", "hf", "--out", str(out), "--db", str(trained["db"])])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "frailt" in err and "control" in err and "relaxed" in err
    assert not out.exists()


def test_export_refuses_a_directory_in_use(trained, capsys):
    out = trained["root"] / "in_use"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        main(["export", trained["runs"]["control"]["id"], "-f", "hf", "--out", str(out), "--db", str(trained["db"])])
    assert e.value.code == 2 and "--force" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


# ---- llama2.c ------------------------------------------------------------------------------------------------------


def read_llama2c_bin(path: Path) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """llama2.c's version-0 model.bin, read as run.c maps it: (config, tensors by llama2.c name, stacked by layer)."""
    raw = path.read_bytes()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    head = dim // n_heads
    floats = torch.frombuffer(bytearray(raw[28:]), dtype=torch.float32)
    sizes = [
        ("token_embedding_table", (vocab, dim)),
        ("rms_att_weight", (n_layers, dim)),
        ("wq", (n_layers, n_heads * head, dim)),
        ("wk", (n_layers, n_kv * head, dim)),
        ("wv", (n_layers, n_kv * head, dim)),
        ("wo", (n_layers, dim, n_heads * head)),
        ("rms_ffn_weight", (n_layers, dim)),
        ("w1", (n_layers, hidden, dim)),
        ("w2", (n_layers, dim, hidden)),
        ("w3", (n_layers, hidden, dim)),
        ("rms_final_weight", (dim,)),
        ("freq_cis_real", (seq_len, head // 2)),
        ("freq_cis_imag", (seq_len, head // 2)),
    ]
    tensors, at = {}, 0
    for name, shape in sizes:
        n = int(torch.tensor(shape).prod())
        tensors[name] = floats[at : at + n].view(shape)
        at += n
    if shared:
        tensors["wcls"] = tensors["token_embedding_table"]
    else:
        tensors["wcls"] = floats[at : at + vocab * dim].view(vocab, dim)
        at += vocab * dim
    assert at == floats.numel(), "model.bin is longer than its header says"
    config = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, vocab_size=vocab)
    return {**config, "seq_len": seq_len, "shared": int(shared)}, tensors


def llama_from_bin(path: Path):
    """transformers' LlamaForCausalLM holding model.bin's tensors (q/k rows to rotate-half order per head)."""
    c, t = read_llama2c_bin(path)
    head = c["dim"] // c["n_heads"]

    def rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.view(heads, head // 2, 2, -1).transpose(1, 2).reshape(heads * head, -1)

    config = transformers.LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["dim"],
        intermediate_size=c["hidden_dim"],
        num_hidden_layers=c["n_layers"],
        num_attention_heads=c["n_heads"],
        num_key_value_heads=c["n_kv_heads"],
        max_position_embeddings=c["seq_len"],
        rms_norm_eps=1e-5,  # run.c's
        tie_word_embeddings=bool(c["shared"]),
    )
    model = transformers.LlamaForCausalLM(config).eval()
    sd = {"model.embed_tokens.weight": t["token_embedding_table"], "model.norm.weight": t["rms_final_weight"]}
    sd["lm_head.weight"] = t["wcls"]
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rotate_half(t["wq"][i], c["n_heads"])
        sd[p + "self_attn.k_proj.weight"] = rotate_half(t["wk"][i], c["n_kv_heads"])
        sd[p + "self_attn.v_proj.weight"] = t["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = t["wo"][i]
        sd[p + "mlp.gate_proj.weight"] = t["w1"][i]
        sd[p + "mlp.down_proj.weight"] = t["w2"][i]
        sd[p + "mlp.up_proj.weight"] = t["w3"][i]
        sd[p + "input_layernorm.weight"] = t["rms_att_weight"][i]
        sd[p + "post_attention_layernorm.weight"] = t["rms_ffn_weight"][i]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model, c, t


def read_tokenizer_bin(path: Path, vocab_size: int) -> tuple[int, list[bytes], list[float]]:
    """llama2.c's tokenizer.bin as run.c's build_tokenizer reads it."""
    raw = path.read_bytes()
    (max_len,) = struct.unpack("<I", raw[:4])
    at, pieces, scores = 4, [], []
    for _ in range(vocab_size):
        score, n = struct.unpack("<fI", raw[at : at + 8])
        pieces.append(raw[at + 8 : at + 8 + n])
        scores.append(score)
        at += 8 + n
    assert at == len(raw)
    return max_len, pieces, scores


@pytest.mark.parametrize("arch", ["control", "relaxed"])
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_llama2c_bin_read_back_continues_as_benchctl(trained, tinystories_dir, arch):
    out = export(trained, arch, "llama2c")
    model, cfg, tok = benchctl_model(trained, arch)
    llama, c, t = llama_from_bin(out / "model.bin")
    assert c["n_layers"] == cfg.model.n_layers * cfg.model.n_recur and c["shared"] == 1
    assert torch.equal(t["token_embedding_table"], model.tok_embeddings.weight.detach())
    assert torch.allclose(t["freq_cis_real"], model.rope_cos) and torch.allclose(t["freq_cis_imag"], model.rope_sin)
    # every position of real text: a few training steps leave the greedy continuation below repetitive, the logits
    # are not
    ids = validation_batch(tinystories_dir, tok)
    with torch.no_grad():
        diff = (model(ids)[0] - llama(ids).logits).abs().max().item()
    print(f"{arch}: max abs logit difference, model.bin read back vs benchctl: {diff:.3g}")
    assert diff <= 1e-4

    prompt = tok.encode(PROMPT, bos=True)
    (ours,) = generate(model, [prompt], max_new_tokens=64, temperature=0.0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(64):  # greedy, the whole sequence each step: nothing of benchctl's generation code involved
            ids.append(int(llama(torch.tensor([ids])).logits[0, -1].argmax()))
    theirs = ids[len(prompt) :]
    print(f"{arch} benchctl: {ours.tokens}\n{arch} model.bin: {theirs}")
    assert theirs == ours.tokens

    max_len, pieces, scores = read_tokenizer_bin(out / "tokenizer.bin", c["vocab_size"])
    assert pieces[1] == b"\n<s>\n" and pieces[2] == b"\n</s>\n" and max_len == max(len(p) for p in pieces)
    text = b"".join(pieces[i] for i in theirs).decode("utf-8", errors="replace")
    assert text.strip().split() == tok.decode(theirs).strip().split()


# ---- lm-eval ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lm_eval_hf_model_gives_benchctl_eval_perplexity(trained, tinystories_dir, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from benchctl.stages.eval.tasks import build_bundled_tasks

    monkeypatch.setenv("BENCHCTL_CACHE", str(trained["root"] / "cache"))
    row = trained["runs"]["control"]
    limit = 20
    run_cli(
        [
            "eval",
            "--tasks",
            "tinystories_ppl",
            "--runs",
            row["id"],
            "--limit",
            str(limit),
            "--db",
            str(trained["db"]),
            "--no-progress",
        ]
    )
    ours = {
        r["metric"]: r["value"]
        for r in stages.connect(trained["db"]).query(
            "select metric, value from eval_results where run_id = ? and task = 'tinystories_ppl'", [row["id"]]
        )
    }
    cfg = RunConfig.from_json(row["config_json"])
    bundled = build_bundled_tasks(datamod.prepare(cfg.data, cfg.model.vocab_size, progress=False), ["tinystories_ppl"])
    out = export(trained, "control", "hf")
    res = lm_eval.simple_evaluate(
        model="hf",
        # lm-eval puts the BOS before each rolling window itself; the tokenizer's own BOS would be a second one
        model_args=f"pretrained={out},dtype=float32,add_bos_token=False",
        tasks=["tinystories_ppl"],
        limit=limit,
        device="cpu",
        batch_size=8,
        task_manager=TaskManager(include_path=str(bundled.dir)),
    )
    theirs = res["results"]["tinystories_ppl"]
    print(json.dumps({"benchctl eval": ours, "lm-eval hf": theirs}, default=str))
    for metric in ("byte_perplexity", "bits_per_byte"):
        assert abs(theirs[f"{metric},none"] - ours[metric]) <= 1e-4, metric
    # words per document are few, so word perplexity is exp of a large number: compared relatively
    assert abs(theirs["word_perplexity,none"] / ours["word_perplexity"] - 1) <= 1e-4


# ---- benchctl study --export -----------------------------------------------------------------------------------------


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_study_exports_every_finished_run_resumably(trained, tinystories_dir, monkeypatch):
    """A tiny study over the fixture's runs (found trained, so nothing trains again) exports control and relaxed,
    skips frailt in one line, keeps a complete export on a rerun and redoes one left half-written."""
    from benchctl.study import StudyOptions, run_study

    monkeypatch.setenv("BENCHCTL_CACHE", str(trained["root"] / "cache"))
    reports = trained["root"] / "study_reports"
    opts = StudyOptions(
        preset="tiny",
        archs=["control", "relaxed", "frailt"],
        seeds=[0],
        db_path=trained["db"],
        out_dir=reports,
        overrides={
            "data.source": str(tinystories_dir),
            "train.max_steps": 6,
            "train.warmup_steps": 1,
            "model.max_seq_len": CONTEXT,
            "train.dtype": "float32",
        },
        skip=("sample", "judge", "eval", "depth", "infer"),
        progress=False,
        bench=False,
        export=("hf",),
    )
    before = {r["id"] for r in train_tables.runs(stages.connect(trained["db"]))}
    lines: list[str] = []
    run_study(opts, log=lines.append)
    assert {r["id"] for r in train_tables.runs(stages.connect(trained["db"]))} == before  # nothing trained anew
    runs = trained["runs"]
    folders = {a: reports / "export" / "hf" / runs[a]["id"] for a in ("control", "relaxed")}
    for arch, folder in folders.items():
        assert f"   {runs[arch]['id']} -> {folder}" in lines
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert hf.config.num_hidden_layers == len(
            load_model(run_dir(trained["db"], runs[arch]["id"]) / CKPT_NAME)[0].unrolled(None, None)
        )
    assert sorted((reports / "export" / "hf").iterdir()) == sorted(folders.values())
    assert [ln for ln in lines if "frailt" in ln and "export" in ln] == [
        "   frailt: declares no export format; its 1 run(s) skipped"
    ]
    assert "   2 written, 0 already complete" in lines

    # rerun: the complete exports are kept as they are; one interrupted half-way (its .partial folder) is redone
    stamp = (folders["control"] / "model.safetensors").stat().st_mtime_ns
    redo = folders["relaxed"]
    redo.rename(redo.with_name(redo.name + ".partial"))
    (redo.with_name(redo.name + ".partial") / "model.safetensors").write_bytes(b"half")
    lines = []
    run_study(opts, log=lines.append)
    assert "   1 written, 1 already complete" in lines
    assert (folders["control"] / "model.safetensors").stat().st_mtime_ns == stamp
    assert not redo.with_name(redo.name + ".partial").exists()
    transformers.AutoModelForCausalLM.from_pretrained(redo)  # the redone export is whole


def test_study_export_names_its_formats(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["study", "--preset", "tiny", "--export", "hf,onnx", "--db", str(tmp_path / "r.db")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith("--export accepts hf, llama2c (a comma list); got onnx")
    assert not (tmp_path / "r.db").exists()


@pytest.mark.parametrize(
    "argv", [["study", "--preset", "tiny", "--export", "hf"], ["export", "some-run", "--format", "hf", "--out", "x"]]
)
def test_hf_export_without_the_export_extra_names_it_in_one_line(tmp_path, capsys, monkeypatch, argv):
    """A plain `pip install -e .` has no transformers: asking for an hf export says which extra to install, before
    anything is trained or written."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **kw: None if name == "transformers" else real(name, *a, **kw)
    )
    with pytest.raises(SystemExit) as e:
        main([*argv, "--db", str(tmp_path / "r.db")])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2, err
    assert err.endswith("hf writes with transformers, not installed here: pip install 'benchctl[export]'"), err
    assert not (tmp_path / "r.db").exists()
