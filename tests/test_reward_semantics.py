"""A TRL user's reward functions: which one defines "solved" (training and evaluation alike),
TRL's per-function metrics ``rewards/<name>/mean|std``, ``async def`` functions, factories with
keyword arguments, and reward errors that stop the run (``task-reward-errors``) with the whole
message and no export. Real tiny models, real keys, the real engine; the ``flwr run`` test is slow."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from ftis_fed.config.federation import ParticipantSpec
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.engine.core import Engine, RewardFunctionFailed, eval_line, per_function_line, reward_error_of
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.learn.evaluation import evaluate
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.tasks.reward_funcs import REWARD_ERROR, RewardFuncs, RewardFunctionError
from ftis_fed.tasks.scores import GroupScores, per_function_metrics
from ftis_fed.trust.signing import generate_keypair, load_key_directory

#: TRL-style functions: an accuracy reward and a format reward (as in TRL's examples), plus broken ones.
REWARDS_PY = '''
import asyncio, re

def accuracy(prompts, completions, answer, **kwargs):
    out = []
    for c, gold in zip(completions, answer):
        nums = re.findall(r"-?\\d+", c if isinstance(c, str) else c[0]["content"])
        out.append(1.0 if nums and nums[-1] == str(gold) else 0.0)
    return out

def format_reward(completions, **kwargs):
    return [1.0 if re.fullmatch(r"\\s*-?\\d+\\s*", c if isinstance(c, str) else c[0]["content"]) else 0.0
            for c in completions]

async def slow_format(completions, **kwargs):
    await asyncio.sleep(0)
    return format_reward(completions)

def explodes(completions, **kwargs):
    return {}["no such key in this reward function"]

def one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)

def scaled(scale):
    def scaled_reward(completions, **kwargs):
        return [scale * len(c) for c in completions]
    return scaled_reward
'''


def _task(tmp: Path, n: int = 60) -> tuple[Path, Path]:
    rows = [{"prompt": f"What is {a} + {b}? Reply with just the number.", "answer": str(a + b)}
            for a in range(1, 10) for b in range(1, 10)][:n]
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = tmp / "rw.py"
    module.write_text(REWARDS_PY)
    return data, module


def _rc(data: Path, module: Path, funcs: str = "accuracy,format_reward", **kw) -> dict:
    return {"task-source": "user", "task-data": str(data), "task-answer-column": "answer",
            "task-rewards": ",".join(f"{module}:{f}" for f in funcs.split(",")), "task-reward-weights": "",
            "task-eval-percent": 20, "eval-every": 0, **kw}


class Replies:
    """A greedy generator with fixed replies (evaluation's interface), to test the scoring alone."""

    def __init__(self, reply):
        self.reply = reply

    def generate_greedy(self, prompts, max_new_tokens):
        return [self.reply(p) for p in prompts]


# ----------------------------------------------------------------------------- solved: one rule

def test_a_format_reward_never_makes_a_wrong_answer_solved(tmp_path):
    """The bug: eval/id/accuracy counted combined reward > 0, so every answer wrong but in format
    read as solved. Now the accuracy function decides, at evaluation and in training alike."""
    data, module = _task(tmp_path)
    fed = federation_from_run_config(_rc(data, module, **{"task-reward-weights": "1.0,0.2", "eval-size": 8}))
    task, verifier = fed.task.user, fed.task.verifier()
    assert task.solved_name == "accuracy"                                  # the default: accuracy-like
    sets = fed.eval_sets()
    wrong = evaluate(Replies(lambda p: "1000"), sets, verifier)            # a number, never the sum
    right = evaluate(Replies(lambda p: p.reference), sets, verifier)
    assert wrong["eval/id/accuracy"] == 0.0 and right["eval/id/accuracy"] == 1.0
    tid = next(iter(task.rows_by_id))
    gold = task.rows_by_id[tid]["answer"]
    s = task.group_scores(tid, ["1000", gold, f"it is {gold}"])
    assert s.rewards == pytest.approx((0.2, 1.2, 1.0)) and s.solved == (False, True, True)
    assert s.per_function == {"accuracy": (0.0, 1.0, 1.0), "format_reward": (1.0, 1.0, 0.0)}
    assert verifier.check(tid, "1000", gold) == (False, pytest.approx(0.2))


def test_the_solved_function_and_threshold_are_keys(tmp_path):
    data, module = _task(tmp_path)
    fed = federation_from_run_config(_rc(data, module, **{"task-solved-reward": "format_reward",
                                                          "task-solved-threshold": 0.5}))
    task = fed.task.user
    assert task.solved_name == "format_reward"
    assert task.check("1000", "", next(iter(task.rows_by_id))) == (True, 1.0)   # format alone solves, as asked
    with pytest.raises(ValueError, match=r"task-solved-reward='nope': not one of task-rewards' functions "
                                         r"\(accuracy, format_reward\)"):
        federation_from_run_config(_rc(data, module, **{"task-solved-reward": "nope"})).task.train_pool()
    with pytest.raises(ValueError, match=r"task-reward-errors='loud': must be one of stop, drop"):
        federation_from_run_config(_rc(data, module, **{"task-reward-errors": "loud"}))


def test_per_function_metrics_are_trl_s_nanmean_and_nanstd():
    scores = [GroupScores((1.0, 0.2), (True, False), {"acc": (1.0, 0.0), "fmt": (1.0, math.nan)}),
              GroupScores((0.0, 1.0), (False, True), {"acc": (0.0, 1.0), "fmt": (math.nan, math.nan)})]
    m = per_function_metrics(scores)
    assert m["rewards/acc/mean"] == 0.5 and m["rewards/acc/std"] == pytest.approx(statistics.stdev([1, 0, 0, 1]))
    assert m["rewards/fmt/mean"] == 1.0 and m["rewards/fmt/std"] == 0.0      # one value scored (TRL: NaN)
    assert per_function_metrics([GroupScores((math.nan,), (False,), {"x": (math.nan,)})]) == {}
    line = per_function_line({"rewards/acc/mean": 0.5, "rewards/acc/std": 0.58, "reward/mean": 1.0})
    assert line == "  rewards acc 0.500±0.58" and per_function_line({"reward/mean": 1.0}) == ""


def test_the_console_prints_no_nan_without_ood_families():
    assert eval_line({"eval/id/accuracy": 0.25, "eval/id/n": 8.0}) == "ID 0.250"
    assert eval_line({"eval/id/accuracy": 0.25, "eval/ood/accuracy": 0.5}) == "ID 0.250  OOD 0.500"
    assert "nan" not in eval_line({})


# ----------------------------------------------------------------------------- async, factories

def test_async_functions_and_factories_with_keyword_arguments(tmp_path):
    pytest.importorskip("trl")
    data, module = _task(tmp_path)
    funcs = RewardFuncs.from_config(f"{module}:slow_format,trl.rewards:get_soft_overlong_punishment,{module}:scaled",
                                    "", "get_soft_overlong_punishment = {max_completion_len = 4, soft_punish_cache = 2}"
                                        "\nscaled = {scale = 0.5}")
    assert funcs.names == ("slow_format", "soft_overlong_punishment_reward", "scaled_reward")   # TRL's names
    per = funcs.per_function(["p"] * 3, ["7", "no", "seven"], [[1], [1, 2, 3], [1, 2, 3, 4, 5]], {})
    assert per == [[1.0, 0.0, 0.0], [0.0, -0.5, -1.0], [0.5, 1.0, 2.5]]
    assert funcs.funcs[1].identity()["kwargs"] == {"max_completion_len": 4, "soft_punish_cache": 2}
    other = RewardFuncs.from_config(f"{module}:scaled", "", "scaled = {scale = 2.0}")
    assert other.digest() != RewardFuncs.from_config(f"{module}:scaled", "", "scaled = {scale = 0.5}").digest()
    with pytest.raises(ValueError, match=r"task-reward-kwargs: 'nope' is not a function of task-rewards"):
        RewardFuncs.from_config(f"{module}:scaled", "", "nope = {a = 1}")
    with pytest.raises(ValueError, match=r"task-reward-kwargs=.*not a TOML table"):
        RewardFuncs.from_config(f"{module}:scaled", "", "scaled = ")


def test_reward_errors_name_the_function_in_one_whole_line(tmp_path):
    data, module = _task(tmp_path)
    for name, says in (("explodes", r"raised KeyError at rw.py:\d+: 'no such key in this reward function'"),
                       ("one_short", r"returned 2 rewards, but 3 were expected")):
        funcs = RewardFuncs.from_config(f"{module}:{name}")
        with pytest.raises(RewardFunctionError, match=f"{REWARD_ERROR} reward function '{name}' .*{says}") as e:
            funcs.rewards(["p"] * 3, ["a", "b", "c"], [[]] * 3, {})
        text = str(e.value)
        # what the engine reads back out of a worker's traceback inside Flower's error reason
        wrapped = f"<class 'WorkerError'>:<'Traceback (most recent call last):\n  File x\n{type(e.value).__name__}: {text}\n'>"
        assert reward_error_of(wrapped) == text and "\n" not in text


# ----------------------------------------------------------------------------- runs

def _federation(tmp: Path, rc: dict, names=("alice", "bob"), rounds: int = 2, lr: float = 1e-3):
    parts, fed = {}, None
    for name in names:
        generate_keypair(name, tmp / "keys")
    for i, name in enumerate(names):
        f = federation_from_run_config({**rc, "num-rounds": rounds, "group-size": 4, "prompts-per-round": 2,
                                        "max-new-tokens": 4, "run-name": "rs", "output-dir": str(tmp),
                                        "min-participants": len(names), "eval-max-new-tokens": 4})
        fed = fed or f
        spec = ParticipantSpec(name, PolicyConfig(model="tiny-arith", adapter="full", lr=lr), i, len(names),
                               str(tmp / "keys"), str(tmp / "participants" / name))
        parts[name] = Participant(spec, f)
    return fed, parts


ACC_FORMAT = {"task-reward-weights": "1.0,0.2", "eval-every": 2, "eval-size": 8, "eval-initial": False}


def test_generate_reports_trl_s_per_function_metrics_and_the_accuracy_s_solved(tmp_path):
    """A TRL-style data set, accuracy + format (weights 1.0, 0.2): a participant's generate
    metrics are its own batch's, recomputed here completion by completion."""
    data, module = _task(tmp_path)
    fed, parts = _federation(tmp_path, _rc(data, module, **ACC_FORMAT, **{"log-completions": 1}), names=("alice",),
                             rounds=2, lr=0.0)
    # the generate metrics of one participant against its own batch, recomputed here
    frames, m = parts["alice"].generate(1, False)
    batch = parts["alice"].own[1]
    task = fed.task.user
    tok = parts["alice"].policy.tokenizer
    acc, fmt, solved = [], [], []
    for g in batch.groups:
        texts = [tok.decode(c.tolist(), skip_special_tokens=True) for c in g.completion_ids]
        s = task.group_scores(g.task_id, texts, [c.tolist() for c in g.completion_ids])
        acc += s.per_function["accuracy"]
        fmt += s.per_function["format_reward"]
        solved += s.solved
        assert list(g.rewards) == pytest.approx([a + 0.2 * f for a, f in zip(s.per_function["accuracy"],
                                                                                s.per_function["format_reward"])])
    assert m["rewards/accuracy/mean"] == pytest.approx(statistics.mean(acc))
    assert m["rewards/accuracy/std"] == pytest.approx(statistics.stdev(acc))
    assert m["rewards/format_reward/mean"] == pytest.approx(statistics.mean(fmt))
    assert m["reward/solved_frac"] == pytest.approx(statistics.mean(solved)) == pytest.approx(statistics.mean(acc))
    # log-completions = 1: the round's first prompt, its 4 completions, as scored (TRL's log_completions)
    log = [json.loads(x) for x in (tmp_path / "participants" / "alice" / "completions.jsonl").read_text().splitlines()]
    g = batch.groups[0]
    assert [r["task_id"] for r in log] == [g.task_id] * 4 and all(r["round"] == 1 for r in log)
    assert [r["reward"] for r in log] == pytest.approx(list(g.rewards))
    assert [r["rewards"]["accuracy"] for r in log] == acc[:4] and [r["solved"] for r in log] == list(solved[:4])
    table = (tmp_path / "participants" / "alice" / "completions.md").read_text()
    assert table.startswith("## round 1, alice\n\n| prompt | completion | reward | accuracy | format_reward | solved |")
    assert table.count("\n| ") == 5                                        # header + 4 completions
    # the card: the learning rate actually used (lr = 0 is "auto": 1e-5 for full fine-tuning), the
    # reward functions with their weights, the solved rule (it showed `lr: 0.0` and no functions)
    card = parts["alice"]._card()
    assert card.method["learning rate"] == 1e-5
    assert card.task["reward functions (weight)"] == "accuracy (1), format_reward (0.2)"
    assert card.task["solved"] == "accuracy >= 1" and card.task["data set"] == "train.jsonl"


@pytest.mark.slow
def test_a_trl_style_task_with_accuracy_and_format_rewards_end_to_end(tmp_path):
    """Two tiny-arith participants, a TRL-style data set, accuracy + format (weights 1.0, 0.2),
    two rounds through the engine: every row has the per-function metrics, rewards.png is drawn,
    and the held-out accuracy counts the accuracy function alone (recomputed from greedy replies)."""
    data, module = _task(tmp_path)
    fed2, parts = _federation(tmp_path / "run", _rc(data, module, **ACC_FORMAT), rounds=2)
    task = fed2.task.user
    eng = Engine(fed2, load_key_directory(tmp_path / "run" / "keys"), tmp_path / "run", InProcessTransport(parts),
                 plots=True)
    assert eng.run() == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train" and r["participant"] != "_federation"]
    assert len(train) == 4 and all("rewards/accuracy/mean" in r and "rewards/format_reward/std" in r for r in train)
    assert (tmp_path / "run" / "rewards.png").exists()
    evals = {r["participant"]: r for r in rows if r["phase"] == "eval"}
    sets = fed2.eval_sets()
    for name, p in parts.items():
        replies = p.policy.generate_greedy(sets["id"], fed2.eval_max_new_tokens)
        by_accuracy = [task.group_scores(q.task_id, [r]).per_function["accuracy"][0] >= 1.0
                       for q, r in zip(sets["id"], replies)]
        assert evals[name]["eval/id/accuracy"] == pytest.approx(sum(by_accuracy) / len(by_accuracy))


@pytest.mark.parametrize("broken", ["explodes", "one_short"])
def test_a_broken_reward_function_stops_the_run_and_nothing_is_exported(tmp_path, broken):
    data, module = _task(tmp_path)
    fed, parts = _federation(tmp_path, _rc(data, module, funcs=f"accuracy,{broken}"), rounds=2)
    eng = Engine(fed, load_key_directory(tmp_path / "keys"), tmp_path, InProcessTransport(parts), plots=False)
    with pytest.raises(RewardFunctionFailed, match=rf"generate: the reward function failed, so the run stops .*"
                                                   rf"participant alice: {REWARD_ERROR} reward function '{broken}'"):
        eng.run()
    assert eng.completed_round == 0
    assert not any((tmp_path / "participants" / n / "export").exists() for n in parts)


def test_drop_goes_on_but_exports_no_untrained_model(tmp_path):
    data, module = _task(tmp_path)
    fed, parts = _federation(tmp_path, _rc(data, module, funcs="accuracy,explodes",
                                           **{"task-reward-errors": "drop"}), rounds=2)
    eng = Engine(fed, load_key_directory(tmp_path / "keys"), tmp_path, InProcessTransport(parts), plots=False)
    assert eng.run() == 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    fed_rows = [r for r in rows if r["participant"] == "_federation"]
    assert [r["fed/generate_failures"] for r in fed_rows] == [2.0, 2.0]
    last = {r["participant"]: r for r in rows if r["round"] == 2 and r["phase"] == "train"}
    assert last["alice"]["export/skipped_untrained"] == 1.0 and last["alice"]["train/steps"] == 0
    assert not any((tmp_path / "participants" / n / "export").exists() for n in parts)


@pytest.mark.slow
def test_flwr_run_with_a_raising_reward_function_exits_non_zero_without_export(tmp_path):
    """The real ``flwr run`` (``ftis-fed sim``): the run ends failed at round 1, the launcher exits
    non-zero, the console has the function's whole message, no participant exported a model."""
    from test_flower_e2e import run_sim

    data, module = _task(tmp_path)
    proc = run_sim(tmp_path, {"p2-model": "", "num-rounds": 3, "prompts-per-round": 2, "eval-every": 0,
                              **_rc(data, module, funcs="accuracy,explodes")})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert f"{REWARD_ERROR} reward function 'explodes' ({module}:explodes) raised KeyError at rw.py:" in out, out[-4000:]
    assert "'no such key in this reward function'" in out
    assert not list((tmp_path / "out").glob("participants/*/export"))


def test_ftis_fed_eval_scores_a_model_on_the_user_s_own_task(tmp_path, capsys):
    """``ftis-fed eval --model M --run-config ...``: the held-out rows of your task, your reward
    functions and solved rule, one JSON line; the same figure the run's evaluation gives."""
    from ftis_fed.commands.cli import main

    data, module = _task(tmp_path)
    rc = _rc(data, module, **{"task-reward-weights": "1.0,0.2", "eval-size": 6})
    items = [f"{k}={json.dumps(v)}" for k, v in rc.items()]
    main(["eval", "--model", "tiny-arith", "--max-new-tokens", "4", *(a for i in items for a in ("--run-config", i))])
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["model"] == "tiny-arith" and got["eval/id/n"] == 6.0 and got["task-source"] == "user"
    fed = federation_from_run_config(rc)
    from ftis_fed.learn.evaluation import _policy_for
    want = evaluate(_policy_for("tiny-arith", "hf"), fed.eval_sets(), fed.task.verifier(), 4)
    assert got["eval/id/accuracy"] == want["eval/id/accuracy"]


def test_ftis_fed_sim_in_process_exits_1_with_the_whole_line(tmp_path, capsys):
    """``ftis-fed sim --transport inprocess`` (the research tier's path): the same stop, exit 1 and
    the reward function's line on stderr, no traceback."""
    from ftis_fed.commands.sim import simulate_inprocess

    data, module = _task(tmp_path)
    rc = {"p0-participant": "alice", "p0-model": "tiny-arith", "p0-adapter": "full", "p1-participant": "bob",
          "p1-model": "tiny-arith", "p1-adapter": "full", "p2-model": "", "num-rounds": 2, "group-size": 4,
          "prompts-per-round": 2, "max-new-tokens": 4, "output-dir": str(tmp_path / "out"),
          **_rc(data, module, funcs="accuracy,one_short")}
    items = " ".join(f"{k}={json.dumps(v)}" for k, v in rc.items())
    assert simulate_inprocess(Path(__file__).resolve().parent.parent, [items]) == 1
    err = capsys.readouterr().err
    assert f"ftis-fed sim: the run failed: generate: the reward function failed" in err
    assert f"{REWARD_ERROR} reward function 'one_short' ({module}:one_short) returned 3 rewards, but 4" in err
    assert "Traceback" not in err
