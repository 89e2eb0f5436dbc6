import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workers.loading.data import DataError, documents, split_documents, token_windows


def test_lambada_and_boolq_passages_ship_in_the_package():
    lam = list(documents("lambada"))
    assert len(lam) == 5153 and all(isinstance(t, str) and len(t) > 50 for t in lam[:50])
    boolq = list(documents("boolq-passages"))
    assert len(boolq) > 1000


@pytest.mark.parametrize("source", ["lambada", "boolq-passages"])
def test_calib_and_heldout_never_share_a_document(source):
    calib = set(split_documents(source, "calib"))
    held = set(split_documents(source, "heldout"))
    assert calib and held and not (calib & held)
    frac = len(held) / (len(held) + len(calib))
    assert 0.15 < frac < 0.25          # heldout_frac=0.2 by hash
    assert list(split_documents(source, "heldout"))[:5] == list(split_documents(source, "heldout"))[:5]


def test_token_budget_windows_and_fingerprint(smollm2):
    tok = smollm2.tokenizer
    a = token_windows(tok, "lambada", "calib", 2000, 256)
    assert a.windows.shape == (7, 256) and a.n_tokens == 7 * 256 and a.prefix_len == 0
    b = token_windows(tok, "lambada", "calib", 2000, 256)
    assert a.fingerprint == b.fingerprint and (a.windows == b.windows).all()
    h = token_windows(tok, "lambada", "heldout", 2000, 256)
    assert h.fingerprint != a.fingerprint
    longer = token_windows(tok, "lambada", "calib", 4000, 256)
    assert (longer.windows[:7] == a.windows).all()   # a bigger budget extends, never reshuffles


def test_local_files(tmp_path, smollm2):
    docs = [" ".join([f"Document number {i} talks about the weather in town {i}."] * 8) for i in range(60)]
    (tmp_path / "d.txt").write_text("\n\n".join(docs))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet")
    sets = [token_windows(smollm2.tokenizer, str(tmp_path / f), "calib", 512, 128).windows
            for f in ("d.txt", "d.jsonl", "d.parquet")]
    assert (sets[0] == sets[1]).all() and (sets[1] == sets[2]).all()


def test_bad_data_is_a_clear_error(tmp_path, smollm2):
    with pytest.raises(DataError, match="data file not found"):
        list(documents(str(tmp_path / "missing.txt")))
    (tmp_path / "x.jsonl").write_text('{"body": "hi"}\n')
    with pytest.raises(DataError, match="no field 'text'"):
        list(documents(str(tmp_path / "x.jsonl")))
    (tmp_path / "y.jsonl").write_text('{"text": \n')
    with pytest.raises(DataError, match="not valid JSON"):
        list(documents(str(tmp_path / "y.jsonl")))
    with pytest.raises(DataError, match="has only"):
        token_windows(smollm2.tokenizer, "lambada", "heldout", 10_000_000, 512)
    with pytest.raises(DataError, match="split must be one of"):
        list(split_documents("lambada", "train"))
