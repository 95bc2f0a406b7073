"""Take a trained model out of a run: a Hugging Face LlamaForCausalLM directory, or samples.

The weights come from a site's DCP checkpoint (RUN_DIR/SITE/checkpoints/round-N, verified by its
signed manifest before any byte of it is read: DCP's metadata is a pickle, so a checkpoint that the
run's key did not sign is refused; see `checkpoint_key`): DCP's metadata holds every tensor's global shape, so loading into full-size tensors
merges whatever TP, FSDP or pipeline shards the site saved. Our Transformer is LLaMA's layout with
interleaved RoPE pairs; HF's Llama rotates half-split pairs, so q/k rows are permuted per head the
way transformers' own convert_llama_weights_to_hf does.

torch is imported inside the functions: `dilococtl --help` must not load it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilococtl.errors import BadInput, DilocoError

WEIGHTS_FILE = "model.safetensors"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a run id that can name a directory
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")  # compile/AC/FSDP1 name parts


@dataclass(kw_only=True, slots=True)
class SiteCheckpoint:
    site_dir: Path  # RUN_DIR/SITE: config.toml and checkpoints/
    round: int
    path: Path  # the round's DCP directory
    key: bytes = b""  # the checkpoint signing key it verified under (checkpoint_key)


# --- finding the run, the site and the round ----------------------------------------------


def site_dirs(run: str) -> list[Path]:
    """Local site directories of RUN: a site dir, a run dir, or a run id/name whose run dir is here."""
    p = Path(run)
    if p.is_dir():
        if (p / "config.toml").is_file():
            return [p]
        sites = sorted(d for d in p.iterdir() if d.is_dir() and (d / "config.toml").is_file())
        if sites:
            return sites
        raise BadInput(f"run {run}: directory holds no site (no SITE/config.toml under it)")
    from dilococtl.lookup import pick_run, read_store

    with read_store() as store:
        r = pick_run(store, run)
        nodes = store.nodes(r.id)
    found, remote = [], []
    for n in sorted(nodes, key=lambda n: (n.site, n.rank)):
        d = Path(n.run_dir or "") / n.site
        if n.run_dir and (d / "config.toml").is_file():
            if d not in found:
                found.append(d)
        else:
            remote.append(f"{n.host}:{n.run_dir}/{n.site}")
    if not found:
        raise BadInput(f"run {r.id}: no site directory on this machine (they are at {', '.join(remote[:3])}); "
                       f"copy one here and pass its path")
    return found


def checkpoint_key(site_dir: Path) -> bytes:
    """The key the site's checkpoints must be signed with, never taken from the site's own files.

    $DILOCO_CHECKPOINT_KEY (a file) when set (e.g. exporting on another machine); else the run's key
    kept by this control plane (run_ca/RUN_ID/checkpoint.key, the run id read from the site's
    config.toml); else, for runs made without a control plane, the user's own key. Only keys this
    user owns and no one else can read are used, so a planted run tree cannot bring its own.
    """
    from dilococtl.plan import run_ca_dir
    from trainer.checkpoints.checkpoint_trust import (
        KEY_ENV,
        KEY_FILE,
        CheckpointKeyError,
        default_key_path,
        load_key,
    )

    try:
        if os.environ.get(KEY_ENV):
            return load_key(Path(os.environ[KEY_ENV]))
        run_id = trainer_config(site_dir).run.run_id
        run_key = run_ca_dir(run_id) / KEY_FILE if _RUN_ID.match(run_id) else None
        if run_key is not None and run_key.exists():
            return load_key(run_key)
        if default_key_path().exists():
            return load_key(default_key_path())
    except CheckpointKeyError as e:
        raise BadInput(str(e)) from None
    raise BadInput(f"{site_dir}: no checkpoint key for run {run_id!r} on this machine (looked for {run_key}); "
                   f"set {KEY_ENV}=FILE to the run's key")


def pick_checkpoint(run: str, round: int | None = None, site: str | None = None) -> SiteCheckpoint:
    """The newest valid checkpoint of RUN (of `site`, at `round` when given), signed with the run's key."""
    from trainer.checkpoints.checkpoint_trust import verify
    from trainer.checkpoints.manifest_sign import round_dir

    dirs = site_dirs(run)
    if site is not None:
        dirs = [d for d in dirs if d.name == site]
        if not dirs:
            raise BadInput(f"run {run}: no site {site!r} here")
    best: SiteCheckpoint | None = None
    why_not = []
    for d in dirs:
        key = checkpoint_key(d)
        root = d / "checkpoints"
        rounds = sorted((int(x.name.split("-")[1]) for x in root.glob("round-*") if x.name.split("-")[1].isdigit()),
                        reverse=True) if root.is_dir() else []
        if round is not None:
            rounds = [r for r in rounds if r == round]
        for r in rounds:
            why = verify(round_dir(root, r), key)
            if not why:
                if best is None or r > best.round:
                    best = SiteCheckpoint(site_dir=d, round=r, path=round_dir(root, r), key=key)
                break
            why_not.append(f"{round_dir(root, r)}: {why}")
    if best is None:
        what = f"round {round}" if round is not None else "any round"
        extra = f" ({'; '.join(why_not[:2])})" if why_not else ""
        raise BadInput(f"run {run}: no valid checkpoint of {what}{extra}")
    return best


