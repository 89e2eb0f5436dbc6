"""The predicted output head (plan part ``head``): the vocabulary as contextual sparsity. A cheap screen scores
every token of the vocabulary from the final hidden state, the top K are the candidates, and exact logits are
computed for the candidates only; the rest of the distribution is the screen's estimate.

References: the ``logits`` screen is the SVD predictors' whitened low-rank scores (arXiv 2603.14110) over the
output head instead of an FFN; published anchors are vector-index output heads (approximate top-k candidates, exact
logits on them) and FlashHead (arXiv 2603.14591: balanced clusters of the head's rows, probed by centroid). The
method's files:

  screen.py    the screens: a rank-r basis of the final hidden state (``hidden``: its PCA) or of the logits
               (``logits``: the head whitened by the hidden states' second moment, its top singular directions)
  part.py      the plan part (``PredictedHead``, kind ``head``): the bundle form and the forms below
  masked.py    the masked form on a Hugging Face model (accuracy rows: the deployed head's distribution)
  runtime.py   the decode runtime's form (the screen, the top K, the candidates' exact rows)
  fit.py       the fit from the activation cache's ``final`` component (the head's input)

The head combines with every decoder method: a sweep's ``head`` key names the head settings and the methods they
are combined with (docs/methods.md).
"""
from workers.methods.head import fit, part  # noqa: F401  (importing registers the part)
