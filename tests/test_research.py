"""The research tier: in-process cells, per-prompt records, paired statistics and the verdict table."""

from __future__ import annotations

import gzip
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from ftis_fed.commands import cells
from ftis_fed.grid import plan as gplan, records, report
from ftis_fed.grid import stats as gs
from ftis_fed.grid.plan import Cell, plan
from ftis_fed.grid.run import run_grid

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "research-grid"


# ----------------------------------------------------------------------------- statistics

def test_t_interval_against_hand_computed_values():
    # mean 3, sd sqrt(2.5) = 1.5811, t(0.975, 4) = 2.776 -> half-width 2.776 * 1.5811 / sqrt(5) = 1.9630
    m, lo, hi = gs.t_interval([1, 2, 3, 4, 5])
    assert m == 3 and lo == pytest.approx(3 - 1.96296, abs=1e-4) and hi == pytest.approx(3 + 1.96296, abs=1e-4)
    m, lo, hi = gs.t_interval([0.1, 0.3])                       # t(1) = 12.706, sd 0.1414, n 2: half 1.2706
    assert lo == pytest.approx(0.2 - 1.2706, abs=1e-4) and hi == pytest.approx(0.2 + 1.2706, abs=1e-4)
    assert math.isnan(gs.t_interval([0.5])[1]) and gs.t975(100) == pytest.approx(1.96, abs=1e-3)


def test_pigeonhole_bootstrap_known_cases():
    # no variation at all: the interval is the point
    r = gs.paired_interval(np.full((5, 40), 0.25), "const")
    assert r["diff"] == r["lo"] == r["hi"] == 0.25 and r["discord"] == 0.0625          # q = mean(d^2)
    flags = np.array([[1.0, 0.0, -1.0, 0.0]] * 2)                    # 0/1 values: q = the share that disagree
    assert gs.paired_interval(flags, "flags")["discord"] == float((flags != 0).mean()) == 0.5
    # prompt variance only (every seed the same row): the bootstrap sd is the prompt-sampling sd
    rng = np.random.default_rng(0)
    row = rng.choice([-1.0, 0.0, 1.0], size=2000, p=[0.1, 0.7, 0.2])
    reps = gs.pigeonhole_bootstrap(np.tile(row, (5, 1)), draws=3000, seed=1)
    assert reps.std() == pytest.approx(row.std() / math.sqrt(row.size), rel=0.1)
    # seed variance only (each seed constant over prompts): the bootstrap resamples the seed means
    d = np.repeat(np.array([0.0, 0.1, 0.2, 0.3, 0.4])[:, None], 50, axis=1)
    reps = gs.pigeonhole_bootstrap(d, draws=4000, seed=2)
    assert reps.mean() == pytest.approx(0.2, abs=0.01)
    assert reps.std() == pytest.approx(np.std([0, 0.1, 0.2, 0.3, 0.4]) / math.sqrt(5), rel=0.1)
    # deterministic: the same name gives the same interval, byte for byte
    a, b = gs.paired_interval(d + row[:50], "x"), gs.paired_interval(d + row[:50], "x")
    assert a == b


