"""Activation capture: forward hooks per decoder layer, streamed to safetensors shards with a JSON manifest.

Components recorded per layer and token (prefix tokens such as BOS are not recorded):
  ``residual``   the residual stream entering the layer                     [N, d]
  ``ffn_in``     the FFN input after its norm (input of up/fc1)              [N, d]
  ``gate``       the gate pre-activation (gated MLPs) or the fc1 output      [N, D]
  ``inter``      the FFN intermediate act(gate)*up, or act(fc1) (input of down) [N, D]
  ``head_norm``  each attention head's output norm (input of o_proj, per head)  [N, n_heads]
and once per token, not per layer, ``final``: the decoder's output after its last norm, the output head's input
[N, d] (``ActivationCache.load_final``; what the predicted head is fitted from); and, not per token,
``inhist``: per projection (q, k, v, o, gate, up, down) a histogram of its input on the fixed grid of
:mod:`workers.sparsity.histograms`, int32 [3, bins] per shard: |x| over x > 0, |x| over x <= 0, and
|x_i|·‖W[:, i]‖₂ (input-sparsity calibration; ``ActivationCache.load_hist`` sums the shards); and ``cov``: per
layer the uncentred covariances Σ n nᵀ (float32, summed over every recorded token, written once, into the last
shard) of the rms-normalized block inputs before the norm's gain, n = h / rms(h), at the attention
(``attn_in`` [d, d]) and at the FFN (``ffn_in`` [d, d]), and of the attention output (o's input) per KV head
group, Σ over the group's query heads of a_h a_hᵀ (``o`` [n_kv_heads, head_dim, head_dim]): what the rotations
of :mod:`workers.methods.larosa.fit` are fitted from (``ActivationCache.load_cov``). SmolLM2: 81 MB per
cache whatever its token count (benchmarks/results/history-quality.md, "LaRoSA"); RMSNorm models only.

The cache key is sha256(model fingerprint, data fingerprint, token budget, dtype, components, layers, format).
Shards hold ``shard_tokens`` tokens each (sized from a memory budget), so memory stays bounded whatever the
budget. Everything is written into a scratch folder and published by one rename, manifest last: an interrupted
write never leaves a cache that looks complete. The manifest records each shard's size and sha256; a cache hit in
``capture_activations`` checks both (the digest once per process and shard file: a shard rewritten since, with a
new mtime or inode, is hashed again), and a shard that does not match makes the cache invalid: it is moved aside
and collected again. sha256 costs about 1.3 s per GB of shards on one CPU core.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.loading.adapters import get_path
from workers.loading.data import TokenSet
from workers.loading.models import LoadedModel
from workers.sparsity.norms import is_rms_norm, rms_normalized
from workers.paths import atomic_dir, home, sha256_file
from workers.sparsity.histograms import N_COUNTS, bin_of_log, signed_histograms
from workers.sparsity.input_sparse import SHARED_INPUT, column_norms, projection_modules

log = logging.getLogger(__name__)

PER_TOKEN = ("residual", "ffn_in", "gate", "inter", "head_norm")   # the components stored [N, dim] per layer
FINAL = "final"                                # the output head's input, stored [N, d] once (not per layer)
COMPONENTS = PER_TOKEN + (FINAL, "inhist", "cov")   # + the per-shard input histograms, the block input covariances
COV_INPUTS = ("attn_in", "ffn_in", "o")        # the covariances ``cov`` records per layer
OPTIONAL = (FINAL, "cov")   # what a sweep's collect records only when a setting needs it (predictors CAPTURES, head)


def sweep_components(extra=()) -> tuple[str, ...]:
    """The components a sweep's collect records: every one but the OPTIONAL ones not in ``extra``."""
    return tuple(c for c in COMPONENTS if c not in OPTIONAL or c in extra)
# shard path -> (sha256, size, mtime_ns, ctime_ns, inode) of a file whose digest this process has checked
_VERIFIED: dict[str, tuple] = {}
FORMAT_VERSION = 1
_STORE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class CacheCorruptError(RuntimeError):
    pass


