"""Sweep specs: the shipped ones validate; every malformed one fails with the field named, before anything runs."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main as cli_main
from orchestrator.plan import plan_units, settings
from orchestrator.spec import SpecError, check_inputs, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "orchestrator" / "sweeps").glob("*.yaml")) + [ROOT / "k8s" / "sweep.example.yaml"]
GOOD = {"name": "ok", "models": ["smollm2-135m"], "methods": [{"name": "svd", "sparsity": [0.5], "rank": [64]}]}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_specs_are_valid(path):
    spec = load_spec(path)
    assert spec.models and spec.methods


def _with(**changes):
    d = {**GOOD, **changes}
    return {k: v for k, v in d.items() if v is not ...}


BAD = [
    ("not a mapping", ["a", "b"], "a sweep spec is a mapping"),
    ("unknown top-level key", _with(sparsity=[0.5]), "sparsity: unknown key"),
    ("missing name", _with(name=...), "name: Field required"),
    ("bad name chars", _with(name="my sweep!"), "name: String should match pattern"),
    ("no models", _with(models=[]), "models: List should have at least 1 item"),
    ("duplicate models", _with(models=["smollm2-135m", "smollm2-135m"]), "models has duplicates"),
    ("no methods", _with(methods=[]), "methods: List should have at least 1 item"),
    ("unknown method", _with(methods=[{"name": "magic", "sparsity": [0.5]}]), "methods.0.name: Value error, unknown method 'magic'"),
    ("sparsity 1.0", _with(methods=[{"name": "oracle", "sparsity": [1.0]}]), "methods.0.sparsity.0: Input should be less than 1"),
    ("negative sparsity", _with(methods=[{"name": "oracle", "sparsity": [-0.1]}]), "methods.0.sparsity.0: Input should be greater than or equal to 0"),
    ("empty sparsity grid", _with(methods=[{"name": "oracle", "sparsity": []}]), "methods.0.sparsity: List should have at least 1 item"),
    ("rank zero", _with(methods=[{"name": "svd", "sparsity": [0.5], "rank": [0]}]), "methods.0.rank.0: Input should be greater than or equal to 1"),
    ("rank as text", _with(methods=[{"name": "svd", "sparsity": [0.5], "rank": ["big"]}]), "methods.0.rank.0"),
    ("duplicate grid values", _with(methods=[{"name": "oracle", "sparsity": [0.5, 0.5]}]), "sparsity has duplicates"),
    ("grid field as option", _with(methods=[{"name": "svd", "sparsity": [0.5], "options": {"rank": 8}}]), "grid fields, not options"),
    ("unknown method key", _with(methods=[{"name": "svd", "sparsity": [0.5], "ranks": [8]}]), "methods.0.ranks: unknown key"),
    ("bad allocation", _with(methods=[{"name": "svd", "sparsity": [0.5], "allocation": "magic"}]), "methods.0.allocation"),
    ("same method twice", _with(methods=[{"name": "oracle", "sparsity": [0.5]}, {"name": "oracle", "sparsity": [0.7]}]), "listed twice"),
    ("unknown task", _with(suites={"tasks": [{"name": "mmlu-pro"}]}), "suites.tasks.0.name: Value error, unknown task 'mmlu-pro'"),
    ("task limit zero", _with(suites={"tasks": [{"name": "piqa", "limit": 0}]}), "suites.tasks.0.limit"),
    ("no suite at all", _with(suites={"perplexity": None, "tasks": []}), "no suite"),
    ("tiny perplexity budget", _with(suites={"perplexity": {"tokens": 10}}), "suites.perplexity.tokens"),
    ("bad device type", _with(latency={"devices": ["tpu"]}), "latency.devices.0"),
    ("gen_len 1", _with(latency={"gen_len": 1}), "latency.gen_len"),
    ("batch zero", _with(latency={"batch": [0]}), "latency.batch.0"),
    ("calib budget too small", _with(data={"calib_tokens": 10}), "data.calib_tokens"),
    ("unknown data key", _with(data={"tokens": 4096}), "data.tokens: unknown key"),
    ("negative gpus", _with(resources={"gpus_per_actor": -1}), "resources.gpus_per_actor"),
    ("bad accelerator", _with(resources={"accelerator": "tpu"}), "resources.accelerator"),
    ("max_attempts zero", _with(resources={"max_attempts": 0}), "resources.max_attempts"),
    ("unknown shape", _with(models=["shape:llama9-1t"], latency={"devices": ["cuda"]}), "unknown shape(s)"),
    ("shape timed on cpu", _with(models=["shape:llama2-7b"]), "for GPU/NPU latency only"),
    ("unknown model name", _with(models=["smollm3-135m"]), "models.0: Value error, unknown model 'smollm3-135m'"),
    ("perplexity budget below one window", _with(suites={"perplexity": {"tokens": 256, "seq_len": 512}}),
     "suites.perplexity: Value error, tokens (256) is smaller than seq_len (512)"),
    ("calib budget below one window", _with(data={"calib_tokens": 256, "seq_len": 512}),
     "data: Value error, calib_tokens (256) is smaller than seq_len (512)"),
    ("metric budget below one window", _with(data={"metric_tokens": 1024, "seq_len": 2048, "calib_tokens": 4096}),
     "data: Value error, metric_tokens (1024) is smaller than seq_len (2048)"),
    ("svd rank above d", _with(methods=[{"name": "svd", "sparsity": [0.5], "rank": [64, 577]}]),
     "methods.0.rank.1: rank 577 is larger than the hidden size of model 'smollm2-135m' (d = 576)"),
    ("dejavu rank above d", _with(models=["gemma3-270m"], methods=[
        {"name": "oracle", "sparsity": [0.5]}, {"name": "dejavu", "sparsity": [0.5], "rank": [576, 641]}]),
     "methods.1.rank.1: rank 641 is larger than the hidden size of model 'gemma3-270m' (d = 640)"),
    ("shape rank above d", _with(models=["shape:qwen2-7b"], latency={"devices": ["cuda"]},
                                 methods=[{"name": "dejavu", "sparsity": [0.5], "rank": [4096]}]),
     "methods.0.rank.0: rank 4096 is larger than the hidden size of model 'shape:qwen2-7b' (d = 3584)"),
]


@pytest.mark.parametrize("data, match", [(d, m) for _, d, m in BAD], ids=[n for n, _, _ in BAD])
def test_malformed_spec_names_the_field(data, match):
    with pytest.raises(SpecError) as e:
        parse_spec(data, "test.yaml")
    assert match in str(e.value), str(e.value)


def test_rank_up_to_the_hidden_size_is_valid():
    spec = parse_spec(_with(models=["smollm2-135m", "gemma3-270m"],
                            methods=[{"name": "svd", "sparsity": [0.5], "rank": [1, 576]}]))
    assert spec.methods[0].rank == [1, 576]


def test_packaged_hidden_sizes_are_the_models(smollm2):
    """The table the ranks are checked against at submit is the model's own (Gemma-3's: its GGUF's config, checked
    in tests/workers/loading/test_models.py)."""
    from workers.loading.models import PACKAGED_HIDDEN_SIZE

    assert PACKAGED_HIDDEN_SIZE["smollm2-135m"] == smollm2.dims.d == smollm2.model.config.hidden_size


def test_submit_rejects_a_rank_above_the_hidden_size_naming_the_setting(tmp_path, capsys):
    """Found at submit, before a job exists (not at fit time): a packaged model's d is known from its name, a
    local folder's from its config."""
    from transformers import LlamaConfig

    folder = tmp_path / "tiny-llama"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=128).save_pretrained(folder)
    for models, rank, err in ((["smollm2-135m"], 1024, "rank 1024 is larger than the hidden size of model "
                                                       "'smollm2-135m' (d = 576)"),
                              ([str(folder)], 65, f"rank 65 is larger than the hidden size of model '{folder}' "
                                                  "(d = 64)")):
        spec = tmp_path / "s.yaml"
        spec.write_text(yaml.safe_dump(_with(models=models, methods=[{"name": "svd", "sparsity": [0.5],
                                                                       "rank": [8, rank]}])))
        rc = cli_main(["submit", str(spec), "--address", "http://127.0.0.1:1"])   # nothing listens there
        out, e = capsys.readouterr()
        assert rc == 2 and out == "" and "methods.0.rank.1: " + err in e and "Ray" not in e, e
    spec.write_text(yaml.safe_dump(_with(models=[str(folder)], methods=[{"name": "svd", "sparsity": [0.5],
                                                                         "rank": [64]}])))
    assert check_inputs(load_spec(spec)) is None                       # d itself is a valid rank


