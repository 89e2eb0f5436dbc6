"""benchmarks.generation_grad_mode: both grad modes timed side by side (on the tiny random Qwen2 GGUF of
``conftest.tiny_gguf``: what is timed is the generation loop's bookkeeping, the same on any model), the same
tokens, and the loop's own mode put back."""
import json

from benchmarks.harness import device_line
from kernels.isa import cpu_info


def test_both_modes_are_timed_and_give_the_same_tokens(tiny_model, tmp_path, capsys):
    from benchmarks.generation_grad_mode import main
    from workers.evals import generation

    before = generation.GRAD_MODE
    out = tmp_path / "gm.json"
    assert main(["--model", tiny_model, "--prompts", "3", "--rows", "2", "--new", "3", "--repeats", "2",
                 "--threads", "1", "--json", str(out)]) == 0
    assert generation.GRAD_MODE is before
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["op"] for r in rows] == ["no_grad", "inference_mode"]
    assert all(r["extra"]["same_tokens"] and len(r["extra"]["samples_s"]) == 2 and r["median"] > 0 for r in rows)
    assert all(r["shape"] == "3 prompts x 3 new" and r["batch"] == 2 and r["dtype"] == "float32" for r in rows)
    assert rows[0]["extra"]["x_no_grad"] == 1.0 and rows[1]["extra"]["x_no_grad"] > 0
    assert {k: doc["meta"][k] for k in ("cpu_model", "cpu_flags", "isa")} == cpu_info()
    printed = capsys.readouterr().out
    assert "same tokens: True" in printed and device_line("cpu") in printed