@dataclass
class ActivationCache:
    path: Path
    manifest: dict
    hit: bool = False

    @property
    def n_tokens(self) -> int:
        return self.manifest["n_tokens"]

    @property
    def layers(self) -> list[int]:
        return self.manifest["layers"]

    @property
    def components(self) -> list[str]:
        return self.manifest["components"]

    def size_bytes(self) -> int:
        return sum(s["bytes"] for s in self.manifest["shards"])

    def load(self, layer: int, component: str, dtype: torch.dtype = torch.float32,
             max_tokens: int | None = None) -> torch.Tensor:
        """All recorded tokens of one layer's component, [N, dim], concatenated over shards."""
        if component not in PER_TOKEN:
            raise KeyError(f"{component!r} is not a per-layer component (histograms: load_hist; {FINAL}: load_final)")
        if component not in self.components or layer not in self.layers:
            raise KeyError(f"cache has no {component!r} for layer {layer} "
                           f"(components {self.components}, layers {self.layers[0]}..{self.layers[-1]})")
        return self._tokens(f"{layer}.{component}", dtype, max_tokens)

    def load_final(self, dtype: torch.dtype = torch.float32, max_tokens: int | None = None) -> torch.Tensor:
        """The output head's input of every recorded token (``final``), [N, d]."""
        if FINAL not in self.components:
            raise KeyError(f"cache has no {FINAL!r} states (components {self.components}); a sweep records them "
                           "when a setting has a predicted head")
        return self._tokens(FINAL, dtype, max_tokens)

    def _tokens(self, key: str, dtype: torch.dtype, max_tokens: int | None) -> torch.Tensor:
        parts, got = [], 0
        for shard in self.manifest["shards"]:
            if max_tokens is not None and got >= max_tokens:
                break
            try:
                with safe_open(self.path / shard["file"], framework="pt") as f:
                    t = f.get_tensor(key)
            except Exception as e:  # safetensors raises its own error types for damaged files
                raise CacheCorruptError(f"{self.path / shard['file']}: cannot read ({e}); "
                                        "delete the cache folder to collect again") from e
            parts.append(t)
            got += t.shape[0]
        out = torch.cat(parts).to(dtype)
        return out[:max_tokens] if max_tokens is not None else out

    def load_hist(self, layer: int, proj: str) -> torch.Tensor:
        """The input histograms of one projection summed over shards, int64 [3, bins] (see ``inhist``)."""
        if "inhist" not in self.components or layer not in self.layers:
            raise KeyError(f"cache has no input histograms for layer {layer} (components {self.components})")
        total = None
        for t in self._per_shard(f"{layer}.inhist.{proj}"):
            if t is None:
                raise KeyError(f"cache has no input histogram of {proj!r} in layer {layer}")
            total = t.long() if total is None else total + t.long()
        return total

    def _per_shard(self, key: str):
        """``key``'s tensor in each shard in turn (None where a shard lacks it); a damaged shard file raises
        CacheCorruptError."""
        for shard in self.manifest["shards"]:
            try:
                with safe_open(self.path / shard["file"], framework="pt") as f:
                    t = f.get_tensor(key) if key in f.keys() else None
            except Exception as e:  # safetensors raises its own error types for damaged files
                raise CacheCorruptError(f"{self.path / shard['file']}: cannot read ({e}); "
                                        "delete the cache folder to collect again") from e
            yield t

    def load_cov(self, layer: int, name: str) -> torch.Tensor:
        """One of a layer's recorded covariances (``cov``; ``name`` in COV_INPUTS), float64, summed over the shards
        that hold it, with the number of tokens it sums over: (Σ, n)."""
        if "cov" not in self.components or layer not in self.layers:
            raise KeyError(f"cache has no covariances for layer {layer} (components {self.components})")
        if name not in COV_INPUTS:
            raise KeyError(f"no covariance {name!r}; recorded: {COV_INPUTS}")
        total = None
        for t in self._per_shard(f"{layer}.cov.{name}"):
            if t is not None:
                total = t.double() if total is None else total + t.double()
        if total is None:
            raise KeyError(f"cache has no covariance {name!r} in layer {layer}")
        return total, self.n_tokens

    def verify(self, checksums: bool = True) -> None:
        """Every shard exists with its manifest size; with ``checksums``, also its manifest sha256 (a file already
        checked by this process and unchanged since, same size, mtime, ctime and inode, is not hashed again)."""
        for shard in self.manifest["shards"]:
            p = self.path / shard["file"]
            if not p.is_file():
                raise CacheCorruptError(f"{p}: missing shard")
            st = p.stat()
            if st.st_size != shard["bytes"]:
                raise CacheCorruptError(f"{p}: size {st.st_size} != manifest {shard['bytes']}")
            if not checksums:
                continue
            seen = (shard["sha256"], st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            if _VERIFIED.get(str(p)) == seen:
                continue
            if sha256_file(p) != shard["sha256"]:
                raise CacheCorruptError(f"{p}: sha256 does not match the manifest")
            _VERIFIED[str(p)] = seen


def cache_key(model_fp: str, data_fp: str, n_tokens: int, dtype: str, components, layers) -> str:
    blob = json.dumps({"model": model_fp, "data": data_fp, "n_tokens": n_tokens, "dtype": dtype,
                       "components": sorted(components), "layers": list(layers), "format": FORMAT_VERSION},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def open_cache(path: Path, checksums: bool = False) -> ActivationCache:
    manifest_path = Path(path) / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CacheCorruptError(f"{manifest_path}: unreadable manifest ({e})") from e
    if not manifest.get("complete") or manifest.get("format") != FORMAT_VERSION:
        raise CacheCorruptError(f"{manifest_path}: incomplete or old-format cache")
    cache = ActivationCache(Path(path), manifest)
    cache.verify(checksums=checksums)
    return cache


class _Recorder:
    """Forward hooks that append each component's per-token values to in-memory buffers."""

    def __init__(self, lm: LoadedModel, layers: list[int], components: tuple[str, ...], prefix_len: int,
                 store_dtype: torch.dtype, seq_len: int):
        self.buf: dict[str, list[torch.Tensor]] = {}
        self.hist: dict[str, torch.Tensor] = {}
        self.cov: dict[str, torch.Tensor] = {}      # summed over the whole capture, stored with the last shard
        self._memo = None
        self.n_tokens = 0
        self.handles = []
        self.prefix_len = prefix_len
        self.seq_len = seq_len
        self.store_dtype = store_dtype
        ad, dims = lm.adapter, lm.dims
        decoder = ad.decoder_layers(lm.model)
        for l in layers:
            layer = decoder[l]
            ffn = ad.ffn_module(layer)
            attn = ad.attn_module(layer)
            up, down = get_path(ffn, ad.ffn.up), get_path(ffn, ad.ffn.down)
            gate = get_path(ffn, ad.ffn.gate) if ad.ffn.gated else up
            o = get_path(attn, ad.attn.o)
            want = set(components)
            if "residual" in want:
                self.handles.append(layer.register_forward_pre_hook(self._pre(f"{l}.residual"), with_kwargs=True))
            if "ffn_in" in want:
                self.handles.append(up.register_forward_pre_hook(self._pre(f"{l}.ffn_in"), with_kwargs=True))
            if "gate" in want:
                self.handles.append(gate.register_forward_hook(self._post(f"{l}.gate")))
            if "inter" in want:
                self.handles.append(down.register_forward_pre_hook(self._pre(f"{l}.inter"), with_kwargs=True))
            if "head_norm" in want:
                self.handles.append(o.register_forward_pre_hook(
                    self._pre(f"{l}.head_norm", heads=(dims.n_heads, dims.head_dim)), with_kwargs=True))
            if "inhist" in want:
                for p, m in projection_modules(ad, layer).items():
                    self.handles.append(m.register_forward_pre_hook(
                        self._hist(l, p, torch.log10(column_norms(m).clamp_min(1e-30))), with_kwargs=True))
            norms = [get_path(layer, p) for p in (ad.attn.norm, ad.ffn.norm) if p]
            if "cov" in want and len(norms) == 2 and all(is_rms_norm(n) for n in norms):   # else not recorded
                for name, norm in zip(("attn_in", "ffn_in"), norms):
                    self.handles.append(norm.register_forward_pre_hook(self._cov(f"{l}.cov.{name}", norm),
                                                                       with_kwargs=True))
                self.handles.append(o.register_forward_pre_hook(
                    self._cov(f"{l}.cov.o", None, groups=(dims.n_kv_heads, dims.n_heads // dims.n_kv_heads,
                                                           dims.head_dim)), with_kwargs=True))
            if l == layers[0]:   # one hook counts the recorded tokens
                self.handles.append(layer.register_forward_pre_hook(self._count, with_kwargs=True))
        if FINAL in components:    # the decoder's output (after its last norm) is what the head reads
            self.handles.append(lm.model.base_model.register_forward_hook(self._post(FINAL)))

    def _drop_prefix(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, tokens, width] without the prefix tokens. OPT's layers flatten the FFN's input to
        [batch·tokens, width] before its norm, fc1 and fc2: those are put back in windows first."""
        if x.dim() == 2:
            x = x.reshape(-1, self.seq_len, x.shape[-1])
        return x[:, self.prefix_len:]

    def _count(self, module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        self.n_tokens += self._drop_prefix(x).shape[:-1].numel()

    def _hist(self, layer: int, proj: str, log_norms: torch.Tensor):
        name = f"{layer}.inhist.{proj}"

        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            # q, k, v (and gate, up) see the same tensor: its signed histograms and log|x| are computed once
            key = (layer, SHARED_INPUT.get(proj, proj), x.data_ptr(), tuple(x.shape))
            if self._memo is None or self._memo[0] != key:
                self._memo = (key, *signed_histograms(self._drop_prefix(x)))
            _, signed, loga = self._memo
            if proj in ("v", "up"):     # the last reader of a shared input: never reuse it for a later tensor
                self._memo = None
            wina = torch.bincount(bin_of_log(loga + log_norms.to(loga.device)).reshape(-1), minlength=N_COUNTS)
            h = torch.cat([signed, wina[None]])
            self.hist[name] = h if name not in self.hist else self.hist[name] + h
        return hook

    def _cov(self, name: str, norm, groups=None):
        """Σ n nᵀ of a norm's rms-normalized input (``norm``), or per KV group Σ a_h a_hᵀ of o's input (``groups``:
        (n_kv_heads, query heads per KV head, head_dim); HF's repeat_kv gives KV head g the query heads
        g·n_rep .. (g+1)·n_rep - 1). Each batch's sum in float32, the running total in float64."""
        def hook(module, args, kwargs):
            x = self._drop_prefix(args[0] if args else kwargs.get("hidden_states", kwargs.get("input")))
            if norm is not None:
                x = rms_normalized(norm, x).reshape(-1, x.shape[-1])
                c = (x.t() @ x).double()
            else:
                g, rep, hd = groups
                a = x.float().reshape(-1, g, rep, hd).transpose(0, 1).reshape(g, -1, hd)
                c = (a.transpose(1, 2) @ a).double()
            self.cov[name] = c if name not in self.cov else self.cov[name] + c
        return hook

    def _keep(self, name: str, x: torch.Tensor, heads=None) -> None:
        x = self._drop_prefix(x)
        if heads is not None:
            x = x.reshape(*x.shape[:-1], *heads).float().norm(dim=-1)
        self.buf.setdefault(name, []).append(x.reshape(-1, x.shape[-1]).to(self.store_dtype).cpu())

    def _pre(self, name, heads=None):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            self._keep(name, x, heads)
        return hook

    def _post(self, name):
        def hook(module, args, output):
            self._keep(name, output if isinstance(output, torch.Tensor) else output[0])
        return hook

    def take(self, last: bool = False) -> tuple[dict[str, torch.Tensor], int]:
        """(the tensors of one shard, its number of tokens), and the buffers start again; the ``last`` shard also
        gets the covariances of the whole capture."""
        out = {k: torch.cat(v).contiguous() for k, v in self.buf.items()}
        if last:
            out.update({k: c.float().cpu().contiguous() for k, c in self.cov.items()})
            self.cov.clear()
        for k, h in self.hist.items():
            if h.max() > torch.iinfo(torch.int32).max:
                raise OverflowError(f"{k}: histogram count over int32 in one shard; lower max_buffer_mb")
            out[k] = h.to(torch.int32).cpu().contiguous()
        n = self.n_tokens
        self.buf.clear()
        self.hist.clear()
        self._memo = None
        self.n_tokens = 0
        return out, n

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _layers(lm: LoadedModel, layers) -> list[int]:
    layers = list(range(lm.dims.n_layers)) if layers is None else sorted(set(layers))
    if not layers or layers[0] < 0 or layers[-1] >= lm.dims.n_layers:
        raise ValueError(f"layers must lie in 0..{lm.dims.n_layers - 1}")
    return layers


def _ordered(components) -> tuple[str, ...]:
    return tuple(c for c in COMPONENTS if c in components)


def _bytes_per_token(lm: LoadedModel, components, n_layers: int, elem: int) -> int:
    dims = lm.dims
    width = {"residual": dims.d, "ffn_in": dims.d, "gate": dims.D, "inter": dims.D, "head_norm": dims.n_heads,
             "inhist": 0, "cov": 0, FINAL: 0}   # histograms per shard, covariances per cache, not per token
    return n_layers * elem * sum(width[c] for c in components) + (elem * dims.d if FINAL in components else 0)


def capture_activations(lm: LoadedModel, tokens: TokenSet, components: tuple[str, ...] = COMPONENTS,
                        layers: list[int] | None = None, dtype: str = "auto", max_buffer_mb: int = 512,
                        batch_windows: int = 4, root: Path | None = None, progress: bool = True) -> ActivationCache:
    """Collect (or find in the cache) the activations of ``lm`` on ``tokens``.

    ``dtype="auto"`` stores float16 (more mantissa for ranking neurons) unless a value overflows it, then
    bfloat16: Gemma-3's residual stream exceeds float16's range (65504) in its later layers.
    """
    if dtype == "auto":
        kw = dict(components=components, layers=layers, max_buffer_mb=max_buffer_mb, batch_windows=batch_windows,
                  root=root, progress=progress)
        for d in ("float16", "bfloat16"):          # an existing cache of either kind is a hit
            key = cache_key(lm.fingerprint, tokens.fingerprint, tokens.n_tokens, d, _ordered(components),
                            _layers(lm, layers))
            if ((root or home() / "activations") / key / "manifest.json").exists():
                return capture_activations(lm, tokens, dtype=d, **kw)
        try:
            return capture_activations(lm, tokens, dtype="float16", **kw)
        except OverflowError as e:
            log.info("%s; storing bfloat16 instead", e)
            return capture_activations(lm, tokens, dtype="bfloat16", **kw)
    bad = set(components) - set(COMPONENTS)
    if bad:
        raise ValueError(f"unknown components {sorted(bad)}; known: {COMPONENTS}")
    if dtype not in _STORE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_STORE_DTYPES)}")
    layers = _layers(lm, layers)
    components = _ordered(components)
    key = cache_key(lm.fingerprint, tokens.fingerprint, tokens.n_tokens, dtype, components, layers)
    final = (root or home() / "activations") / key
    if final.exists():
        try:
            cache = open_cache(final, checksums=True)
            cache.hit = True
            return cache
        except CacheCorruptError as e:
            aside = final.with_name(f".corrupt-{final.name}-{time.time_ns()}")
            log.warning("activation cache invalid (%s); moved to %s and collecting again", e, aside.name)
            os.rename(final, aside)

    _collect(lm, tokens, final, key, dtype, components, layers, max_buffer_mb, batch_windows, progress)
    return ActivationCache(final, json.loads((final / "manifest.json").read_text()), hit=False)