def test_paired_eval_size_and_verdict_rules():
    assert gs.paired_eval_size(0.03, 0.3, 5) == math.ceil(1.959964 ** 2 * 0.3 / (0.0009 * 5)) == 257
    assert gs.paired_eval_size(0.03, 0.3, 1) == 1281
    assert gs.at_least(-0.005, 0.02, -0.01) == gs.HELD
    assert gs.at_least(-0.05, -0.02, -0.01) == gs.NOT_HELD
    assert gs.at_least(-0.02, 0.02, -0.01) == gs.INCONCLUSIVE
    assert gs.greater_than(0.001, 0.1) == gs.HELD and gs.greater_than(-0.1, 0.0) == gs.NOT_HELD
    assert gs.less_than(-0.1, -0.01) == gs.HELD and gs.less_than(0.0, 0.1) == gs.NOT_HELD
    assert gs.all_of([gs.HELD, gs.INCONCLUSIVE]) == gs.INCONCLUSIVE
    assert gs.all_of([gs.HELD, gs.NOT_HELD]) == gs.NOT_HELD and gs.any_of([gs.NOT_HELD, gs.HELD]) == gs.HELD
    assert gs.any_of([gs.NOT_HELD, gs.INCONCLUSIVE]) == gs.INCONCLUSIVE
    assert gs.all_of([gs.HELD, gs.MISSING]) == gs.MISSING and gs.any_of([gs.NOT_HELD, gs.MISSING]) == gs.MISSING
    # a decisive part decides whatever the others lack: "some participant" held, "every participant" not held
    assert gs.any_of([gs.HELD, gs.MISSING]) == gs.HELD and gs.all_of([gs.NOT_HELD, gs.MISSING]) == gs.NOT_HELD
    assert gs.any_of([]) == gs.all_of([]) == gs.MISSING


# ----------------------------------------------------------------------------- paired per-prompt table

def _records_runner(correct):
    """A fake ``ftis-fed sim`` writing metrics rows and per-prompt records; correct(cell, participant)
    -> (N,) 0/1 array on the shared ID prompts (4 OOD prompts per family, all wrong)."""
    from ftis_fed.participant import write_eval_prompts

    def run(cell: Cell, cell_dir, log_path):
        log_path.write_text("fake\n")
        run_dir = cell_dir / "run"
        rows = []
        for p in ("a", "b"):
            ok = correct(cell, p)
            ids = [f"{'add30' if i % 2 == 0 else 'sub30'}/eval/0/{i // 2}" for i in range(len(ok))]
            per = {"id": list(zip(ids, map(bool, ok))), "add3": [(f"add3/eval/0/{i}", False) for i in range(4)]}
            write_eval_prompts(run_dir / "participants" / p / "eval_prompts.jsonl.gz", p, 2, per)
            rows.append({"round": 1, "participant": p, "phase": "train", "train/samples": 8.0, "reward/mean": 0.1})
            rows.append({"round": 2, "participant": p, "phase": "train", "train/samples": 8.0, "reward/mean": 0.2})
            rows.append({"round": 2, "participant": p, "phase": "eval", "eval/id/accuracy": float(np.mean(ok)),
                         "eval/ood/accuracy": 0.0, "eval/id/n": float(len(ok))})
        for rnd in (1, 2):
            rows.append({"round": rnd, "participant": "_federation", "phase": "train", "fed/replies": 2.0,
                         "fed/complete": 1.0})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0

    return run


def test_paired_table_is_the_per_prompt_difference_over_seeds(tmp_path):
    rng = np.random.default_rng(3)
    table = {(m, p, s): (rng.random(40) < q).astype(float)
             for m, q in (("alone", 0.3), ("F-TIS", 0.5), ("noIS", 0.2)) for p in "ab" for s in range(3)}
    cells = plan(["alone", "noIS", "F-TIS"], 3)
    assert run_grid(cells, tmp_path, _records_runner(lambda c, p: table[(c.mode, p, c.seed)]),
                    echo=lambda s: None) == []
    assert not list(tmp_path.glob("cells/*/run/participants"))                  # compacted: metrics only
    out = report.write_summary(gplan.discover_cells(tmp_path), tmp_path, "t")
    rows = {(r["a"], r["b"], r["participant"], r["set"]): r for r in out["prompt_paired"]}
    d = np.stack([table[("F-TIS", "a", s)] - table[("alone", "a", s)] for s in range(3)])
    r = rows[("F-TIS", "alone", "a", "id")]
    assert r["diff"] == pytest.approx(d.mean()) and r["seeds"] == 3 and r["prompts"] == 40
    assert r["lo"] < r["diff"] < r["hi"]
    assert (r["t_lo"], r["t_hi"]) == pytest.approx(gs.t_interval(d.mean(axis=1))[1:])
    fam = rows[("F-TIS", "alone", "a", "id:add30")]
    assert fam["diff"] == pytest.approx(d[:, 0::2].mean()) and fam["prompts"] == 20
    assert rows[("F-TIS", "alone", "b", "ood")]["diff"] == 0.0
    assert ("noIS", "alone", "a", "id") in rows and ("F-TIS", "noIS", "b", "id") in rows
    v = {x["claim"]: x for x in out["verdicts"]}
    assert v["2b"]["verdict"] == gs.MISSING and v["1"]["verdict"] in (gs.HELD, gs.INCONCLUSIVE, gs.NOT_HELD)
    md = (tmp_path / "summary.md").read_text()
    assert "## Verdicts" in md and "| id:add30 |" in md.replace(" id:add30 |", "| id:add30 |")
    fams = {(x["method"], x["participant"], x["set"]): x for x in out["families"]}
    assert fams[("noIS", "b", "id:sub30")]["mean"] == pytest.approx(
        np.mean([table[("noIS", "b", s)][1::2].mean() for s in range(3)]))


