"""R-Sparse, rank-aware activation sparsity (method ``rsparse``): each projection computes W on its large inputs and
a low-rank approximation of W on the rest.

Reference: Zhang et al., "R-Sparse: Rank-Aware Activation Sparsity for Efficient LLM Inference", ICLR 2025
(arXiv 2504.19449); code VITA-Group/R-Sparse, ``models/modeling_llama.py`` (``R_Sparse_Linear``, mode
``r_sparse``) and ``utils/prepare_low_rank_weight.py`` (a plain SVD of every linear weight).

For a token x entering projection W ([out, in]) with a part (threshold t, score, rank r, factors A = Σ_r V_rᵀ
[r, in] and B = U_r [out, r], W = U Σ Vᵀ):

    m_i = score_i > t        score_i = |x_i| ("abs") or |x_i|·‖W[:, i]‖₂ ("wina": the reference's scaled input)
    y   = W (x ⊙ m) + B (A (x ⊙ (1 - m)))  (+ W's bias)

so the large inputs go through W's kept columns and the small ones through the rank-r term (r = 0: TEAL's
product; r = min(in, out): W exactly, whatever the mask). One threshold per projection, calibrated on the
activation cache's histograms (the reference calibrates one per linear on one 512-token window), so the number
of kept inputs varies per token, as TEAL's.

**Bytes.** Per token the projection reads the kept columns of W (counted in ``input_sparse.InputStats`` like
TEAL's) and the factors, r·(in + out) elements (``part.lowrank_numel``, charged in "decoder bytes skipped" through
``SparseStats.extra_numel``, as LaRoSA's rotations are). A kernel could read only A's columns of the dropped
inputs; the full factors are charged, as the reference's budget does.

The method's files:

  part.py        its plan part (``RankSparsePlan`` of ``LowRankPart``, kind ``rsparse``): the bundle form, the bytes
  masked.py      the masked form on a Hugging Face model (accuracy rows)
  runtime.py     the decode runtime's form (low-rank terms beside the input-sparse products)
  fit.py         the recipe search and fit (registered as method ``rsparse``)
"""
from workers.methods.rsparse import fit, part  # noqa: F401  (importing registers the method and its part)
