"""A Qwen2-family model given as a GGUF file by path runs the input-sparsity recipe (TEAL, LaRoSA, R-Sparse) with no
family-specific code: load, capture, fit, save the bundle, decode it.

No Qwen2 GGUF ships in a package, so the test writes one: a small random Qwen2 (Hugging Face ``Qwen2Config``, with
random norm gains and q/k/v biases) in the layout llama.cpp's converter gives Qwen2 checkpoints -- architecture
``qwen2``, ``qwen2.*`` hyperparameters, ``blk.N.attn_q.weight`` / ``.bias`` tensor names with no query/key row
permutation (llama.cpp permutes those for ``llama`` only), norms and biases in F32, no ``output.weight`` where the
embedding is tied -- and SmolLM2's byte-level BPE tokenizer as ``tokenizer.ggml.*`` fields (model ``gpt2``, tokens,
token types, merges, special ids). Matrices are F32 (the round trip is exact; the decode runtime multiplies the
file's F32 blocks) or Q8_0 (loading checked against the gguf package's own quantize/dequantize).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.workers.tiny_model_support import randomize_norms_and_biases
from workers.loading.data import TokenSet

PROMPT = "The quick brown fox jumps over the lazy dog because"
ROPE_THETA = 1_000_000.0       # Qwen2's, not the config class's default: a value that must travel through the file


def qwen2_model(vocab_size: int, seed: int = 0, tied: bool = False):
    """A 2-layer random Qwen2 (d 64, 4 query / 2 KV heads of 16, D 128) with random norm gains and q/k/v biases.
    ``tied``: the LM head is the embedding (Qwen2-0.5B/1.5B; the file then has no ``output.weight``). A tiny
    random model with a tied head echoes its input token (h·e_t dominates every logit), so its greedy tokens say
    nothing about a sparse runtime: the untied layout (Qwen2-7B's) is the one decoded here."""
    import transformers as tf

    cfg = tf.Qwen2Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=tied,
                         rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA})
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    return randomize_norms_and_biases(model, seed)


# HF parameter name (inside a decoder layer) -> llama.cpp tensor name
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3          # llama.cpp token types