# ----------------------------------------------------------------------------- the committed fixture

def test_summary_only_reproduces_the_committed_fixture_byte_for_byte(tmp_path):
    """tests/fixtures/research-grid: the cells' committed metrics and the summary ``ftis-fed grid
    --summary-only`` wrote from them; rerun here, every output file is the same, byte for byte."""
    work = tmp_path / "g"
    shutil.copytree(FIXTURE, work)
    outputs = ("summary.md", "summary.csv", "cells.csv", "final_accuracy.png", "curves.png")
    for name in outputs:
        (work / name).unlink()
    from ftis_fed.commands.cli import main

    assert main(["grid", "--summary-only", "--out", str(work)]) == 0
    for name in outputs:
        assert (work / name).read_bytes() == (FIXTURE / name).read_bytes(), name


# ----------------------------------------------------------------------------- in-process cells

def test_a_research_tier_cell_runs_end_to_end_in_process(tmp_path):
    """``ftis-fed sim --transport inprocess`` on the research-tiny preset: the same engine and
    participants, signed frames verified, per-prompt records written; well under a minute of CPU."""
    from ftis_fed.commands.sim import simulate_inprocess

    c0 = time.process_time()
    assert simulate_inprocess(ROOT, [f'output-dir="{tmp_path}"', "num-rounds=2", 'loss-mode="F-TIS"'],
                              "research-tiny") == 0
    assert time.process_time() - c0 < 60
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    fed = [r for r in rows if r["participant"] == "_federation"]
    assert len(fed) == 2 and all(r["fed/rejected"] == 0 and r["fed/frames_verified"] == 2 for r in fed)
    train = [r for r in rows if r["phase"] == "train" and r["participant"] in ("full", "lora")]
    assert all(r["offpolicy/accepted"] == 1 and r["train/peer_samples"] > 0 for r in train)
    from ftis_fed.policies.models import resolve_model
    from ftis_fed.policies.weights_fp import weights_fingerprint
    started = weights_fingerprint(resolve_model("tiny-arith"))         # the bytes both participants loaded
    assert started.startswith("w-") and {r["model_weights"] for r in train} == {started}
    for p in ("full", "lora"):
        lines = gzip.decompress((tmp_path / "participants" / p / "eval_prompts.jsonl.gz").read_bytes()).decode()
        got = [json.loads(x) for x in lines.splitlines()]
        assert {r["round"] for r in got} == {0, 2} and {r["set"] for r in got} >= {"id", "add3"}
        ev = [r for r in rows if r["participant"] == p and r["phase"] == "eval" and r["round"] == 2][0]
        ids = [r for r in got if r["round"] == 2 and r["set"] == "id"][0]
        assert ev["eval/id/accuracy"] == pytest.approx(ids["solved"].count("1") / len(ids["solved"]))


