import torch

from workers.loading.data import TokenSet, token_windows
from workers.evals.perplexity import perplexity


def test_smollm2_heldout_perplexity_is_that_of_a_language_model(smollm2):
    toks = token_windows(smollm2.tokenizer, "lambada", "heldout", 2048, 512)
    p = perplexity(smollm2.model, toks)
    assert p.n_tokens == 2048 - 4                # first token of each window has no context
    assert 20 < p.ppl < 80                       # a 135M model on novel prose (vocab 49k: uniform = 49152)
    # the same tokens shuffled within each window lose all structure: perplexity must jump
    g = torch.Generator().manual_seed(0)
    shuffled = torch.stack([w[torch.randperm(w.numel(), generator=g)] for w in toks.windows])
    q = perplexity(smollm2.model, TokenSet(shuffled, "shuffled", "heldout", 2048, 0, "x"))
    assert q.ppl > 10 * p.ppl