def tokenizer_fields(tok, n_vocab: int | None = None) -> dict:
    """A byte-level BPE tokenizer's tokens (by id), token types (its added special tokens CONTROL) and merges
    ("a b"), for ``tokenizer.ggml.*``. ``n_vocab``: only its first n_vocab tokens and the merges that make them (in
    SmolLM2's BPE merge k makes token 252 + k, so that is a merge-list prefix: a smaller BPE that encodes any text
    whose full encoding uses no later token to the same ids)."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    assert spec["model"]["type"] == "BPE"
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    assert None not in tokens
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    if n_vocab is not None:
        first = len(tokens) - len(merges)          # the id merge 0 makes
        assert all(vocab[m.replace(" ", "")] == first + k for k, m in enumerate(merges))
        tokens, merges = tokens[:n_vocab], merges[:n_vocab - first]
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    types = [_TOKEN_CONTROL if t in special else _TOKEN_NORMAL for t in tokens]
    return {"tokens": tokens, "types": types, "merges": merges}


def write_qwen2_gguf(model, tok, path, qtype: str = "F32"):
    """``model`` (a Qwen2ForCausalLM) and ``tok`` (SmolLM2's tokenizer, cut to the model's vocabulary) as a GGUF
    file at ``path``: matrices in ``qtype`` (F32, F16 or Q8_0), norms and biases F32."""
    import gguf

    cfg = model.config
    q = gguf.GGMLQuantizationType[qtype]
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("ctxsparse tiny random qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(file_type)
    fields = tokenizer_fields(tok, cfg.vocab_size if cfg.vocab_size < len(tok) else None)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")           # what llama.cpp's converter names SmolLM2's pre-tokenizer
    w.add_token_list(fields["tokens"])
    w.add_token_types(fields["types"])
    w.add_token_merges(fields["merges"])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(False)

    def add(name, t: torch.Tensor):
        a = t.detach().to(torch.float32).numpy()
        if a.ndim == 1 or name.endswith("_norm.weight") or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)

    sd = model.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, name in _LAYER_TENSORS.items():
            add(f"blk.{i}.{name}", sd[f"model.layers.{i}.{hf}"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- the tests
SMALL_VOCAB = 4096      # the first 4,096 of SmolLM2's tokens: the file's tokenizer fields parse in a fraction of a
                        # second (the full 49,152 tokens and 48,900 merges: about 3 s per parse, and transformers'
                        # conversion parses the file 3 times, the runtime's block reader once per run)
PROSE = "The cat is on the table and the dog is in the house."   # SmolLM2 ids all < SMALL_VOCAB


@pytest.fixture(scope="module")
def smol_tok():
    """SmolLM2's tokenizer (its float cache's copy, checked against the reference ids)."""
    from transformers import AutoTokenizer

    from workers.loading.models import packaged_tokenizer_folder

    return AutoTokenizer.from_pretrained(packaged_tokenizer_folder("smollm2-135m"))


def _written(root, tok, vocab: int, *, tied: bool = False, qtype: str = "F32"):
    """(random HF Qwen2, its GGUF's path, that GGUF loaded by path by workers.loading)."""
    from workers.loading.models import load_model

    hf = qwen2_model(vocab, tied=tied)
    path = write_qwen2_gguf(hf, tok, root / f"tiny-qwen2-{qtype.lower()}{'-tied' if tied else ''}.gguf", qtype)
    return hf, str(path), load_model(str(path))


@pytest.fixture(scope="module", params=["small-vocab", pytest.param("full-vocab", marks=pytest.mark.slow)])
def qwen2(request, tmp_path_factory, smol_tok):
    """The random HF Qwen2, its F32 GGUF, that GGUF loaded by path, and a work folder. The model cache is the
    test's own: a conversion left by an earlier run would skip the GGUF parsing under test."""
    root = tmp_path_factory.mktemp(f"qwen2-gguf-{request.param}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CTXSPARSE_MODEL_CACHE", str(root / "model-cache"))
        yield *_written(root, smol_tok, SMALL_VOCAB if request.param == "small-vocab" else len(smol_tok)), root


def test_qwen2_gguf_loads_as_the_model_it_was_written_from(qwen2, smol_tok):
    """Family qwen2 from the file alone; config values, biases, norms and the LM head survive: the logits are the
    HF model's (F32: exact up to the file's float32 rms epsilon). The tokenizer rebuilt from the file's fields
    encodes prose as SmolLM2's does (not every text: transformers gives a qwen2 file Qwen2's pre-tokenizer, which
    splits whitespace runs otherwise than SmolLM2's, as it should for a real Qwen2 file). The blocks the decode
    runtime reads are the file's F32 matrices, unpermuted (qwen2), bit-equal to the loaded model's."""
    from workers.decode.quant_weights import from_gguf
    from workers.loading.gguf_tensors import read_gguf_matrices

    hf, path, lm, _ = qwen2
    assert lm.family == "qwen2" and lm.meta["kind"] == "gguf" and lm.source == path
    cfg = lm.model.config
    assert cfg.vocab_size == hf.config.vocab_size and cfg.max_position_embeddings == 256
    assert cfg.rope_parameters["rope_theta"] == ROPE_THETA and not cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == pytest.approx(1e-6, rel=1e-7)          # a float32 in the file
    assert (lm.dims.d, lm.dims.D, lm.dims.n_layers, lm.dims.n_heads, lm.dims.n_kv_heads, lm.dims.head_dim) == \
        (64, 128, 2, 4, 2, 16)
    want = smol_tok(PROSE)["input_ids"]
    assert max(want) < SMALL_VOCAB and lm.tokenizer(PROSE)["input_ids"] == want
    assert lm.tokenizer.decode(lm.tokenizer(PROMPT)["input_ids"]) == PROMPT
    assert lm.tokenizer.eos_token_id == smol_tok.eos_token_id == 2           # <|im_end|>
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-6)
    g = read_gguf_matrices(path)
    assert g.architecture == "qwen2" and set(g.types) == {"F32"} and "output.weight" in g.matrices
    w = from_gguf(lm.model, path)           # verify (default): each block bit-equal to the model's matrix
    assert w.family == "qwen2" and w.layers[0].b_qkv is not None and w.lm_head is not w.embed
    assert w.lm_head.shape == (cfg.vocab_size, 64) and w.lm_head.parts[0].fmt.name == "F32"


