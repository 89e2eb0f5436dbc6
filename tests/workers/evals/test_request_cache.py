"""Requests built once (``workers.evals.request_cache``): rows scored from cached requests equal lm-eval's own pass
(``request_cache=False``) on every packaged log-likelihood task; the key follows the tokenizer's content and the task
config; a second run reads the entry instead of building it; a damaged entry is rebuilt with a warning; a failed
write leaves the old entry whole.

Every test runs under the session's own ``CTXSPARSE_HOME`` (tests/conftest.py), each in a folder of its own below
it, so no entry comes from an earlier run. The default sample scores every packaged task on a few items with a
one-layer random model that has SmolLM2's vocabulary (its forward costs nothing, the requests are SmolLM2's own),
and two tasks with SmolLM2 itself; the slow sample scores more items of every task with SmolLM2.
"""
from __future__ import annotations

import copy
import dataclasses
import logging

import numpy as np
import pytest

from workers.evals import request_cache as rc
from workers.evals import tasks as tasks_mod
from workers.evals.suites import run_suite
from workers.evals.tasks import SUITES

CACHED = [n for n in SUITES if rc.cacheable(n)]
LL_TOL = 1e-6


def _entries(home) -> list:
    return sorted((home / "requests").glob("*.npz"))


def _assert_same(cached, uncached) -> None:
    """Same rows (values, stderrs, n, fingerprints, subtasks) and items; log-likelihoods within LL_TOL."""
    assert [(r.task, r.metric) for r in cached] == [(r.task, r.metric) for r in uncached]
    for a, b in zip(cached, uncached):
        assert a == b, (a.row(), b.row())          # every field but seconds and items
        assert len(a.items) == len(b.items) == a.n
        for x, y in zip(a.items, b.items):
            assert (x.doc_id, x.gold, x.subtask, x.requests, x.metrics) == \
                (y.doc_id, y.gold, y.subtask, y.requests, y.metrics)
            assert len(x.loglikelihoods) == len(y.loglikelihoods)
            assert max(abs(p - q) for p, q in zip(x.loglikelihoods, y.loglikelihoods)) <= LL_TOL


def _compare(model, tok, name, limit, **kw) -> list:
    before = dict(rc.counts)
    uncached = run_suite(model, tok, [name], limit, keep_items=True, request_cache=False, **kw)
    assert dict(rc.counts) == before                             # lm-eval's pass: no entry read or built
    built = run_suite(model, tok, [name], limit, keep_items=True, **kw)
    assert rc.counts["built"] == before.get("built", 0) + 1
    read = run_suite(model, tok, [name], limit, keep_items=True, **kw)
    assert rc.counts["read"] == before.get("read", 0) + 1
    _assert_same(built, uncached)
    _assert_same(read, uncached)
    return uncached


def test_every_log_likelihood_task_is_cached():
    assert set(CACHED) == {n for n, s in SUITES.items() if s.output_type != "generate_until"}
    assert "mmlu" in CACHED and "lambada_openai" in CACHED and "winogrande" in CACHED and len(CACHED) == 12


@pytest.mark.parametrize("name", CACHED)
def test_cached_rows_equal_lm_evals_pass_tiny(tiny, home, name):
    """Every packaged task, a few items (MMLU: one per subject), the one-layer model; batches of 4."""
    model, tok = tiny
    rows = _compare(model, tok, name, 1 if name == "mmlu" else 3, batch_size=4)
    assert rows[0].n == (57 if name == "mmlu" else 3)
    assert len(_entries(home)) == 1


@pytest.mark.parametrize("name,limit", [pytest.param("copa", 6, marks=pytest.mark.slow), ("lambada_openai", 4)])
def test_cached_rows_equal_lm_evals_pass_smollm2(smollm2, home, name, limit):
    _compare(smollm2.model, smollm2.tokenizer, name, limit, batch_size=4)


def test_cached_rows_equal_in_token_batches(smollm2, home):
    """Batches of at most 40 padded tokens (one to three of COPA's windows each): the same batches on both paths."""
    _compare(smollm2.model, smollm2.tokenizer, "copa", 4, batch_size=8, batch_tokens=40)


@pytest.mark.slow
@pytest.mark.parametrize("name", CACHED)
def test_cached_rows_equal_lm_evals_pass_smollm2_every_task(smollm2, home, name):
    _compare(smollm2.model, smollm2.tokenizer, name, 2 if name == "mmlu" else 12, batch_size=8)


# ---------------------------------------------------------------------------------------------------- keys
def _key(model, tok, name="copa", limit=4, seed=0) -> str:
    from workers.evals.scoring_lm import ScoringLM

    return rc.entry_key(name, limit, seed, ScoringLM(pretrained=model, tokenizer=tok, batch_size=4))


def test_key_follows_the_tokenizer_content_not_its_object_or_name(tiny):
    model, tok = tiny
    base = _key(model, tok)
    same = copy.deepcopy(tok)
    same.name_or_path = "somewhere/else"                       # same content under another name: same key
    assert _key(model, same) == base

    added = copy.deepcopy(tok)
    added.add_tokens(["<ctxsparse-test-token>"])
    assert _key(model, added) != base
    templated = copy.deepcopy(tok)
    templated.chat_template = "{{ messages[0]['content'] }}"
    assert _key(model, templated) != base
    norm = copy.deepcopy(tok)                                 # a changed pipeline, same vocabulary and name
    from tokenizers import normalizers
    norm.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert _key(model, norm) != base
    assert len({base, _key(model, added), _key(model, templated), _key(model, norm)}) == 4

    in_place = copy.deepcopy(tok)                             # changed after its key was memoized
    assert _key(model, in_place) == base
    in_place.add_tokens(["<ctxsparse-in-place>"])
    assert _key(model, in_place) != base