def test_in_process_runs_are_deterministic_and_participants_keep_their_own_rng(tmp_path):
    """Two runs of the same cell give the same metrics (timings aside): each participant's torch
    RNG is its own, whatever order the engine's threads reach it in."""
    from ftis_fed.commands.sim import simulate_inprocess

    got = []
    for k in range(2):
        out = tmp_path / str(k)
        assert simulate_inprocess(ROOT, [f'output-dir="{out}"', "num-rounds=2", 'loss-mode="noIS"'],
                                  "research-tiny") == 0
        got.append(comparable_rows(records.read_rows(out / "metrics.jsonl")))
    assert got[0] == got[1]


#: metrics that measure the machine or the process, not the run's computation
VOLATILE = ("seconds", "worker/pid", "tok_per_s", "model_loads", "wire/frame_bytes", "wire/bytes_per_token",
            "fed/bytes", "fed/round_seconds", "load", "fed/server_cpu_s", "fed/server_rss_mb")


def comparable_rows(rows):
    """Rows keyed by (round, participant, phase) without the volatile metrics (timings, pids)."""
    return {(r["round"], r["participant"], r.get("phase")): {k: v for k, v in r.items()
                                                             if not any(x in k for x in VOLATILE)}
            for r in rows}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["alone", "noIS", "VIS", "TIS", "F-noIS", "F-VIS", "F-TIS", "F-TIS+guard",
                                  "F-TIS+shadow"])
def test_flwr_run_gives_the_in_process_metrics(tmp_path, mode, monkeypatch):
    """One small cell per method through ``flwr run`` (Flower simulation, a worker process per
    participant) and through the in-process transport: the same metrics, value for value, apart from
    timings, process ids and signature-dependent frame sizes. Both with this process's float kernels:
    ``ftis-fed sim`` would otherwise pin itself to AVX2 (``store.run_pin_env``) while the in-process
    cell runs on the kernels pytest started with, and on an AVX-512 CPU those differ in the last bits."""
    import socket

    import torch

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", torch.backends.cpu.get_cpu_capability().lower())

    cell = plan([mode], 1)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = ["eval-seed=0", "num-rounds=2"]
    runs = {"flwr": cells.sim_runner(ROOT, "research-tiny", extra, ["--address", f"127.0.0.1:{port}"]),
            "inprocess": cells.inprocess_runner(ROOT, "research-tiny", extra)}
    got = {}
    for name, runner in runs.items():
        d = tmp_path / name
        d.mkdir()
        assert runner(cell, d, d / "run.log") == 0, (d / "run.log").read_text()[-3000:]
        got[name] = comparable_rows(records.read_rows(d / "run" / "metrics.jsonl"))
    assert got["flwr"].keys() == got["inprocess"].keys()
    for key in got["flwr"]:
        a, b = got["flwr"][key], got["inprocess"][key]
        assert a.keys() == b.keys(), key
        for k in a:
            assert a[k] == b[k], (key, k, a[k], b[k])


# ----------------------------------------------------------------------------- source-adapt = guard

def test_alignment_weight_rule():
    from ftis_fed.learn.guard import alignment_weight

    assert alignment_weight(0.2, 0.4) == 0.5 and alignment_weight(0.8, 0.4) == 1.0
    assert alignment_weight(-0.1, 0.4) == 0.0
    assert alignment_weight(0.1, 0.0) == 1.0 and alignment_weight(-0.1, -0.2) == 0.0   # own has no direction
    assert alignment_weight(float("nan"), 0.4) == 0.0