def _collect(lm: LoadedModel, tokens: TokenSet, final: Path, key: str, dtype: str, components, layers: list[int],
             max_buffer_mb: int, batch_windows: int, progress: bool) -> None:
    """Run ``lm`` over ``tokens`` with the recording hooks and publish the shards and their manifest at ``final``."""
    store_dtype = _STORE_DTYPES[dtype]
    payload = tokens.seq_len - tokens.prefix_len
    per_tok = _bytes_per_token(lm, components, len(layers), store_dtype.itemsize)
    windows_per_shard = max(1, (max_buffer_mb << 20) // (max(per_tok, 1) * payload))
    batch = max(1, min(batch_windows, windows_per_shard))
    n_win = tokens.windows.shape[0]
    device = next(lm.model.parameters()).device
    rec = _Recorder(lm, layers, components, tokens.prefix_len, store_dtype, tokens.seq_len)
    shards: list[dict] = []
    t0 = time.time()
    from tqdm.auto import tqdm

    bar = tqdm(total=tokens.n_tokens, unit="tok", unit_scale=True, desc="capture", disable=not progress)
    try:
        with atomic_dir(final) as tmp, torch.inference_mode():
            pending = 0
            for start in range(0, n_win, batch):
                ids = tokens.windows[start:start + batch].to(device)
                lm.model.base_model(input_ids=ids, use_cache=False)
                pending += ids.shape[0]
                bar.update(ids.shape[0] * payload)
                last = start + batch >= n_win
                if pending >= windows_per_shard or last:
                    shards.append(_write_shard(rec, tmp / f"shard-{len(shards):05d}.safetensors", dtype, last))
                    pending = 0
            elapsed = time.time() - t0
            manifest = {
                "format": FORMAT_VERSION, "key": key, "complete": True,
                "model_ref": lm.ref, "model_fingerprint": lm.fingerprint,
                "data_source": tokens.source, "data_split": tokens.split, "data_fingerprint": tokens.fingerprint,
                "n_tokens": tokens.n_tokens, "seq_len": tokens.seq_len, "dtype": dtype,
                "components": list(components), "layers": layers,
                "dims": {"d": lm.dims.d, "D": lm.dims.D, "n_heads": lm.dims.n_heads},
                "shards": shards, "elapsed_s": round(elapsed, 2),
                "tokens_per_s": round(tokens.n_tokens / max(elapsed, 1e-9), 1),
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    finally:
        rec.close()
        bar.close()


def _write_shard(rec: _Recorder, path: Path, dtype: str, last: bool) -> dict:
    """Save what ``rec`` buffered as one shard at ``path``; its manifest entry."""
    tensors, n = rec.take(last)
    bad_t = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad_t:
        raise OverflowError(f"non-finite activations in {bad_t[:3]} when stored as {dtype}; "
                            "capture with dtype='float32' or 'bfloat16'")
    save_file(tensors, str(path))
    return {"file": path.name, "n_tokens": n, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
