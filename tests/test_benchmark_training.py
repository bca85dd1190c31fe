"""Training on GSM8K and MATH-500 through the run config (``task-source``, ``gsm8k-data``,
``math500-data``): pools from local fixture files in the real formats, disjoint train/eval splits,
task ids that receivers resolve with their own copy of the data, and MATH-500 answers compared with
math-verify, bounded in time, with the exact path kept for integers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftis_fed.config.federation import ParticipantSpec
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.config.validation import validate_run_config
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.tasks.rewards import Verifier, is_integer_answer
from ftis_fed.trust.signing import generate_keypair
from ftis_fed.tasks.symbolic import DIFFERENT, EQUAL, TIMEOUT, SymbolicChecker, default_checker
from ftis_fed.tasks.benchmarks import load_math500
from ftis_fed.tasks.resolve import TaskRefused, TaskResolver

FIXTURES = Path(__file__).parent / "fixtures"
GSM8K = str(FIXTURES / "gsm8k")
MATH500 = str(FIXTURES / "math500-small")
HOSTILE = "9^{9^{9^{9}}}"          # sympy would evaluate this for ever


def _rc(**kw) -> dict:
    return {"eval-every": 0, **{k.replace("_", "-"): v for k, v in kw.items()}}


# ----------------------------------------------------------------------------- pools and splits

def test_gsm8k_trains_on_its_train_file_and_evaluates_on_test():
    fed = federation_from_run_config(_rc(task_source="gsm8k", gsm8k_data=GSM8K, prompts_per_round=2,
                                         eval_every=1, eval_size=5, eval_ood_size=20, math500_data=MATH500))
    pool = fed.task.train_pool()
    assert [p.task_id for p in pool] == ["gsm8k/train/0", "gsm8k/train/1", "gsm8k/train/2"]
    assert [p.reference for p in pool] == ["72", "10", "-2"]
    sets = fed.eval_sets()
    assert [p.task_id for p in sets["id"]] == [f"gsm8k/test/{i}" for i in range(5)]
    assert len(sets["math500"]) == 16 and all(p.task_id.startswith("math500/test/") for p in sets["math500"])
    # a participant's k prompts of a round: distinct items of the train pool, different per participant
    a, b = (fed.task.prompts_for_round(p, 2, 1) for p in (0, 1))
    assert len({p.task_id for p in a}) == 2 and set(a) <= set(pool) and a != b


def test_math500_train_and_eval_splits_are_disjoint_by_problem():
    train = load_math500(MATH500, split="train", eval_percent=30)
    held = load_math500(MATH500, split="eval", eval_percent=30)
    assert train and held
    assert {p.text for p in train}.isdisjoint({p.text for p in held})
    assert len(train) + len(held) == len(load_math500(MATH500))
    assert all(p.task_id.startswith("math500/train/") for p in train)
    fed = federation_from_run_config(_rc(task_source="math500", math500_data=MATH500, math500_eval_percent=30,
                                         gsm8k_data=GSM8K, eval_every=1, eval_size=len(held), prompts_per_round=2))
    assert fed.eval_sets()["id"] == held and [p.task_id for p in fed.eval_sets()["gsm8k"]][:1] == ["gsm8k/test/0"]
    assert fed.task.train_pool() == tuple(train)


def test_horizontal_benchmark_rounds_share_their_prompts():
    fed = federation_from_run_config(_rc(task_source="gsm8k", gsm8k_data=GSM8K, prompts_per_round=2,
                                         advantage_groups="horizontal"))
    assert fed.task.scheme == "shared"
    assert fed.task.prompts_for_round(0, 2, 3) == fed.task.prompts_for_round(1, 2, 3)


@pytest.mark.parametrize("rc, match", [
    (_rc(task_source="gsm8k"), r"gsm8k-data='': needs the dataset's local file or folder"),
    (_rc(task_source="gsm8k", gsm8k_data="/nonexistent/gsm8k"), r"gsm8k-data='/nonexistent/gsm8k': no such file"),
    (_rc(task_source="math500", math500_data="openai/nothing"), r"math500-data='openai/nothing': no such file"),
    (_rc(task_source="gsm8k", gsm8k_data=GSM8K, task_scheme="expertise"), r"task-scheme='expertise'.*use iid or shared"),
    (_rc(task_source="squad"), r"task-source='squad': must be one of procedural, gsm8k, math500, user"),
    (_rc(task_source="gsm8k", gsm8k_data=GSM8K, eval_every=1, eval_size=6),
     r"eval-size=6 .* task-source=gsm8k: the gsm8k held-out set has 5 items"),
])
def test_benchmark_config_errors_name_the_key(rc, match):
    with pytest.raises(ValueError, match=match):
        federation_from_run_config(rc).check_data()


def test_building_a_config_reads_no_file_checking_its_data_does():
    """The constructor checks values only (a worker builds its config without touching the data);
    ``check_data``, called where the run starts, loads what the run will read."""
    fed = federation_from_run_config(_rc(task_source="gsm8k", gsm8k_data="/nonexistent/gsm8k", eval_every=1))
    with pytest.raises(ValueError, match="no such file"):
        fed.check_data()
    with pytest.raises(ValueError, match="no such file"):
        validate_run_config({**_rc(task_source="gsm8k", gsm8k_data="/nonexistent/gsm8k"), "p0-model": "tiny-llama",
                             "p1-model": "tiny-llama"})


# ----------------------------------------------------------------------------- receivers resolve ids themselves

def test_receivers_resolve_benchmark_ids_from_their_own_copy():
    fed = federation_from_run_config(_rc(task_source="math500", math500_data=MATH500, math500_eval_percent=30))
    r = TaskResolver(fed.task.families, fed.task.seed, fed.task.known_tasks(), fed.task.source)
    train = fed.task.train_pool()
    assert r.resolve(train[0].task_id) == train[0]
    held = load_math500(MATH500, split="eval", eval_percent=30)[0]
    for tid, reason in [(held.task_id, "eval_task"), (held.task_id.replace("/eval/", "/"), "eval_task"),
                        ("math500/train/test/algebra/999.json", "unknown_task"), ("gsm8k/test/0", "eval_task"),
                        ("add30/train/0/1", "unknown_task")]:                # procedural in a math500 run
        with pytest.raises(TaskRefused) as e:
            r.resolve(tid)
        assert e.value.reason == reason, tid
    # a procedural run has no copy of any benchmark: it cannot check, so it refuses
    plain = federation_from_run_config(_rc())
    with pytest.raises(TaskRefused, match="unknown_task"):
        TaskResolver(plain.task.families, 0, plain.task.known_tasks()).resolve("gsm8k/train/0")


def test_a_peer_gsm8k_batch_is_rescored_against_the_receivers_own_reference(tmp_path):
    """mallory trains on GSM8K too but forges every reference (and rewards itself by it): bob
    resolves each task id with his own copy of the file, counts the forged references and
    recomputes the rewards from his own; the batch is accepted (its prompts are real)."""
    for n in ("bob", "mallory"):
        generate_keypair(n, tmp_path / "keys")
    fed = federation_from_run_config({**_rc(task_source="gsm8k", gsm8k_data=GSM8K, prompts_per_round=2,
                                            group_size=2, max_new_tokens=4, min_participants=2),
                                      "run-name": "gsm8k-run", "output-dir": str(tmp_path)})
    pol = PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3)
    bob = Participant(ParticipantSpec("bob", pol, 0, 2, str(tmp_path / "keys"), str(tmp_path / "bob")), fed)
    mallory = Participant(ParticipantSpec("mallory", pol, 1, 2, str(tmp_path / "keys"), str(tmp_path / "m"),
                                          byzantine="forge"), fed)
    bob.generate(1, False)
    frames, _ = mallory.generate(1, False)
    assert all(g.task_id.startswith("gsm8k/train/") for g in mallory.own[1].groups)
    m = bob.learn(1, frames)
    assert m["offpolicy/accepted"] == 1 and m["train/peer_samples"] == 4
    assert m["trust/mallory/forged_references"] == 2


# ----------------------------------------------------------------------------- math-verify

def test_math500_answers_are_compared_symbolically(monkeypatch):
    """Equal expressions in other forms are equal. The checker gets 30 s an answer instead of the 2 s
    default: under load ((x+1)^2 against x^2 + 2x + 1 beside two training processes, at the lowest
    priority) the default time limit ran out and a time-out is "not equal" by design, which is the
    machine's speed, not what this test is about (the tests below test the limit)."""
    from ftis_fed.tasks import symbolic

    checker = SymbolicChecker(timeout_s=30)
    monkeypatch.setattr(symbolic, "_CHECKER", checker)
    symbolic.symbolic_equal.cache_clear()                  # no verdict cached from another checker
    v = Verifier()
    try:
        for completion, ref in [("so \\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),
                                ("\\boxed{(x+1)^2}", "x^2 + 2x + 1"),
                                ("\\boxed{0.5}", "\\frac{1}{2}")]:
            assert v.check("math500/train/x", completion, ref) == (True, 1.0), (completion, ref)
        assert v.check("math500/train/x", "\\boxed{\\sqrt{3}/2}", "\\frac{\\sqrt{2}}{2}")[0] is False
    finally:
        checker.close()
        symbolic.symbolic_equal.cache_clear()              # nor one of this checker after it


def test_integer_answers_take_only_the_exact_path():
    """Integer references (every GSM8K answer, many MATH-500 ones) never reach math-verify: the
    verdict is the deterministic exact comparison receivers re-verify bit for bit."""
    assert is_integer_answer("12") and is_integer_answer("-3") and not is_integer_answer("\\frac{1}{2}")
    checker = default_checker()
    before = checker.calls
    v = Verifier()
    assert v.check("math500/train/x", "\\boxed{12}", "12")[0] is True
    assert v.check("math500/train/x", "\\boxed{3 \\cdot 4}", "12")[0] is False      # exact path: not parsed
    assert v.check("gsm8k/train/0", "#### 72", "72")[0] is True
    assert checker.calls == before


def test_a_hostile_answer_times_out_and_the_checker_goes_on():
    """math-verify's own time-out (inside the helper) and the caller's hard limit: either way the
    hostile answer is 'timeout' (not equal) and the next answer is checked normally."""
    c = SymbolicChecker(timeout_s=1)
    try:
        assert c.check(HOSTILE, "\\frac{1}{2}") in (TIMEOUT, DIFFERENT)
        assert c.check("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}") == EQUAL
    finally:
        c.close()


def test_the_hard_limit_alone_kills_a_stuck_helper():
    """Without math-verify's own time-outs nothing inside the helper stops the hostile answer: the
    caller's hard limit kills the helper, reports a time-out and starts a fresh one for the next."""
    c = SymbolicChecker(timeout_s=1, inner_timeout=False)
    try:
        assert c.check(HOSTILE, "\\frac{1}{2}") == TIMEOUT
        assert c.timeouts == 1 and c.restarts == 1
        assert c.check("\\frac{1}{2}", "0.5") == EQUAL and c.restarts == 2
    finally:
        c.close()


def test_a_hostile_math500_completion_scores_zero():
    assert Verifier().check("math500/train/x", f"\\boxed{{{HOSTILE}}}", "\\frac{1}{2}") == (False, 0.0)


def test_math_verify_is_declared_in_the_extras():
    import tomllib

    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(d.startswith("math-verify") for d in extras["math"])
    assert any(d.startswith("math-verify") for d in extras["dev"])
    json.dumps(extras)