def test_validation_batch_is_own_families_and_ood_from_the_train_split():
    from ftis_fed.learn.guard import validation_prompts
    from ftis_fed.tasks.families import OOD_FAMILIES
    from ftis_fed.tasks.suite import TaskSpec

    task = TaskSpec(scheme="expertise", families=("add30", "sub30"))
    val = validation_prompts(task, 1, 2, 8)
    fams = [p.task_id.split("/")[0] for p in val]
    assert fams[:4] == ["sub30"] * 4 and fams[4:] == list(OOD_FAMILIES[:4])      # expert of sub30: its own family
    assert all(p.task_id.split("/")[1] == "train" for p in val)
    assert validation_prompts(task, 1, 2, 8) == val                               # deterministic
    # `task`: every family of the task, the one the receiver is not trained on included
    wide = [p.task_id.split("/")[0] for p in validation_prompts(task, 1, 2, 8, "task")]
    assert wide == ["add30", "sub30", "add30", "sub30"] + list(OOD_FAMILIES[:4])
    # `source-adapt-val-ood`: the OOD share, rounded down; 0.5 is the batch above, 0 has no OOD prompt, and
    # the in-distribution prompts extend one sequence (a smaller OOD share only adds to its end)
    assert validation_prompts(task, 1, 2, 8, "trained", 0.5) == val
    id_only = validation_prompts(task, 1, 2, 8, "trained", 0.0)
    assert [p.task_id.split("/")[0] for p in id_only] == ["sub30"] * 8 and id_only[:4] == val[:4]
    assert len(set(p.text for p in id_only)) == 8                                 # eight distinct problems
    share29 = [p.task_id.split("/")[0] for p in validation_prompts(task, 1, 2, 7, "trained", 0.29)]
    assert share29 == ["sub30"] * 5 + list(OOD_FAMILIES[:2])                      # floor(7 * 0.29) = 2 OOD
    assert len(validation_prompts(task, 1, 2, 100, "trained", 0.29)) == 100
    assert sum(p.task_id.split("/")[0] in OOD_FAMILIES
               for p in validation_prompts(task, 1, 2, 100, "trained", 0.29)) == 29   # not 28 (0.29 * 100 < 29)


def _guard_trainer():
    """The guard tests' receiver: a seeded tiny Llama, fully fine-tuned at 1e-2."""
    import torch

    from ftis_fed.learn.objective import ObjectiveConfig
    from ftis_fed.learn.training import Trainer
    from ftis_fed.policies import build_policy
    from ftis_fed.policies.config import PolicyConfig

    torch.manual_seed(0)
    return Trainer(build_policy(PolicyConfig(model="tiny-llama", adapter="full", lr=1e-2)), ObjectiveConfig())


def _guard_samples():
    """Two own samples and two of one peer, one of each with a positive and one with a negative advantage."""
    from ftis_fed.learn.training import TrainSample

    def sample(src, local, adv, ids):
        return TrainSample([1, 2, 3], ids, np.full(len(ids), -2.0, np.float32), -2.0 * len(ids), adv, src, local)

    return [sample("me", True, 1.0, [5, 6]), sample("me", True, -1.0, [7, 8]),
            sample("peer", False, 1.0, [9, 10]), sample("peer", False, -1.0, [11, 12])]


@pytest.mark.parametrize("align", [True, False])
@pytest.mark.parametrize("with_better", [True, False])
def test_the_guard_keeps_the_update_with_peers_only_if_no_worse(tmp_path, with_better, align):
    """Two candidate updates from the same start; the validation reward decides which one stays:
    the kept weights equal those of a plain Trainer step on the chosen sample set. With
    ``source-adapt-align = false`` there is no validation gradient and no probe backward, and every
    peer's samples keep their advantages (weight 1)."""
    import dataclasses as dc

    import torch

    from ftis_fed.learn.guard import GuardedUpdate
    from ftis_fed.tasks.prompt import Prompt
    from ftis_fed.wire.batch import SamplingParams

    def no_probe(*_):
        raise AssertionError("align = false must not probe gradients")

    samples = _guard_samples()
    sampling = SamplingParams(max_new_tokens=4)
    rewards = iter([0.5, 0.25] if with_better else [0.25, 0.5])                # with peers, then without
    t = _guard_trainer()
    g = GuardedUpdate(t, [Prompt("add1/train/0/0", "What is 1 + 2?", "3")], lambda: next(rewards), align=align)
    if not align:
        g._probe = g._val_gradient = no_probe
        assert g.val_rows == []                          # nothing reads the validation replies: none tokenized
    m = g.step(samples, sampling)
    assert m["guard/kept_peers"] == float(with_better) and "guard/peer/weight" in m
    w = m["guard/peer/weight"]
    if not align:
        assert w == 1.0 and "guard/own_cos" not in m and "guard/peer/cos" not in m
    ref = _guard_trainer()
    chosen = samples[:2] + [dc.replace(s, advantage=s.advantage * w) for s in samples[2:]] if with_better else samples[:2]
    ref.step(chosen, sampling)
    got, want = t.policy.trainable_state(), ref.policy.trainable_state()
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    assert t.steps == 1