@pytest.mark.slow      # Gemma-3's 262k-entry tokenizer loaded and serialized (tens of seconds on 2 cores); the key
                       # following a tokenizer's content is in the default suite above (tiny tokenizer, five ways)
def test_key_follows_the_gemma3_tokenizer(tiny):
    from transformers import AutoTokenizer

    from workers.loading.models import packaged_tokenizer_folder

    model, tok = tiny
    gemma = AutoTokenizer.from_pretrained(packaged_tokenizer_folder("gemma3-270m"))
    assert _key(model, gemma) != _key(model, tok)


def test_key_follows_the_task_config(tiny, monkeypatch):
    model, tok = tiny
    base = _key(model, tok)
    assert _key(model, tok) == base                                            # stable
    assert len({base, _key(model, tok, limit=5), _key(model, tok, limit=None), _key(model, tok, seed=1),
                _key(model, tok, name="piqa")}) == 5
    monkeypatch.setitem(SUITES, "copa", dataclasses.replace(SUITES["copa"], version=2))
    assert _key(model, tok) != base
    monkeypatch.setitem(SUITES, "copa", dataclasses.replace(SUITES["copa"], version=1,
                                                            overrides=(("num_fewshot", 0),)))
    assert _key(model, tok) != base
    monkeypatch.undo()
    assert _key(model, tok) == base
    # the shipped data's fingerprint is part of the key
    monkeypatch.setattr(rc, "packaged_data_fingerprint", lambda spec: "other data")
    assert _key(model, tok) != base


# ---------------------------------------------------------------------------------------------------- reuse
def test_second_run_reads_the_entry_and_builds_no_task(tiny, home, monkeypatch):
    model, tok = tiny
    first = run_suite(model, tok, ["piqa"], 4, keep_items=True)
    (path,) = _entries(home)
    stat = path.stat()
    builds = []
    real = tasks_mod.build_task
    monkeypatch.setattr(tasks_mod, "build_task", lambda *a, **k: builds.append(a) or real(*a, **k))
    before = dict(rc.counts)
    second = run_suite(model, tok, ["piqa"], 4, keep_items=True)
    assert rc.counts["built"] == before["built"] and rc.counts["read"] == before.get("read", 0) + 1
    assert builds == []                                        # no lm-eval task built: no data read, no template
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_ino == stat.st_ino
    _assert_same(second, first)
    run_suite(model, tok, ["piqa"], 5)                         # another item selection: its own entry
    assert rc.counts["built"] == before["built"] + 1 and len(_entries(home)) == 2 and builds


def _damage_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _damage_flip(path):
    """Bytes inverted at the end of the strings' data (just before the next member's header): the file still
    opens and parses, the member's CRC no longer matches."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    names = [i.filename for i in infos]
    end = infos[names.index("text.npy") + 1].header_offset
    data = bytearray(path.read_bytes())
    data[end - 4:end] = bytes(b ^ 0xFF for b in data[end - 4:end])
    path.write_bytes(bytes(data))


def _damage_garbage(path):
    path.write_bytes(b"not an archive")


def _damage_out_of_range(path):
    """A readable archive with the right key whose scoring order points past its requests."""
    arrays = rc.read_arrays(path)
    arrays["members"] = arrays["members"].copy()
    arrays["members"][0] = len(arrays["req_ctx"]) + 7
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip, _damage_garbage, _damage_out_of_range],
                         ids=["truncated", "bit-flipped", "garbage", "out-of-range"])
def test_damaged_entry_is_rebuilt_with_a_warning(tiny, home, caplog, damage):
    model, tok = tiny
    first = run_suite(model, tok, ["arc_easy"], 3, keep_items=True)
    (path,) = _entries(home)
    damage(path)
    before = dict(rc.counts)
    with caplog.at_level(logging.WARNING, logger=rc.__name__):
        again = run_suite(model, tok, ["arc_easy"], 3, keep_items=True)
    assert any("building it again" in r.getMessage() and path.name in r.getMessage() for r in caplog.records)
    assert rc.counts["rebuilt"] == before.get("rebuilt", 0) + 1 and rc.counts["built"] == before["built"] + 1
    _assert_same(again, first)
    third = run_suite(model, tok, ["arc_easy"], 3, keep_items=True)          # the rebuilt entry reads
    assert rc.counts["read"] == before.get("read", 0) + 1
    _assert_same(third, first)


def test_a_failed_write_leaves_the_old_entry_whole(tiny, home, monkeypatch):
    model, tok = tiny
    run_suite(model, tok, ["copa"], 3)
    (path,) = _entries(home)
    old = path.read_bytes()
    from workers.evals.scoring_lm import ScoringLM

    hflm = ScoringLM(pretrained=model, tokenizer=tok, batch_size=4)
    rs = rc.load_or_build("copa", 3, 0, hflm)
    real = np.savez

    def half_then_fail(f, **arrays):
        real(f, **arrays)
        f.truncate(f.tell() // 2)
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        rc.save(rs, path)
    assert path.read_bytes() == old                                           # readers still see the whole entry
    assert [p.name for p in path.parent.iterdir()] == [path.name]            # and no temporary file is left


def test_prepare_requests_builds_what_the_first_evaluation_reads(tiny, home):
    from workers.evals.suites import prepare_requests

    model, tok = tiny
    assert prepare_requests(model, tok, ["copa", "gsm8k_cot"], 3) == {"copa": "built", "gsm8k_cot": "lm-eval"}
    assert prepare_requests(model, tok, "copa", 3) == {"copa": "read"}
    before = dict(rc.counts)
    (row,) = run_suite(model, tok, ["copa"], 3)
    assert rc.counts["built"] == before["built"] and rc.counts["read"] == before["read"] + 1 and row.n == 3