def test_the_plain_reader_reads_what_gguf_py_reads(qwen2):
    """open_gguf (plain arrays over the memory map) gives gguf-py's reader's fields and tensors, byte for byte."""
    import gguf

    from workers.loading.gguf_tensors import open_gguf

    _, path, _, _ = qwen2
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields) and "tokenizer.ggml.tokens" in ours.fields
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.data, g.types) == (f.offset, f.data, f.types), name
        assert [bytes(p) for p in g.parts] == [bytes(p) for p in f.parts], name
        assert all(type(p) is np.ndarray for p in g.parts)          # no memmap slices
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_qwen2_gguf_q8_0_with_a_tied_embedding(tmp_path, monkeypatch, smol_tok):
    """Q8_0 matrices and no ``output.weight`` (Qwen2-0.5B's layout): the loaded model's matrices are the gguf
    package's Q8_0 round trip of the HF model's, its norms and biases the HF model's (F32), its head tied to the
    embedding; the runtime's blocks dequantize bit for bit to those matrices and its LM head is the embedding's.
    Converting the file to the float cache parses it once."""
    import gguf

    from workers.decode.quant_weights import from_gguf
    from workers.loading.gguf_tensors import read_gguf_matrices

    monkeypatch.setenv("CTXSPARSE_MODEL_CACHE", str(tmp_path / "model-cache"))
    parses = []
    real_init = gguf.GGUFReader.__init__        # every reader (workers.loading.gguf_tensors' plain one too)
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda r, p, *a, **k: parses.append(p) or real_init(r, p, *a, **k))
    hf, path, lm = _written(tmp_path, smol_tok, SMALL_VOCAB, tied=True, qtype="Q8_0")
    # transformers reads the file for the tokenizer, the config and the weights: the conversion parses it once
    assert len(parses) == 1
    monkeypatch.setattr(gguf.GGUFReader, "__init__", real_init)
    assert lm.family == "qwen2" and lm.model.config.tie_word_embeddings
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()
    q8 = gguf.GGMLQuantizationType.Q8_0
    got = lm.model.state_dict()
    for name, want in hf.state_dict().items():
        if want.ndim == 2:
            want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(want.numpy(), q8), q8))
        assert torch.equal(got[name], want), name
    g = read_gguf_matrices(path)
    assert g.types == {"Q8_0": 15, "F32": 11} and "output.weight" not in g.matrices
    w = from_gguf(lm.model, path)           # verify (default): bit-equal dequantization
    assert w.lm_head is w.embed and w.embed.parts[0].fmt.name == "Q8_0"


def _tokens(vocab: int, seed: int = 0, n_windows: int = 8, seq_len: int = 32) -> TokenSet:
    w = torch.randint(0, vocab, (n_windows, seq_len), generator=torch.Generator().manual_seed(seed))
    return TokenSet(w, "random", "calib", n_windows * seq_len, 0, f"random-{vocab}-{seed}-{n_windows}-{seq_len}")


@pytest.fixture(scope="module")
def qwen2_cache(qwen2):
    """What a sweep's collect records on 8 random windows of 32 tokens, with the covariances LaRoSA needs."""
    from workers.sparsity.capture import capture_activations, sweep_components

    _, _, lm, root = qwen2
    return capture_activations(lm, _tokens(lm.model.config.vocab_size), root=root / "acts", progress=False,
                               dtype="float32", components=sweep_components(["cov"]))


@pytest.mark.parametrize("method, options, sparse_weights", [
    ("teal", {}, "gguf:F32"),
    ("larosa", {"rotate_o": False}, "fp32"),          # rotations fold into float weights
    ("rsparse", {"rho": 0.9}, "gguf:F32"),            # low-rank terms beside the blocks' input-sparse rows
])
def test_qwen2_gguf_bundle_generates_hf_tokens(qwen2, qwen2_cache, method, options, sparse_weights):
    """Fit at s = 0.4, save the bundle, run it by the GGUF's path: the decode runtime's greedy tokens are Hugging
    Face's with the bundle applied, at about the fitted sparsity (LaRoSA: o's rotation off, so that HF's dense
    prompt pass leaves the cache in the runtime prefill's basis, as in tests/workers/decode/test_generate.py)."""
    from tests.workers.decode.test_generate import _hf_greedy
    from workers.decode.generate import run_bundle
    from workers.sparsity.bundle import save_bundle
    from workers.sparsity.predictors import FitContext, fit_method

    _, path, lm, root = qwen2
    plan = fit_method(method, FitContext(lm, qwen2_cache, list(range(lm.dims.n_layers))), 0.4, **options)
    bundle = save_bundle(plan, lm, root / f"{method}-0.4", method=method, sparsity=0.4, options=options)
    res = run_bundle(path, bundle, PROMPT, tokens=8, repeats=1, threads=1)
    assert res.extra["weights"] == "gguf:F32" and res.extra["sparse_weights"] == sparse_weights, res.extra
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]])
    assert res.tokens == _hf_greedy(lm.model, bundle, ids, 8)
    if lm.model.config.vocab_size == SMALL_VOCAB:   # seeded: the bundle changes this model's greedy tokens (with
        assert res.tokens != res.dense_tokens       # each method), so the equality above checks the sparse path
    sp = res.realized_sparsity
    assert 0.3 < sp["inputs"] < 0.5, sp        # thresholds fitted to 0.4 on 256 calibration tokens
    if method == "teal":                        # the skipped inputs' weight columns are all it saves
        assert sp["weights"] == sp["inputs"], sp
    else:                                       # the adapters / low-rank factors read are charged
        assert 0.2 < sp["weights"] < sp["inputs"], sp