def test_the_guard_s_window_decides_by_the_mean_difference_of_its_last_rounds():
    """``source-adapt-window = W``: the peers are kept while the mean of the last W differences
    (score with − score without, this round's included) is >= 0; a non-finite difference drops the
    peers and is not kept; the differences are the state a resume carries."""
    import torch

    from ftis_fed.learn.guard import GuardedUpdate
    from ftis_fed.tasks.prompt import Prompt
    from ftis_fed.wire.batch import SamplingParams

    val = [Prompt("add1/train/0/0", "What is 1 + 2?", "3")]
    g = GuardedUpdate(_guard_trainer(), val, lambda: 0.0, window=3)
    got = [g.keeps_peers(w, wo) for w, wo in [(0.3, 0.1), (0.1, 0.2), (0.0, 0.2), (0.5, 0.4), (math.nan, 0.1)]]
    assert got == [True, True, False, False, False]       # means +0.2, +0.05, -0.03, -0.07 (last 3); NaN: dropped
    assert list(g.diffs["all"]) == pytest.approx([-0.1, -0.2, 0.1])
    assert g.to_json() == {"diffs": {"all": list(g.diffs["all"])}}
    one = GuardedUpdate(_guard_trainer(), val, lambda: 0.0)                       # window 1: this round alone
    assert [one.keeps_peers(w, wo) for w, wo in [(0.2, 0.2), (0.1, 0.2), (0.3, 0.2)]] == [True, False, True]

    # through a real step: this round's candidates say "without" (0.25 < 0.5), the window's history
    # says "with" (+0.5 restored from a saved state), so the update with the peers is kept
    rewards = iter([0.25, 0.5])
    t = _guard_trainer()
    g = GuardedUpdate(t, val, lambda: next(rewards), align=False, window=2)
    g.load_json({"diffs": [0.4, 0.5]})                    # a checkpoint from before groups: one list
    assert list(g.diffs["all"]) == [0.4, 0.5]
    samples, sampling = _guard_samples(), SamplingParams(max_new_tokens=4)
    m = g.step(samples, sampling)
    assert m["guard/kept_peers"] == 1.0 and m["guard/diff_mean"] == pytest.approx((0.5 - 0.25) / 2)
    ref = _guard_trainer()
    ref.step(samples, sampling)
    got, want = t.policy.trainable_state(), ref.policy.trainable_state()
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    assert "guard/diff_mean" not in GuardedUpdate(_guard_trainer(), val, iter([0.5, 0.25]).__next__).step(samples, sampling)


