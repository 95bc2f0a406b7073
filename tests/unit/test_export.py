"""`dilococtl export` / `sample`: a run's DCP checkpoint -> a Hugging Face Llama that computes our logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dilococtl.cli import app
from dilococtl.errors import BadInput
from dilococtl.export import export, pick_checkpoint
from trainer.checkpoints.checkpoint import Checkpointer
from trainer.checkpoints.manifest_sign import MANIFEST, round_dir
from trainer.model import build_model
from trainer.rules import config as C
from trainer.rules.model_config import ModelConfig, param_count, resolve_model

transformers = pytest.importorskip("transformers", reason="the export extra: pip install 'dilococtl[export]'")


def _model(vocab: int, tie: bool, seed: int):
    cfg = resolve_model(ModelConfig(preset="tiny", vocab_size=vocab, tie_embeddings=tie, rope_theta=5000.0,
                                        norm_eps=1e-6))
    m = build_model(cfg, seed)
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows in the logits
        g = torch.Generator().manual_seed(seed)
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return cfg, m


def _site(tmp_path, mcfg, models_by_round: dict, data_path: str = "") -> object:
    """RUN_DIR/site0 with config.toml and one DCP checkpoint per round, as the trainer writes them."""
    site = tmp_path / "run" / "site0"
    site.mkdir(parents=True)
    data = C.DataConfig(source="shards", path=data_path) if data_path else C.DataConfig()
    tcfg = C.TrainerConfig(model=mcfg, data=data, run=C.RunConfig(run_dir=str(tmp_path / "run"), site="site0"))
    (site / "config.toml").write_text(C.dump_toml(tcfg))
    ck = Checkpointer(site / "checkpoints", keep=5, async_save=False)
    for r, m in models_by_round.items():
        ck.save(r, {"model": m.state_dict(), "progress": {"round": r, "step": 10 * r}})
    ck.close()
    return site


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from dilococtl.data_prepare import PrepareConfig, prepare

    src = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    for i in range(4):
        (src / f"d{i}.txt").write_text(" ".join(rng.choice(words, 300)))
    out = tmp_path_factory.mktemp("shards")
    prepare(PrepareConfig(sources=[str(src)], out=out, train_tokenizer=300, val_fraction=0.25, workers=1))
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers_with_our_logits(tmp_path, shards, tie):
    mcfg, ours = _model(vocab=300, tie=tie, seed=1)
    site = _site(tmp_path, mcfg, {2: ours}, data_path=str(shards))
    res = export(str(site.parent), tmp_path / "hf")
    assert (res.site, res.round, res.tokenizer) == ("site0", 2, True)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["num_attention_heads"], cfg["tie_word_embeddings"]) == (2, 4, tie)
    assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["vocab_size"]) == (1e-6, 5000.0, 300)
    assert sum(p.numel() for p in hf.parameters()) == param_count(mcfg) == res.parameters
    x = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.eval()(x)
        got = hf(input_ids=x).logits
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert want.abs().max().item() > 0.05  # logits that are not all ~0: the comparison means something
    # the tokenizer files load with transformers and encode as the data's tokenizer did
    from tokenizers import Tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    raw = Tokenizer.from_file(str(shards / "tokenizer.json"))
    text = "whether tis nobler in the mind"
    assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids
    assert tok.eos_token == "<|endoftext|>"


def test_round_choice_newest_valid_or_asked(tmp_path):
    mcfg, m2 = _model(vocab=256, tie=False, seed=2)
    _, m3 = _model(vocab=256, tie=False, seed=3)
    site = _site(tmp_path, mcfg, {2: m2, 3: m3})
    assert pick_checkpoint(str(site)).round == 3
    assert pick_checkpoint(str(site), round=2).round == 2
    with pytest.raises(BadInput, match="no valid checkpoint of round 7"):
        pick_checkpoint(str(site), round=7)
    man = round_dir(site / "checkpoints", 3) / MANIFEST
    man.unlink()  # round 3's save never finished
    assert pick_checkpoint(str(site)).round == 2
    res = export(str(site), tmp_path / "hf")
    assert res.round == 2 and not res.tokenizer
    from safetensors.torch import load_file

    w = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(w["model.embed_tokens.weight"], m2.tok_embeddings.weight)
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    # issue 42: the weights as readable as the other files; no max_length for generate() to warn about
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1, modes
    assert "max_length" not in json.loads((tmp_path / "hf" / "generation_config.json").read_text())


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_cli_export_and_sample(tmp_path, shards):
    mcfg, ours = _model(vocab=300, tie=False, seed=4)
    site = _site(tmp_path, mcfg, {1: ours}, data_path=str(shards))
    r = _cli("export", str(site), "--out", str(tmp_path / "hf"), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"out": str(tmp_path / "hf"), "site": "site0", "round": 1,
                                    "parameters": param_count(mcfg), "tokenizer": True}
    # an export never lands on a directory that holds something
    r = _cli("export", str(site), "--out", str(tmp_path / "hf"))
    assert r.exit_code == 2 and "is not an empty directory" in r.stderr
    r = _cli("export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert r.exit_code == 2 and r.stderr.startswith(f"error: no run {str(tmp_path / 'nowhere')!r}") and not (tmp_path / "x").exists()
    # greedy sampling with our model == transformers' greedy generate on the export
    r = _cli("sample", str(site), "--prompt", "to be or not", "--temperature", "0", "-n", "12", "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(shards / "tokenizer.json"))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("to be or not").ids])
    gen = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = gen[0, ids.shape[1]:].tolist()
    eos = tok.token_to_id("<|endoftext|>")
    new = new[:new.index(eos)] if eos in new else new
    assert got["completion"] == tok.decode(new) and got["tokens"] == len(new)
    r = _cli("sample", str(site), "--prompt", "", "--temperature", "0")
    assert r.exit_code == 2 and "--prompt: must not be empty" in r.stderr


def test_sample_on_the_byte_corpus_is_greedy_bytes(tmp_path):
    from dilococtl.export import sample

    mcfg, ours = _model(vocab=256, tie=True, seed=5)
    site = _site(tmp_path, mcfg, {1: ours})  # data: the bundled byte-level corpus, no tokenizer file
    got = sample(str(site), "To be", max_tokens=6, temperature=0)
    ids = list(b"To be")
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(ours.eval()(torch.tensor([ids]))[0, -1].argmax()))
    assert got["tokens"] == 6 and got["completion"] == bytes(ids[5:]).decode("utf-8", errors="replace")
    a = sample(str(site), "To be", max_tokens=6, temperature=1.0, seed=1)
    assert a == sample(str(site), "To be", max_tokens=6, temperature=1.0, seed=1)  # seeded