def trainer_config(site_dir: Path):
    """The trainer config a site ran with (RUN_DIR/SITE/config.toml)."""
    from trainer.rules import config as C
    from trainer.rules.tables import ConfigError

    try:
        return C.load(site_dir / "config.toml")
    except ConfigError as e:
        raise BadInput(str(e)) from None


# --- weights ------------------------------------------------------------------------------


def load_model_state(ckpt: Path, key: bytes) -> dict[str, Any]:
    """The model's full tensors (fp32, CPU) from a DCP checkpoint, shards merged; keys as Transformer's.

    Verified against `key` again right here, before DCP reads (unpickles) its metadata.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainer.checkpoints.checkpoint_trust import verify

    why = verify(ckpt, key)
    if why:
        raise BadInput(f"checkpoint {ckpt}: {why}")
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    want = {k: v for k, v in meta.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not want:
        raise DilocoError(f"checkpoint {ckpt}: holds no model tensors")
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in want.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    out = {}
    for k, t in state.items():
        name = k[len("model."):]
        for w in _WRAPPERS:
            name = name.replace(w, "")
        out[name] = t.float()
    return out


def _permute_rope(w, n_heads: int):
    """Rows of q/k from interleaved RoPE pairs (ours, Meta's) to HF Llama's half-split layout."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_state(sd: dict[str, Any], mcfg) -> dict[str, Any]:
    """Our Transformer's state dict renamed (and q/k permuted) for LlamaForCausalLM."""
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not mcfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    for i in range(mcfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "self_attn.q_proj.weight"] = _permute_rope(sd[p + "attention.wq.weight"], mcfg.n_heads)
        out[q + "self_attn.k_proj.weight"] = _permute_rope(sd[p + "attention.wk.weight"], mcfg.n_kv_heads)
        out[q + "self_attn.v_proj.weight"] = sd[p + "attention.wv.weight"]
        out[q + "self_attn.o_proj.weight"] = sd[p + "attention.wo.weight"]
        out[q + "mlp.gate_proj.weight"] = sd[p + "feed_forward.w1.weight"]
        out[q + "mlp.up_proj.weight"] = sd[p + "feed_forward.w3.weight"]
        out[q + "mlp.down_proj.weight"] = sd[p + "feed_forward.w2.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "attention_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "ffn_norm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(mcfg, eos_id: int | None = None) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with our architecture."""
    head_dim = mcfg.dim // mcfg.n_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": mcfg.vocab_size,
        "hidden_size": mcfg.dim,
        "intermediate_size": mcfg.ffn_hidden,
        "num_hidden_layers": mcfg.n_layers,
        "num_attention_heads": mcfg.n_heads,
        "num_key_value_heads": mcfg.n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": mcfg.max_seq_len,
        "rms_norm_eps": mcfg.norm_eps,
        "rope_theta": mcfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta},  # transformers >= 5 reads this
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": mcfg.tie_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }


# --- the data's tokenizer -----------------------------------------------------------------


def data_tokenizer(tcfg) -> tuple[Path | None, dict]:
    """The tokenizer.json of the run's shards (when prepared by `dilococtl data prepare` and here) and its meta."""
    if tcfg.data.source != "shards" or not tcfg.data.path:
        return None, {}
    root = Path(tcfg.data.path)
    try:
        meta = json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        return None, {}
    tok = meta.get("tokenizer") or {}
    f = root / str(tok.get("file", "tokenizer.json"))
    return (f if f.is_file() else None), meta


# --- export -------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ExportResult:
    out: Path
    site: str
    round: int
    parameters: int
    tokenizer: bool  # tokenizer files written


def export(run: str, out: Path, round: int | None = None, site: str | None = None) -> ExportResult:
    """Write RUN's model (newest valid round, or `round`) as a Hugging Face directory at `out`."""
    from safetensors.torch import save_file

    from trainer.rules.model_config import resolve_model

    ck = pick_checkpoint(run, round, site)
    tcfg = trainer_config(ck.site_dir)
    mcfg = resolve_model(tcfg.model)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"out {out}: exists and is not an empty directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"out {out}: cannot create: {e.strerror or e}") from None
    tmp = out / ".partial"  # everything is written here, then moved up: a failed export leaves nothing that looks done
    tmp.mkdir(exist_ok=True)
    try:
        sd = load_model_state(ck.path, ck.key)
        hf = to_hf_state(sd, mcfg)
        save_file(hf, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        tok_file, meta = data_tokenizer(tcfg)
        eos = (meta.get("tokenizer") or {}).get("eos_id")
        (tmp / "config.json").write_text(json.dumps(hf_config(mcfg, eos), indent=2) + "\n")
        # safetensors writes its file 0600; the weights are as readable as the files beside them
        shutil.copymode(tmp / "config.json", tmp / WEIGHTS_FILE)
        # no max_length: with one, generate(max_new_tokens=...) warns that both are set
        gen = {"eos_token_id": eos} if eos is not None else {}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tok_file is not None:
            shutil.copyfile(tok_file, tmp / "tokenizer.json")
            eos_tok = _token_name(tok_file, eos)
            tcfg_json = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": mcfg.max_seq_len,
                         "clean_up_tokenization_spaces": False}
            if eos_tok is not None:
                tcfg_json["eos_token"] = eos_tok
            (tmp / "tokenizer_config.json").write_text(json.dumps(tcfg_json, indent=2) + "\n")
        (tmp / "dilococtl.json").write_text(json.dumps(
            {"site": ck.site_dir.name, "round": ck.round, "checkpoint": str(ck.path),
             "data": meta.get("prepare_key") and {"prepare_key": meta["prepare_key"], "tokens": meta.get("tokens")}},
            indent=2) + "\n")
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == WEIGHTS_FILE):  # weights last
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out=out, site=ck.site_dir.name, round=ck.round,
                        parameters=sum(t.numel() for t in hf.values()), tokenizer=tok_file is not None)