def test_the_family_guard_drops_the_peers_when_any_family_s_mean_falls():
    """``source-adapt-val-group = family``: one window per in-distribution family of the validation
    batch and one for its OOD families together; the peers are kept only while every group's mean
    difference is >= 0, so a fall on one family that a rise on another outweighs still drops them.
    Through a real step (``loglik``), each group's difference is its own tokens' mean log-likelihood
    with − without, and ``guard/val_with`` stays the whole batch's score, as with one group."""
    from ftis_fed.learn.guard import GuardedUpdate, val_group
    from ftis_fed.learn.source_weights import SourceAdaptConfig
    from ftis_fed.tasks.suite import task_at
    from ftis_fed.wire.batch import SamplingParams

    val = [task_at("add99", "train", 3, 0), task_at("sub99", "train", 3, 0), task_at("word_add", "train", 3, 0),
           task_at("add99", "train", 3, 1)]
    assert [val_group(p) for p in val] == ["add99", "sub99", "ood", "add99"]
    g = GuardedUpdate(_guard_trainer(), val, lambda: 0.0, "loglik", window=2, group="family")
    rounds = [({"add99": -1.0, "sub99": -2.0}, {"add99": -1.5, "sub99": -1.9}),    # add +0.5, sub -0.1
              ({"add99": -1.0, "sub99": -2.0}, {"add99": -1.0, "sub99": -2.2}),    # add 0, sub +0.2
              ({"add99": -1.0, "sub99": -2.0}, {"add99": -0.9, "sub99": -2.0})]    # add -0.1, sub 0
    assert [g.keeps_peers(w, wo) for w, wo in rounds] == [False, True, False]      # sub -0.1; +0.05 / +0.25; add -0.05
    assert g.diff_mean() == pytest.approx(-0.05) and g.diff_mean("sub99") == pytest.approx(0.1)
    whole = GuardedUpdate(_guard_trainer(), val, lambda: 0.0, "loglik")
    assert whole.keeps_peers(-1.0 + 0.5 - 0.1, -1.0)                   # one group, as before: +0.4
    with pytest.raises(ValueError, match="needs source-adapt-val-score=loglik"):
        GuardedUpdate(_guard_trainer(), val, lambda: 0.0, "reward", group="family")
    with pytest.raises(ValueError, match="source-adapt-val-group=family: needs source-adapt-val-score=loglik"):
        SourceAdaptConfig("guard", val_group="family")
    with pytest.raises(ValueError, match="source-adapt-val-group='add99': must be one of all, family"):
        SourceAdaptConfig("guard", val_score="loglik", val_group="add99")

    samples, sampling = _guard_samples(), SamplingParams(max_new_tokens=4)
    fam = GuardedUpdate(_guard_trainer(), val, lambda: 0.0, "loglik", align=False, window=3, group="family")
    one = GuardedUpdate(_guard_trainer(), val, lambda: 0.0, "loglik", align=False, window=3)
    m, m1 = fam.step(samples, sampling), one.step(samples, sampling)
    assert {k for k in m if k.startswith("guard/val/")} == {f"guard/val/{g}/{x}" for g in ("add99", "sub99", "ood")
                                                           for x in ("diff", "diff_mean")}
    assert m["guard/val_with"] == pytest.approx(m1["guard/val_with"], abs=1e-5)
    assert m["guard/val_without"] == pytest.approx(m1["guard/val_without"], abs=1e-5)
    assert m["guard/val/sub99/diff"] == pytest.approx(fam.diffs["sub99"][0]) and len(fam.diffs["ood"]) == 1
    assert m["guard/diff_mean"] == min(m[f"guard/val/{g}/diff_mean"] for g in ("add99", "sub99", "ood"))
    assert m["guard/kept_peers"] == float(m["guard/diff_mean"] >= 0)
    assert not any(k.startswith("guard/val/") for k in m1)
    fam2 = GuardedUpdate(_guard_trainer(), val, lambda: 0.0, "loglik", window=3, group="family")
    fam2.load_json(fam.to_json())                                                  # the state a resume carries
    assert {k: list(v) for k, v in fam2.diffs.items()} == {k: list(v) for k, v in fam.diffs.items()}