def test_yaml_and_file_errors_are_spec_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")


def test_submit_rejects_a_bad_spec_before_contacting_ray(tmp_path, capsys):
    bad = tmp_path / "s.yaml"
    bad.write_text(yaml.safe_dump(_with(methods=[{"name": "svd", "sparsity": [1.5]}])))
    rc = cli_main(["submit", str(bad), "--address", "http://127.0.0.1:1"])   # nothing listens there
    err = capsys.readouterr().err
    assert rc == 2 and "methods.0.sparsity.0" in err and "Ray" not in err


def test_hash_covers_defaults_and_ignores_key_order():
    a = parse_spec(GOOD)
    b = parse_spec({"methods": GOOD["methods"], "models": GOOD["models"], "name": "ok",
                    "data": {"source": "lambada"}})            # a default written out
    c = parse_spec({**GOOD, "seed": 1})
    assert a.spec_hash() == b.spec_hash() != c.spec_hash()


def _described(spec):
    return {m: {"fingerprint": f"fp-{m}", "calib_fp": "c", "heldout_fp": "h", "family": "llama"} for m in spec.models}


def test_plan_has_one_unit_per_grid_point_and_stable_ids():
    spec = parse_spec({**GOOD, "methods": [{"name": "svd", "sparsity": [0.5, 0.7], "rank": [64, 128]},
                                           {"name": "dejavu", "sparsity": [0.5], "attn_sparsity": [None, 0.3]}],
                       "suites": {"tasks": [{"name": "piqa", "limit": 10}]},
                       "latency": {"devices": ["cpu", "cuda"], "prompt_len": [64, 128]}})
    st = settings(spec)
    assert len(st) == 1 + 4 + 2 and st[0].method == "dense"
    units = plan_units(spec, _described(spec))
    kinds = [u.kind for u in units]
    n_lat = len(st) * 2 * 2 + 2 * 2          # + the HF generate baseline per device and prompt
    assert kinds.count("collect") == 1 and kinds.count("fit") == len(st)
    assert kinds.count("eval") == len(st) * 2 and kinds.count("latency") == n_lat
    assert len({u.id for u in units}) == len(units)
    ids = {u.id for u in units}
    assert all(set(u.deps) <= ids for u in units)
    assert [u.id for u in plan_units(spec, _described(spec))] == [u.id for u in units]   # deterministic
    other = {m: {**d, "fingerprint": "changed"} for m, d in _described(spec).items()}
    assert not ids & {u.id for u in plan_units(spec, other)}       # new weights: nothing reused


