"""benchmarks.generation_grad_mode: both grad modes timed side by side on the real model, the same tokens, and the
loop's own mode put back."""
import json


def test_both_modes_are_timed_and_give_the_same_tokens(tmp_path, capsys):
    from benchmarks.generation_grad_mode import main
    from workers.evals import generation

    before = generation.GRAD_MODE
    out = tmp_path / "gm.json"
    assert main(["--prompts", "3", "--rows", "2", "--new", "3", "--repeats", "2", "--threads", "1",
                 "--json", str(out)]) == 0
    assert generation.GRAD_MODE is before
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["no_grad", "inference_mode"]
    assert all(r["extra"]["same_tokens"] and len(r["extra"]["samples_s"]) == 2 and r["median"] > 0 for r in rows)
    assert rows[0]["extra"]["x_no_grad"] == 1.0
    assert "same tokens: True" in capsys.readouterr().out