def test_the_loglik_guard_keeps_the_candidate_whose_worked_replies_are_likelier():
    """``source-adapt-val-score = loglik``: each candidate update is scored by the mean per-token
    log-likelihood of the validation prompts' worked solutions (the bare answer where a family has
    none); the greedy pass@1 is never computed; the kept weights are those of a plain Trainer step on
    the sample set whose score is no worse, and the reported scores are those candidates' scores."""
    import dataclasses as dc

    import torch

    from ftis_fed.learn.guard import GuardedUpdate, validation_reply
    from ftis_fed.tasks.suite import task_at, worked_reply
    from ftis_fed.wire.batch import SamplingParams

    add, word = task_at("add99", "train", 3, 0), task_at("word_add", "train", 3, 0)
    assert validation_reply(add, "loglik") == worked_reply("add99", "train", 3, 0) != add.reference
    assert ";" in validation_reply(add, "loglik") and validation_reply(add) == add.reference
    assert validation_reply(word, "loglik") == word.reference                  # no worked solution

    def never():
        raise AssertionError("loglik must not decode greedily")

    samples = _guard_samples()
    sampling = SamplingParams(max_new_tokens=4)
    val = [add, word]
    t = _guard_trainer()
    m = GuardedUpdate(t, val, never, "loglik").step(samples, sampling)
    w = m["guard/peer/weight"]
    with_peers, without = _guard_trainer(), _guard_trainer()
    with_peers.step(samples[:2] + [dc.replace(s, advantage=s.advantage * w) for s in samples[2:]], sampling)
    without.step(samples[:2], sampling)
    ll_with = GuardedUpdate(with_peers, val, never, "loglik").validation_score(sampling)
    ll_without = GuardedUpdate(without, val, never, "loglik").validation_score(sampling)
    assert ll_with < 0 and ll_without < 0 and ll_with != ll_without            # continuous: no tie here
    assert m["guard/val_with"] == pytest.approx(ll_with, abs=1e-5)
    assert m["guard/val_without"] == pytest.approx(ll_without, abs=1e-5)
    assert m["guard/kept_peers"] == float(ll_with >= ll_without)
    ref = with_peers if ll_with >= ll_without else without
    got, want = t.policy.trainable_state(), ref.policy.trainable_state()
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)


# ----------------------------------------------------------------------------- the calibrated learning tier

@pytest.mark.slow
def test_the_calibrated_research_cell_learns_alone(tmp_path):
    """The learning tier of issue #27 (preset research-w, docs/results/calibration/README.md section 5):
    one participant (micro-llama-w250, full fine-tuning at 1e-4, warm-up 10, two updates a round, 32
    prompts) training alone for 16 updates raises its held-out greedy ID accuracy on 128 prompts and its
    training reward. Measured with the model's AVX2-pinned build (the committed cells' model, on any CPU
    with AVX2: ``store.TRAINED_BUILDS``): 0.617 -> 0.750, reward 0.311 -> 0.367 (first / second eight
    rounds), ~35 s of CPU with the model cached (the worked warm-up builds it once otherwise, ~80 s).
    Deterministic: the same seeds give the same numbers, so a fall means the update or the warm-up
    changed. The bars leave room for the unpinned AVX-512 build that CI's machine made before the pin
    (0.672 -> 0.742, reward 0.263 -> 0.293: CI failed the first bars, +8 points over the first / last
    four rounds)."""
    from ftis_fed.commands.sim import simulate_inprocess

    assert simulate_inprocess(ROOT, [f'output-dir="{tmp_path}"', "num-rounds=16", "eval-every=16", "eval-samples=0",
                                     "eval-size=128", 'loss-mode="alone"', 'p1-model=""', "min-participants=1"],
                              "research-w") == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ev = {r["round"]: r["eval/id/accuracy"] for r in rows if r["participant"] == "full" and r["phase"] == "eval"}
    rewards = [r["reward/mean"] for r in rows if r["participant"] == "full" and r["phase"] == "train"]
    assert sorted(ev) == [0, 16] and len(rewards) == 16
    assert ev[16] - ev[0] >= 0.05, ev                                   # +13.3 points measured
    assert np.mean(rewards[8:]) >= np.mean(rewards[:8]) + 0.015, rewards  # +0.056 measured


def test_step_check_reads_a_worked_replys_steps():
    """sims/step_check.py: a rewarded reply can reach the right answer through wrong steps."""
    from sims.step_check import steps_true

    assert steps_true("7+8=15; 4+3+1=8; so 85") and steps_true("12-8=4; 5-2-1=2; so 24")
    assert not steps_true("12-9=4; 6-4-1=0; so 4")             # the answer is right, the steps are not
    assert not steps_true("so 85") and not steps_true("7+8=15; so 85")     # fewer than two steps