def test_shape_models_get_latency_units_only():
    from workers.units import Units

    spec = parse_spec({**GOOD, "models": ["shape:llama2-7b"], "latency": {"devices": ["cuda"]}})
    d = {m: Units().describe(m, spec.data.model_dump(), None) for m in spec.models}
    assert d["shape:llama2-7b"]["name"] == "llama2-7b-shape" and d["shape:llama2-7b"]["dims"]["D"] == 11008
    units = plan_units(spec, d)
    assert {u.kind for u in units} == {"fit", "latency"} and all(u.device_type == "cuda" for u in units
                                                                  if u.kind == "latency")
    lat = [u for u in units if u.kind == "latency" and u.config.runtime == "ctxsparse"]
    assert sorted(u.config.setting.sparsity for u in lat) == [0.0, 0.5]


def test_one_window_budgets_and_every_model_ref_form_are_valid(tmp_path):
    one = parse_spec(_with(data={"calib_tokens": 512, "metric_tokens": 512, "seq_len": 512},
                           suites={"perplexity": {"tokens": 512, "seq_len": 512}}))
    assert one.suites.perplexity.tokens == one.suites.perplexity.seq_len == 512
    refs = ["smollm2-135m", "gemma3-270m", "HuggingFaceTB/SmolLM2-135M", "models/x.gguf", str(tmp_path)]
    assert parse_spec(_with(models=refs)).models == refs


@pytest.mark.parametrize("method, options, ok", [
    ("svd", {"superset": 0.3, "superset_filter": "damage"}, True),
    ("dejavu", {"input_kind": "ffn_in", "label": "damage"}, True),
    ("teal", {"greedy": "model"}, True),
    ("threshold", {"no_such_option": 1}, False),
    ("svd", {"supreset": 0.3}, False),
    ("dejavu", {"epoch": 3}, False),
])
def test_option_names_are_checked_at_submit(method, options, ok):
    """A misspelt option fails when the spec is read, naming the known ones (values are the fit's to check)."""
    data = _with(methods=[{"name": method, "sparsity": [0.5], "options": options}])
    if ok:
        parse_spec(data, "test.yaml")
        return
    with pytest.raises(SpecError) as e:
        parse_spec(data, "test.yaml")
    assert f"methods.0: Value error, {method}: unknown option(s) [{next(iter(options))!r}]; known: [" in str(e.value)
