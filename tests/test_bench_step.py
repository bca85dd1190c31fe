"""Smoke tests of ``ftis-fed bench step`` on the random-init tiny model (no timing assertions)."""

from __future__ import annotations

import argparse
import json

import pytest

from ftis_fed.bench import step

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
    step.add_cli(ap.add_subparsers(dest="bench"))
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
    assert step.run_cli(a) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "step" and out["ours"]["completion_tokens_per_step"] == 16
    assert out["ours_over_trl_step"] > 0 and out["trl"]["peak_rss_mb"][0] > 0
