"""``source-adapt = shadow`` (``learn/shadow.py``): the model beside a shadow copy that trains alone,
reset to it when its sampled validation accuracy is confidently below the shadow's."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.learn.shadow import ShadowGuard, paired_difference, resets

ROOT = Path(__file__).resolve().parents[1]


def test_the_paired_difference_and_the_reset_rule():
    d, se = paired_difference([4, 2, 0, 3], [2, 2, 1, 1], 4)            # d_i = .5, 0, -.25, .5
    assert d == pytest.approx(0.1875) and se == pytest.approx(0.375 / 2, abs=1e-3)  # sd 0.375 over 4 prompts
    assert paired_difference([1], [0], 2) == (0.5, 0.0)
    with pytest.raises(ValueError, match="3 and 2 prompts"):
        paired_difference([1, 2, 3], [1, 2], 4)
    assert resets(-0.1, 0.04, 2.0) and not resets(-0.1, 0.06, 2.0)       # upper end -0.02 / +0.02
    assert resets(-0.01, 0.0, 0.0) and not resets(0.0, 0.0, 0.0)          # ties keep the peers
    assert resets(math.nan, 0.1, 2.0)


def test_the_shadow_knobs_and_their_errors():
    cfg = federation_from_run_config({"source-adapt": "shadow", "source-adapt-period": 10, "source-adapt-z": 1.5,
                                      "source-adapt-val-samples": 8}).checks["source-adapt"]
    assert (cfg.mode, cfg.period, cfg.z, cfg.val_samples) == ("shadow", 10, 1.5, 8)
    base = federation_from_run_config({}).checks["source-adapt"]
    assert (base.period, base.z, base.z_last, base.val_samples, base.shadow_loss) == (25, 2.0, 0.0, 4, "alone")
    assert federation_from_run_config({"source-adapt-z-last": 1.0}).checks["source-adapt"].z_last == 1.0
    assert federation_from_run_config({"source-adapt-shadow-loss": "run"}).checks["source-adapt"].shadow_loss == "run"
    for key, bad, why in (("source-adapt-period", 0, "an integer >= 1"), ("source-adapt-period", 2.5, "an integer"),
                          ("source-adapt-val-samples", 65, r"an integer in \[1, 64\]"),
                          ("source-adapt-z", -1.0, "a finite number >= 0"),
                          ("source-adapt-z", math.inf, "a finite number"),
                          ("source-adapt-z-last", -0.5, "a finite number >= 0"),
                          ("source-adapt-z-last", math.nan, "a finite number"),
                          ("source-adapt-shadow-loss", "F-TIS", "one of alone, run")):
        with pytest.raises(ValueError, match=f"{key}={bad!r}: must be {why}"):
            federation_from_run_config({key: bad})


def test_the_last_round_s_check_chooses_by_the_mean_alone():
    """Before the last round a deficit within z standard errors keeps the model; at the last round
    any deficit resets it (the final model is the one that validates better); ties keep it."""
    g = ShadowGuard(None, None, None, k=4, period=2, z=2.0, last_round=4)
    main, alone = [2, 2, 1], [2, 2, 2]                           # d = -1/12, se = 1/12
    assert g.decide(2, main, alone)[2] is False and g.decide(4, main, alone)[2] is True
    assert g.decide(4, alone, alone)[2] is False
    assert g.decide(2, [0, 0, 0], [2, 2, 2])[2] is True
    # source-adapt-z-last: at the last round the model must lead by z_last standard errors, a tie ends on the shadow
    tie = ShadowGuard(None, None, None, k=4, period=2, z=2.0, last_round=4, z_last=1.0)
    assert tie.decide(4, alone, alone)[2] is True and tie.decide(2, alone, alone)[2] is False
    lead, small = [4, 4, 4, 2], [3, 3, 2, 1]                     # d = (2, 2, 2, 0)/4 and (1, 1, 0, -1)/4 over alone
    assert tie.decide(4, lead, [2, 2, 2, 2])[2] is False and tie.decide(4, small, [2, 2, 2, 2])[2] is True
    assert g.decide(4, small, [2, 2, 2, 2])[2] is False          # z_last = 0: the mean alone (+1/16) keeps it

    def checks(rounds):                                          # the rounds ``step`` would check at
        p = ShadowGuard(None, None, None, k=4, period=2, z=2.0, last_round=100)
        return [setattr(p, "checked", r) or r for r in rounds if p.due(r)]

    assert checks(range(1, 7)) == [2, 4, 6]                      # trained every round: every period-th
    assert checks([1, 3, 5, 6, 9, 100]) == [3, 5, 9, 100]       # a population's receiver, some rounds only


def _trainer(mode="F-TIS"):
    import torch

    from ftis_fed.learn.objective import ObjectiveConfig
    from ftis_fed.learn.training import Trainer
    from ftis_fed.policies import build_policy
    from ftis_fed.policies.config import PolicyConfig

    torch.manual_seed(0)
    return Trainer(build_policy(PolicyConfig(model="tiny-llama", adapter="full", lr=1e-2)), ObjectiveConfig(mode=mode))


def _samples(round):
    """The main's samples of a round (two own, two of one peer) and the shadow's own draws."""
    import numpy as np

    from ftis_fed.learn.training import TrainSample

    def sample(src, local, adv, ids):
        return TrainSample([1, 2, 3], ids, np.full(len(ids), -2.0, np.float32), -2.0 * len(ids), adv, src, local)

    main = [sample("me", True, 1.0, [5, 6 + round]), sample("me", True, -1.0, [7, 8]),
            sample("peer", False, 1.0, [9, 10]), sample("peer", False, -1.0, [11, 12])]
    return main, [sample("me", True, 1.0, [13, 14 + round]), sample("me", True, -1.0, [15, 16])]


def _same(a, b):
    import torch

    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_the_shadow_trains_alone_and_the_model_is_reset_to_it_only_when_confidently_worse(tmp_path):
    """Three rounds, checks at rounds 2 (period) and 3 (the last). The model's weights follow a plain
    trainer on own + peers' samples, the shadow's a plain ``loss-mode = alone`` trainer on its own draws
    only (drawn with the shadow's weights loaded); at round 2 the validation says the model is worse by far: it becomes
    the shadow, weights and optimizer alike; at round 3 a tie keeps it. The shadow is a checkpoint's
    part: saved and loaded back it is the same."""
    from ftis_fed.wire.batch import SamplingParams

    sampling = SamplingParams(max_new_tokens=4)
    t, main_ref, alone_ref = _trainer(), _trainer(), _trainer("alone")
    loaded_at_draw, loaded_at_score = [], []

    def own_samples(round):
        loaded_at_draw.append(t.policy.trainable_state())
        return _samples(round)[1]

    scores = iter([[4, 4, 3], [0, 1, 0],            # round 2: the shadow, then the model (d = -10/12, se 1/12)
                   [2, 2, 2], [2, 2, 2]])           # round 3: a tie
    def val_counts(round):
        loaded_at_score.append(t.policy.trainable_state())
        return next(scores)

    g = ShadowGuard(t, own_samples, val_counts, k=4, period=2, z=2.0, last_round=3)
    m1 = g.step(_samples(1)[0], sampling, 1)
    main_ref.step(_samples(1)[0], sampling)
    alone_ref.step(_samples(1)[1], sampling)
    assert m1["guard/peer/weight"] == 1.0 and "guard/kept_peers" not in m1      # no check at round 1
    assert _same(t.policy.trainable_state(), main_ref.policy.trainable_state())
    assert _same(g.shadow[0], alone_ref.policy.trainable_state())
    assert _same(loaded_at_draw[0], _trainer().policy.trainable_state())      # the shadow drew from the start

    m2 = g.step(_samples(2)[0], sampling, 2)
    assert g.unchosen is None                                    # set by the last round's check only
    main_ref.step(_samples(2)[0], sampling)
    assert _same(loaded_at_draw[1], alone_ref.policy.trainable_state())     # the shadow's weights drew
    alone_ref.step(_samples(2)[1], sampling)
    assert _same(loaded_at_score[0], alone_ref.policy.trainable_state())
    assert _same(loaded_at_score[1], main_ref.policy.trainable_state())
    assert m2["guard/kept_peers"] == 0.0 and m2["guard/resets"] == 1.0
    assert m2["guard/val_without"] == pytest.approx(11 / 12) and m2["guard/val_with"] == pytest.approx(1 / 12)
    assert m2["guard/diff_mean"] == pytest.approx(-10 / 12)
    assert _same(t.policy.trainable_state(), alone_ref.policy.trainable_state())   # reset to the shadow
    assert t.steps == alone_ref.steps == 2
    moments = [tr.optimizer.state_dict()["state"][0]["exp_avg"] for tr in (t, alone_ref)]
    assert moments[0].equal(moments[1])                          # the optimizer state too

    main_ref = _trainer()
    main_ref.policy.load_trainable_state(alone_ref.policy.trainable_state())
    main_ref.optimizer.load_state_dict(copy.deepcopy(alone_ref.optimizer.state_dict()))   # not aliased
    main_ref.steps = alone_ref.steps
    m3 = g.step(_samples(3)[0], sampling, 3)                     # from the shadow's point, with peers again
    main_ref.step(_samples(3)[0], sampling)
    alone_ref.step(_samples(3)[1], sampling)
    assert m3["guard/kept_peers"] == 1.0 and m3["guard/resets"] == 1.0 and m3["guard/diff_mean"] == 0.0
    assert _same(t.policy.trainable_state(), main_ref.policy.trainable_state())
    assert _same(g.shadow[0], alone_ref.policy.trainable_state())
    assert _same(g.unchosen[0], alone_ref.policy.trainable_state())   # the last check's other end: the shadow

    g.save(tmp_path / "shadow.pt")
    back = ShadowGuard(_trainer(), own_samples, val_counts, k=4, period=2, z=2.0, last_round=3)
    back.load(tmp_path / "shadow.pt")
    assert _same(back.shadow[0], g.shadow[0]) and back.shadow[2] == 3 and back.resets == 1 and back.checked == 3
    assert back.unchosen is back.shadow                           # resumed after the last check: still both ends
    back.load(tmp_path / "none.pt")                               # no file: nothing changes
    assert back.resets == 1


def test_the_shadow_s_loss_is_alone_s_or_with_shadow_loss_run_the_run_s():
    """``source-adapt-shadow-loss``: the shadow's update on its own draws is ``loss-mode = alone``'s
    (default; the run the receiver would make alone) or, with ``run``, the run's loss (here F-TIS, whose
    truncated weight on own samples is pi_theta / pi_gen: not 1 where the sampler's log-probs are not
    the trainer's, so the two shadows differ); the model's own update is F-TIS's either way."""
    from ftis_fed.wire.batch import SamplingParams

    sampling = SamplingParams(max_new_tokens=4)
    shadows = {}
    for loss in ("alone", "run"):
        t = _trainer()
        g = ShadowGuard(t, lambda r: _samples(r)[1], lambda r: [0], k=4, period=5, z=2.0, last_round=9,
                        shadow_loss=loss)
        g.step(_samples(1)[0], sampling, 1)
        main_ref, ref = _trainer(), _trainer("alone" if loss == "alone" else "F-TIS")
        main_ref.step(_samples(1)[0], sampling)
        ref.step(_samples(1)[1], sampling)
        assert _same(t.policy.trainable_state(), main_ref.policy.trainable_state())
        assert _same(g.shadow[0], ref.policy.trainable_state()), loss
        assert t.objective.mode == "F-TIS"                       # the trainer's objective is not changed
        shadows[loss] = g.shadow[0]
    assert not _same(shadows["alone"], shadows["run"])


def test_a_reset_at_the_last_round_leaves_the_model_with_its_peers_as_the_unchosen_end(tmp_path):
    """At the last round a reset makes the model its shadow; the model as it was with its peers is what
    the check did not choose (``unchosen``: the final evaluation scores it beside the model)."""
    from ftis_fed.wire.batch import SamplingParams

    sampling = SamplingParams(max_new_tokens=4)
    t, main_ref, alone_ref = _trainer(), _trainer(), _trainer("alone")
    scores = iter([[4, 4, 3], [3, 3, 3]])                        # the shadow, then the model: d = -1/12 < 0
    g = ShadowGuard(t, lambda r: _samples(r)[1], lambda r: next(scores), k=4, period=5, z=2.0, last_round=1)
    m = g.step(_samples(1)[0], sampling, 1)
    main_ref.step(_samples(1)[0], sampling)
    alone_ref.step(_samples(1)[1], sampling)
    assert m["guard/kept_peers"] == 0.0
    assert _same(t.policy.trainable_state(), alone_ref.policy.trainable_state())
    assert _same(g.unchosen[0], main_ref.policy.trainable_state()) and g.unchosen[2] == 1
    g.save(tmp_path / "shadow.pt")                               # a restart before the final evaluation
    back = ShadowGuard(_trainer(), lambda r: [], lambda r: [], k=4, period=5, z=2.0, last_round=1)
    back.load(tmp_path / "shadow.pt")
    assert _same(back.unchosen[0], main_ref.policy.trainable_state()) and back.unchosen[2] == 1
    assert _same(back.shadow[0], alone_ref.policy.trainable_state())


def test_a_shadow_cell_runs_in_process_and_checks_at_its_period_and_last_round(tmp_path, monkeypatch):
    """``source-adapt = shadow`` through the in-process engine (research-tiny, 3 rounds, period 2):
    every participant's train rows carry the check's figures at rounds 2 and 3 and not at round 1,
    a checkpoint holds the shadow beside the model, and the shadow changes nothing of the model's own
    updates: until a check could reset it, they are those of plain F-TIS, value for value. With
    ``source-adapt-val-ood = 0`` each participant validates on its training families' prompts only."""
    import ftis_fed.participant as participant
    from ftis_fed.commands.sim import simulate_inprocess
    from ftis_fed.tasks.families import OOD_FAMILIES
    from tests.test_research import VOLATILE

    batches = []
    made = participant.validation_prompts
    monkeypatch.setattr(participant, "validation_prompts", lambda *a: batches.append(made(*a)) or batches[-1])
    assert simulate_inprocess(ROOT, [f'output-dir="{tmp_path}"', "num-rounds=3", 'loss-mode="F-TIS"',
                                     'source-adapt="shadow"', "source-adapt-period=2", "source-adapt-val-size=4",
                                     "source-adapt-val-ood=0", "source-adapt-val-samples=2", "checkpoint-every=3",
                                     "eval-every=0"],
                              "research-tiny") == 0
    assert len(batches) == 2 and all(len(b) == 4 for b in batches)           # one batch per participant
    assert not any(p.task_id.split("/")[0] in OOD_FAMILIES for b in batches for p in b)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train" and r["participant"] in ("full", "lora")]
    assert len(train) == 6
    for r in train:
        assert r["offpolicy/accepted"] == 1 and r["guard/seconds"] > 0
        checked = "guard/kept_peers" in r
        assert checked == (r["round"] in (2, 3)), r["round"]
        if checked:
            assert 0 <= r["guard/val_with"] <= 1 and 0 <= r["guard/val_without"] <= 1
    for p in ("full", "lora"):
        assert (tmp_path / "participants" / p / "shadow.pt").exists()
    plain = tmp_path / "plain"
    assert simulate_inprocess(ROOT, [f'output-dir="{plain}"', "num-rounds=2", 'loss-mode="F-TIS"', "eval-every=0"],
                              "research-tiny") == 0
    same = [json.loads(x) for x in (plain / "metrics.jsonl").read_text().splitlines()]
    same = {(r["round"], r["participant"]): r for r in same if r["phase"] == "train" and r["participant"] != "_federation"}
    assert len(same) == 4
    for r in train:
        if r["round"] <= 2:                                     # the check of round 2 comes after its update
            want = same[(r["round"], r["participant"])]
            for k, v in want.items():
                if not any(x in k for x in VOLATILE):
                    assert r[k] == v, (r["round"], r["participant"], k)


def test_the_final_evaluation_scores_the_unchosen_end_too_and_loads_the_model_back(tmp_path, monkeypatch):
    """At the final evaluation the model the last check did not choose (the shadow where the model stayed,
    the model with its peers where it was reset) is scored as the model was (``unchosen/eval/...``
    metrics and ``unchosen_eval_prompts.jsonl.gz`` records: the same sets, ids and sampling seeds), with
    its weights loaded, and the model's state is loaded back after it. ``research-w`` (the calibrated
    models, so the two differ after their updates), 2 rounds, checked at both. The shadow is the run the
    participant makes alone (``loss-mode = alone``, the same knobs otherwise), bit for bit."""
    import gzip

    import torch

    import ftis_fed.participant as participant
    from ftis_fed.commands.sim import simulate_inprocess
    from ftis_fed.learn.training import read_snapshot

    seen: list[tuple[str, int, str, dict]] = []           # (participant, round, records file, weights loaded)
    heldout, evaluate = participant.Participant._heldout, participant.Participant.evaluate

    def spy_heldout(self, round, records):
        seen.append((self.name, round, records.name, self.policy.trainable_state()))
        return heldout(self, round, records)

    unchosen: dict[str, dict] = {}
    after: dict[str, tuple] = {}

    def spy_evaluate(self, round):
        unchosen[self.name] = self.shadowed.unchosen[0]
        out = evaluate(self, round)
        after[self.name] = self.trainer.snapshot()
        return out

    monkeypatch.setattr(participant.Participant, "_heldout", spy_heldout)
    monkeypatch.setattr(participant.Participant, "evaluate", spy_evaluate)
    assert simulate_inprocess(ROOT, [f'output-dir="{tmp_path}"', "num-rounds=2", 'loss-mode="F-TIS"',
                                     'source-adapt="shadow"', "source-adapt-period=1", "source-adapt-val-size=8",
                                     "source-adapt-val-samples=2", "prompts-per-round=4", "eval-size=32",
                                     "eval-samples=2", "eval-every=2", "eval-initial=false"], "research-w") == 0
    monkeypatch.undo()
    alone = tmp_path / "alone"
    assert simulate_inprocess(ROOT, [f'output-dir="{alone}"', "num-rounds=2", 'loss-mode="alone"',
                                     "prompts-per-round=4", "eval-every=0", "eval-initial=false"], "research-w") == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = {r["participant"]: r for r in rows if r["phase"] == "eval" and r["round"] == 2}
    kept = {r["participant"]: r["guard/kept_peers"] for r in rows
            if r["phase"] == "train" and r["round"] == 2 and r["participant"] != "_federation"}
    assert sorted(final) == sorted(kept) == ["full", "lora"]

    def records(p, name):
        return [json.loads(x) for x in gzip.decompress((tmp_path / "participants" / p / name).read_bytes())
                .decode().splitlines()]

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    for p in ("full", "lora"):
        calls = [(n, w) for who, rnd, n, w in seen if who == p and rnd == 2]
        assert [n for n, _ in calls] == [participant.EVAL_PROMPTS, participant.UNCHOSEN_EVAL_PROMPTS]
        model, _ = read_snapshot(tmp_path / "participants" / p / "policy.pt")    # saved after the last update
        shadow, _ = read_snapshot(tmp_path / "participants" / p / "shadow.pt")
        assert same(calls[0][1], model[0]) and same(calls[1][1], unchosen[p])     # each scored with its weights
        assert same(after[p][0], model[0]) and after[p][2] == model[2]           # the model is back
        assert same(model[0] if kept[p] == 0 else unchosen[p], shadow[0])        # one end is the shadow
        assert not same(model[0], unchosen[p])                                    # the other is not
        assert same(shadow[0], read_snapshot(alone / "participants" / p / "policy.pt")[0][0])   # alone's run
        main = {r["set"]: r for r in records(p, participant.EVAL_PROMPTS) if r["round"] == 2}
        other = {r["set"]: r for r in records(p, participant.UNCHOSEN_EVAL_PROMPTS)}
        assert sorted(main) == sorted(other) and all(main[s]["ids"] == other[s]["ids"] for s in main)
        assert all(other[s]["k"] == 2 and len(other[s]["sampled"]) == len(other[s]["ids"]) for s in other)
        acc = other["id"]["solved"].count("1") / len(other["id"]["solved"])
        assert final[p]["unchosen/eval/id/accuracy"] == pytest.approx(acc)
        assert 0 <= final[p]["unchosen/eval/ood/accuracy"] <= 1 and final[p]["unchosen/eval/seconds"] > 0
        solved = main["id"]["solved"]
        assert final[p]["eval/id/accuracy"] == pytest.approx(solved.count("1") / len(solved))
