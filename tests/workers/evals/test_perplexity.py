import pytest
import torch

from workers.loading.data import TokenSet, token_windows
from workers.evals.perplexity import perplexity


# two short windows by default (SmolLM2 scores ~100 tokens/s on a 2-core CPU; ppl 59 there), 4 x 512 in the slow
# suite (ppl 40-60)
@pytest.mark.parametrize("n_tokens, seq_len", [(256, 128), pytest.param(2048, 512, marks=pytest.mark.slow)])
def test_smollm2_heldout_perplexity_is_that_of_a_language_model(smollm2, n_tokens, seq_len):
    toks = token_windows(smollm2.tokenizer, "lambada", "heldout", n_tokens, seq_len)
    p = perplexity(smollm2.model, toks)
    n_windows = n_tokens // seq_len
    assert n_windows >= 2 and p.n_tokens == n_tokens - n_windows   # first token of each window has no context
    assert 20 < p.ppl < 80                       # a 135M model on novel prose (vocab 49k: uniform = 49152)
    assert p.stderr_nll is not None and p.stderr_nll > 0
    # the same tokens shuffled within each window lose all structure: perplexity must jump
    g = torch.Generator().manual_seed(0)
    shuffled = torch.stack([w[torch.randperm(w.numel(), generator=g)] for w in toks.windows])
    q = perplexity(smollm2.model, TokenSet(shuffled, "shuffled", "heldout", n_tokens, 0, "x"))
    assert q.ppl > 10 * p.ppl


def test_one_window_has_no_standard_error_and_its_row_is_storable():
    """The standard error over windows needs two of them: one window gives None (stored as no stderr), not NaN."""
    from db.schemas import AccuracyRow
    from tests.workers.tiny_model_support import tiny_model

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 128, (2, 16), generator=g)
    one = perplexity(model, TokenSet(windows[:1], "random", "heldout", 16, 0, "x"))
    two = perplexity(model, TokenSet(windows, "random", "heldout", 32, 0, "y"))
    assert one.n_tokens == 15 and one.stderr_nll is None and one.ppl > 1
    assert two.n_tokens == 30 and two.stderr_nll > 0
    prov = {"package_versions": {"torch": torch.__version__}, "git_rev": "0123abcd"}
    row = AccuracyRow(suite="perplexity", task="random-heldout", metric="nll", higher_is_better=False, value=one.nll,
                      stderr=one.stderr_nll, n=one.n_tokens, **prov)
    assert row.stderr is None and row.value == one.nll
