"""Smoke tests of ``ftis-fed bench step`` on the random-init tiny model (no timing assertions)."""

from __future__ import annotations

import argparse
import json

import pytest

from ftis_fed.bench import cli, step

TINY = dict(model="tiny-llama", prompts=2, group_size=2, max_new_tokens=4, temperature=0.7, dtype="auto",
            micro_batch=2, logit_chunk=2, mode="F-TIS", lr=1e-5, warmup=0, steps=1, threads=0, seed=0,
            grad_checkpointing=True, trl_gradient_checkpointing=False, share_prefix=True, logit_graph_mb=256.0)


def test_ours_worker_generates_exactly_max_new_tokens():
    res = step.ours_worker(dict(TINY))
    assert res["completion_tokens"] == [2 * 2 * 4]              # EOS masked until the budget
    assert len(res["step_s"]) == 1 and res["step_s"][0] >= res["generate_s"][0] > 0
    assert res["peak_rss_mb"] >= res["rss_after_load_mb"] > 0
    assert len(res["no_backward_rows"]) == 1 and 0 <= res["no_backward_rows"][0] <= 4
    assert 0 <= res["unscored_rows"][0] <= res["no_backward_rows"][0]
    assert res["step_cpu_s"][0] >= res["generate_cpu_s"][0] > 0 and res["train_cpu_s"][0] > 0


@pytest.mark.slow
def test_the_command_runs_our_side_in_a_fresh_process_with_the_options_given(capsys):
    """``ftis-fed bench step --sides ours ...``: the options reach the measured subprocess (its
    completion tokens per step are prompts x G x max-new-tokens, checked by the bench itself)."""
    ap = argparse.ArgumentParser()
    cli.add_cli(ap.add_subparsers(dest="bench"))
    a = ap.parse_args(["step", "--sides", "ours", "--model", "tiny-llama", "--prompts", "2", "--group-size", "2",
                       "--max-new-tokens", "3", "--micro-batch", "2", "--repeats", "1", "--warmup", "0",
                       "--threads", "1"])
    assert a.func(a) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == "tiny-llama" and "trl" not in out and out["threads"] == 1
    assert out["ours"]["completion_tokens_per_step"] == 2 * 2 * 3 and len(out["ours"]["step_s"]) == 1
    assert out["ours_peak_rss_mb"] > 0


@pytest.mark.slow
def test_side_by_side_json(capsys):
    pytest.importorskip("trl")
    a = argparse.Namespace(**{k.replace("-", "_"): v for k, v in TINY.items() if k not in ("warmup", "steps")},
                           repeats=1, warmup=1, steps=1, memory_sweep=False, sides="ours,trl", verbose=False)
    assert cli.run_step(a) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "step" and out["ours"]["completion_tokens_per_step"] == 16
    assert out["ours_over_trl_step"] > 0 and out["trl"]["peak_rss_mb"][0] > 0


def test_the_bench_command_lines_load_none_of_the_code_they_measure():
    """``ftis-fed``'s parser with every bench subcommand (``bench/cli.py``) imports no torch and no bench
    module: each is imported when its command runs."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\n"
            "from ftis_fed.commands.cli import main\n"
            "try:\n"
            "    main(['bench', 'step', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sorted(m for m in sys.modules if m in ('torch', 'transformers') or m.startswith('ftis_fed.bench.')))\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['ftis_fed.bench.cli']"


def test_bench_swarm_combines_saved_lines_into_the_slope(tmp_path, capsys):
    lines = [{"participants": n, "server_cpu_s_per_round": 0.1 * n, "plot_cpu_s_per_round": 0.0, "rss_mb_end": 100 + n,
              "bytes_relayed_per_round": 10 * n, "server_state_bytes": 5 * n} for n in (64, 256)]
    (tmp_path / "runs.json").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert cli.main(["swarm", "--slope", str(tmp_path / "runs.json")]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(out) == 1 and out[0]["slope_per_participant"]["rss_mb_end"] == pytest.approx(1.0)
    assert out[0]["slope_per_participant"]["bytes_relayed_per_round"] == pytest.approx(10.0)