def _token_name(tok_file: Path, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_file)).id_to_token(int(token_id))


# --- sample -------------------------------------------------------------------------------


def sample(run: str, prompt: str, max_tokens: int = 100, temperature: float = 0.8, top_k: int = 50,
           seed: int = 0, round: int | None = None, site: str | None = None) -> dict[str, Any]:
    """Generate from RUN's model with our own Transformer (no transformers needed)."""
    import torch

    from trainer.model import Transformer
    from trainer.rules.model_config import resolve_model

    if not prompt:
        raise BadInput("--prompt: must not be empty")
    if max_tokens < 1 or not temperature >= 0 or top_k < 0:
        raise BadInput(f"sample: need --tokens >= 1, --temperature >= 0, --top-k >= 0; got "
                       f"{max_tokens}, {temperature}, {top_k}")
    ck = pick_checkpoint(run, round, site)
    tcfg = trainer_config(ck.site_dir)
    mcfg = resolve_model(tcfg.model)
    tok_file, meta = data_tokenizer(tcfg)
    if tok_file is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
        ids = tok.encode(prompt, add_special_tokens=False).ids
        decode = lambda xs: tok.decode(xs)  # noqa: E731
        eos = (meta.get("tokenizer") or {}).get("eos_id")
    elif mcfg.vocab_size == 256:  # the byte-level corpus: a token is a byte
        ids = list(prompt.encode("utf-8"))
        decode = lambda xs: bytes(xs).decode("utf-8", errors="replace")  # noqa: E731
        eos = None
    else:
        raise BadInput(f"run {run}: its data has no tokenizer.json here ({tcfg.data.path or tcfg.data.source})")
    if not ids:
        raise BadInput("--prompt: encodes to no tokens")
    model = Transformer(mcfg)
    sd = load_model_state(ck.path, ck.key)
    if mcfg.tie_embeddings:
        sd.setdefault("output.weight", sd["tok_embeddings.weight"])
    model.load_state_dict(sd)
    model.tie_weights()
    model.eval()
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    x = torch.tensor([ids[-mcfg.max_seq_len:]], dtype=torch.long)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(x[:, -mcfg.max_seq_len:])[0, -1].float()
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
            if eos is not None and nxt == eos:
                break
            out.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return {"site": ck.site_dir.name, "round": ck.round, "prompt": prompt, "completion": decode(out),
            "tokens": len(out)}
