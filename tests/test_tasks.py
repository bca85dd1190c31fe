"""Task suite: determinism, disjoint splits, partitions, per-round sampling, benchmark loaders."""

import json
import re
import shutil
from pathlib import Path

import pytest

from ftis_fed.tasks.rewards import Verifier
from ftis_fed.tasks import benchmarks
from ftis_fed.tasks.benchmarks import load_gsm8k, load_math500, read_rows
from ftis_fed.tasks.families import FAMILIES, ID_FAMILIES, INSTRUCTION, OOD_FAMILIES
from ftis_fed.tasks.suite import (
    TaskSpec,
    content_key,
    eval_sets,
    make_tasks,
    partition,
    prompts_for_round,
    shard,
    split_of,
    task_at,
)

FIXTURES = Path(__file__).parent / "fixtures"


# ----------------------------------------------------------------------------- instances

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_instances_are_deterministic_and_answers_are_right(family):
    a = make_tasks(family, "train", 40, seed=3, distinct=False)
    b = [task_at(family, "train", 3, i) for i in range(40)]
    assert a == b
    assert all(p.task_id == f"{family}/train/3/{i}" for i, p in enumerate(a))
    assert all(p.text.endswith(FAMILIES[family].instruction) for p in a)
    # The reference is the true answer of the question (checked by evaluating the arithmetic).
    for p in a:
        q = p.text
        if m := re.fullmatch(r"What is ([\d +\-]+)\? .*", q):
            assert int(p.reference) == eval(m.group(1))
        elif m := re.fullmatch(r"What is (\d+) times (\d+)\? .*", q):
            assert int(p.reference) == int(m.group(1)) * int(m.group(2))
        elif m := re.fullmatch(r"What number comes right after (\d+)\? .*", q):
            assert int(p.reference) == int(m.group(1)) + 1
        else:  # word problems: first two numbers in the text, + or - by the verb
            x, y = map(int, re.findall(r"\d+", q)[:2])
            sub = any(w in q for w in ("gives away", "takes", "lost"))
            assert int(p.reference) == (x - y if sub else x + y), q
            assert int(p.reference) >= 0


@pytest.mark.parametrize("family", ["add99", "sub99"])
def test_worked_solutions_are_right_column_by_column_and_score_as_solved(family):
    """The worked families' replies: ones column (with its carry / borrow), tens column, then the
    number; every step is true arithmetic, the default verifier scores the solution as solved, and a
    solution with a wrong final number as not solved."""
    from ftis_fed.tasks.families import WORKED_INSTRUCTION
    from ftis_fed.tasks.suite import worked_reply

    v = Verifier()
    for i in range(60):
        p = task_at(family, "train", 1, i)
        sol = worked_reply(family, "train", 1, i)
        assert p.text.endswith(WORKED_INSTRUCTION)
        steps, _, final = sol.rpartition("; so ")
        assert final == p.reference
        for step in steps.split("; "):
            lhs, rhs = step.split("=")
            assert eval(lhs) == int(rhs), sol
        a, b = map(int, re.findall(r"\d+", p.text)[:2])
        assert 10 <= b <= 99 and 10 <= a <= 99
        assert v.check(p.task_id, sol, p.reference, p.text)[0] == 1.0
        assert v.check(p.task_id, sol.rpartition(" ")[0] + " " + str(int(final) + 1), p.reference, p.text)[0] == 0.0
    assert worked_reply("add30", "train", 0, 0) == task_at("add30", "train", 0, 0).reference   # no steps: bare


def test_seeds_give_different_instances():
    a = [p.text for p in make_tasks("add30", "train", 20, seed=0)]
    b = [p.text for p in make_tasks("add30", "train", 20, seed=1)]
    assert a != b


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_train_and_eval_never_share_a_problem(family):
    """Disjoint by content: every key belongs to exactly one split, whatever seed or index drew it."""
    train = {content_key(family, "train", s, i) for s in range(3) for i in range(150)}
    evals = {content_key(family, "eval", s, i) for s in range(3) for i in range(150)}
    assert train and evals
    assert not train & evals
    assert all(split_of(family, k) == "train" for k in train)
    assert all(split_of(family, k) == "eval" for k in evals)
    train_txt = {p.text for p in make_tasks(family, "train", 200, 0, distinct=False)}
    eval_txt = {p.text for p in make_tasks(family, "eval", 100, 0, distinct=False)}
    assert not train_txt & eval_txt


def test_eval_share_is_about_eval_percent():
    keys = [(a, b) for a in range(1, 30) for b in range(1, 30)]  # the whole add30 / mul15-like space
    assert FAMILIES["add30"].eval_percent == 20 and FAMILIES["mul15"].eval_percent == 50
    for fam, target in (("add30", 0.2), ("mul15", 0.5)):
        share = sum(split_of(fam, k) == "eval" for k in keys) / len(keys)
        assert abs(share - target) < 0.05


def test_every_family_has_a_verifier_rule_and_eval_sets_are_distinct():
    v = Verifier()
    sets = eval_sets(64, seed=0)
    assert set(sets) == {"id", *OOD_FAMILIES}
    for name, prompts in sets.items():
        assert len(prompts) == 64
        assert len({p.text for p in prompts}) == 64, name
        assert all(v.knows(p.task_id) for p in prompts)
        assert all(v.reward(p.task_id, p.reference, p.reference) == 1.0 for p in prompts)
    assert {p.task_id.split("/")[0] for p in sets["id"]} == set(ID_FAMILIES)


def test_bad_arguments_name_the_field_and_the_limit():
    with pytest.raises(ValueError, match=r"'nope' is unknown: valid families are \[.*'add30'"):
        task_at("nope", "train", 0, 0)
    with pytest.raises(ValueError, match=r"split='test': must be one of \('train', 'eval'\)"):
        task_at("add30", "test", 0, 0)
    with pytest.raises(ValueError, match=r"index=-1: must be an integer >= 0"):
        task_at("add30", "train", 0, -1)
    with pytest.raises(ValueError, match=r"task.scheme='noniid': must be one of"):
        TaskSpec(scheme="noniid")
    with pytest.raises(ValueError, match=r"task.skew=1.5: must be in \[0, 1\]"):
        TaskSpec(scheme="expertise", skew=1.5)
    with pytest.raises(ValueError, match=r"partition_id=3: must be an integer in \[0, 3\)"):
        prompts_for_round(3, 3, 0, 4)
    with pytest.raises(ValueError, match=r"prompts_per_round=0: must be an integer >= 1"):
        prompts_for_round(0, 3, 0, 0)


# ----------------------------------------------------------------------------- partitions

def test_iid_rounds_are_deterministic_disjoint_and_fresh():
    P, k = 3, 6
    seen = set()
    for r in range(4):
        for p in range(P):
            a = prompts_for_round(p, P, r, k, seed=7)
            assert a == prompts_for_round(p, P, r, k, seed=7)
            assert len(a) == k
            assert all(q.task_id.split("/")[1] == "train" for q in a)
            ids = {q.task_id for q in a}
            assert not ids & seen  # no instance shared between participants or repeated across rounds
            seen |= ids
    fams = [q.task_id.split("/")[0] for p in range(P) for r in range(20) for q in prompts_for_round(p, P, r, k)]
    for f in ID_FAMILIES:  # uniform mixture
        assert abs(fams.count(f) / len(fams) - 1 / len(ID_FAMILIES)) < 0.08


def test_expertise_partition_gives_each_participant_its_own_family():
    P = len(ID_FAMILIES)
    for p in range(P):
        fams = {q.task_id.split("/")[0] for r in range(5) for q in prompts_for_round(p, P, r, 8, scheme="expertise")}
        assert fams == {ID_FAMILIES[p]}
    skewed = partition(P, "expertise", skew=0.75)
    for p, w in enumerate(skewed):
        assert w[ID_FAMILIES[p]] == pytest.approx(0.75)
        assert sum(w.values()) == pytest.approx(1.0)
    # the sampled share follows the skew
    fams = [q.task_id.split("/")[0] for r in range(50) for q in prompts_for_round(0, P, r, 8, scheme="expertise", skew=0.75)]
    assert abs(fams.count(ID_FAMILIES[0]) / len(fams) - 0.75) < 0.08


def test_listed_scheme_gives_each_participant_the_families_its_entry_names():
    """``task-scheme = listed``: participant i draws from entry i (modulo) of ``task-mixtures``, weights
    normalised; bad entries are refused naming the entry and the limit, through the run config too."""
    from ftis_fed.config.keys import federation_from_run_config
    from ftis_fed.tasks.suite import TaskSpec

    spec = TaskSpec(scheme="listed", mixtures="add99:3, sub99; sub99", families=("add99", "sub99"), prompts_per_round=8)
    assert spec.mixture(0, 2) == {"add99": 0.75, "sub99": 0.25}
    assert spec.mixture(1, 2) == {"add99": 0.0, "sub99": 1.0} and spec.mixture(2, 3) == spec.mixture(0, 2)
    fams = [[q.task_id.split("/")[0] for r in range(50) for q in spec.prompts_for_round(p, 2, r)] for p in (0, 1)]
    assert set(fams[1]) == {"sub99"} and abs(fams[0].count("add99") / len(fams[0]) - 0.75) < 0.08
    for bad, why in [("add99:0", "entry 0 .*finite weight > 0"), ("add99; mul10", "entry 1 .*'mul10' is not one of"),
                     ("add99;", "entry 1: empty"), ("add99, add99", "each family once"), ("", "exactly when")]:
        with pytest.raises(ValueError, match=why):
            TaskSpec(scheme="listed", mixtures=bad, families=("add99", "sub99"))
    with pytest.raises(ValueError, match="task-mixtures='sub99': set it exactly when task-scheme=listed"):
        federation_from_run_config({"task-scheme": "iid", "task-families": "add99,sub99", "task-mixtures": "sub99"})
    fed = federation_from_run_config({"task-scheme": "listed", "task-families": "add99,sub99",
                                      "task-mixtures": "add99,sub99; sub99"})
    assert fed.task.mixture(1, 2) == {"add99": 0.0, "sub99": 1.0}


def test_dirichlet_partition_is_seeded_and_normalised():
    a, b = partition(4, "dirichlet", seed=1, alpha=0.3), partition(4, "dirichlet", seed=1, alpha=0.3)
    assert a == b and a != partition(4, "dirichlet", seed=2, alpha=0.3)
    assert all(sum(w.values()) == pytest.approx(1.0) for w in a)


def test_shared_scheme_gives_everyone_the_same_prompts():
    a = prompts_for_round(0, 3, 2, 5, scheme="shared")
    assert a == prompts_for_round(2, 3, 2, 5, scheme="shared")
    assert a != prompts_for_round(0, 3, 3, 5, scheme="shared")


def test_shard_splits_a_pool_without_overlap():
    pool = load_gsm8k(FIXTURES / "gsm8k", split="test")
    shards = [shard(pool, p, 2) for p in range(2)]
    assert sorted(q.task_id for s in shards for q in s) == sorted(q.task_id for q in pool)
    assert not {q.task_id for q in shards[0]} & {q.task_id for q in shards[1]}


# ----------------------------------------------------------------------------- benchmark loaders

GSM8K_REFS = ["18", "3", "70000", "540", "1200"]


def test_gsm8k_jsonl_file_and_directory_layouts(tmp_path):
    by_file = load_gsm8k(FIXTURES / "gsm8k" / "test.jsonl", split="test")
    by_dir = load_gsm8k(FIXTURES / "gsm8k", split="test")
    assert by_file == by_dir
    assert [p.reference for p in by_file] == GSM8K_REFS
    assert by_file[0].task_id == "gsm8k/test/0"
    assert by_file[0].text.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert "####" in by_file[0].text  # the instruction names the answer format
    assert [p.reference for p in load_gsm8k(FIXTURES / "gsm8k", split="train")] == ["72", "10", "-2"]
    # the openai/grade-school-math repository layout
    official = tmp_path / "grade_school_math" / "data"
    official.mkdir(parents=True)
    shutil.copy(FIXTURES / "gsm8k" / "test.jsonl", official / "test.jsonl")
    assert load_gsm8k(tmp_path, split="test", limit=2) == by_file[:2]


def test_gsm8k_parquet_layout_of_the_hub_repo(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = read_rows(FIXTURES / "gsm8k" / "test.jsonl")
    (tmp_path / "main").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:3]), tmp_path / "main" / "test-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[3:]), tmp_path / "main" / "test-00001-of-00002.parquet")
    prompts = load_gsm8k(tmp_path, split="test")
    assert [p.reference for p in prompts] == GSM8K_REFS
    assert prompts == load_gsm8k(FIXTURES / "gsm8k", split="test")


def test_math500_jsonl():
    prompts = load_math500(FIXTURES / "math500")
    assert [p.task_id for p in prompts][:2] == ["math500/test/precalculus/807.json", "math500/test/algebra/2584.json"]
    assert [p.reference for p in prompts] == [r"\left( 3, \frac{\pi}{2} \right)", r"\frac{14}{3}", "9",
                                              r"\text{Evelyn}", r"\frac{\sqrt{3}}{2}"]
    assert "\\boxed{}" in prompts[0].text
    # the reference agrees with the solution's last \boxed{} under the verifier
    v = Verifier()
    for p, row in zip(prompts, read_rows(FIXTURES / "math500" / "test.jsonl")):
        assert v.reward(p.task_id, row["solution"], p.reference) == 1.0


def test_math500_without_answer_field_falls_back_to_boxed(tmp_path):
    rows = read_rows(FIXTURES / "math500" / "test.jsonl")
    for r in rows:
        del r["answer"]
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    refs = [p.reference for p in load_math500(tmp_path)]
    assert refs[1] == r"\frac{14}{3}" and refs[4] == r"\frac{\sqrt{3}}{2}"


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no dataset file found"):
        load_gsm8k(tmp_path, split="test")
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "q?"}) + "\n")
    with pytest.raises(ValueError, match="gsm8k row 0: field 'answer' is missing"):
        load_gsm8k(tmp_path, split="test")
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "q?", "answer": "42"}) + "\n")
    with pytest.raises(ValueError, match="no '#### <answer>' marker"):
        load_gsm8k(tmp_path, split="test")
    with pytest.raises(ValueError, match="split='validation': GSM8K has 'train' and 'test'"):
        load_gsm8k(tmp_path, split="validation")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_gsm8k(tmp_path / "missing" / "deeper", split="test")


def test_hub_ids_go_through_datasets_load_dataset(monkeypatch):
    """A hub id is routed to datasets.load_dataset with the right config; no network in this test."""
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return read_rows(FIXTURES / "gsm8k" / "test.jsonl")

    import datasets
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    prompts = load_gsm8k("openai/gsm8k", split="test")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert [p.reference for p in prompts] == GSM8K_REFS

    def offline(*a, **k):
        raise ConnectionError("hub unreachable")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="could not load 'HuggingFaceH4/MATH-500'.*local file"):
        benchmarks.load_math500("HuggingFaceH4/MATH-500")


# ----------------------------------------------------------------------------- evaluation

def even(task_id: str) -> bool:
    """Whether the number in a task id's last field is even (``add30/eval/0/6``, ``.../807.json``)."""
    return int(re.search(r"\d+", task_id.rsplit("/", 1)[1]).group()) % 2 == 0


class ScriptedReplier:
    """Answers a prompt correctly iff ``even(task_id)``: a known answer key for checking the
    evaluation's bookkeeping (not a model: nothing here is learned or sampled)."""

    def __init__(self):
        self.calls = []

    def generate_greedy(self, prompts, max_new_tokens):
        self.calls.append((len(prompts), max_new_tokens))
        return [f"\\boxed{{{p.reference}}}" if even(p.task_id) else f"\\boxed{{{p.reference}1}}" for p in prompts]


def test_evaluate_counts_greedy_pass_at_1_per_set():
    from ftis_fed.learn.evaluation import evaluate, heldout_sets

    sets = heldout_sets("all", 10, seed=0, gsm8k=str(FIXTURES / "gsm8k"), math500=str(FIXTURES / "math500"))
    assert set(sets) == {"id", *OOD_FAMILIES, "gsm8k", "math500"}
    assert len(sets["gsm8k"]) == 5 and len(sets["math500"]) == 5
    replier = ScriptedReplier()
    out = evaluate(replier, sets, max_new_tokens=17, batch_size=4)
    expect = {name: sum(even(p.task_id) for p in ps) / len(ps) for name, ps in sets.items()}
    assert 0 < expect["id"] < 1
    assert out["eval/id/accuracy"] == expect["id"]
    for f in OOD_FAMILIES:
        assert out[f"eval/ood/{f}/accuracy"] == expect[f] and out[f"eval/ood/{f}/n"] == 10
    assert out["eval/ood/accuracy"] == pytest.approx(sum(expect[f] for f in OOD_FAMILIES) / len(OOD_FAMILIES))
    assert out["eval/gsm8k/accuracy"] == 3 / 5                      # rows 0, 2, 4
    assert out["eval/math500/accuracy"] == 3 / 5                    # 2584, 572, 1000
    assert out["eval/math500/n"] == 5
    assert all(n <= 4 and m == 17 for n, m in replier.calls)        # batched, budget passed through
    assert set(heldout_sets("id", 3)) == {"id"} and set(heldout_sets("ood", 3)) == set(OOD_FAMILIES)
    with pytest.raises(ValueError, match="split='test': must be 'id', 'ood' or 'all'"):
        heldout_sets("test", 3)


def test_text_generator_greedy_is_deterministic_and_batch_independent():
    """A real (random-init) model end to end: left padding must not change greedy replies."""
    from ftis_fed.learn.evaluation import TextGenerator, evaluate

    gen = TextGenerator("tiny-llama", batch_size=4)
    prompts = eval_sets(4, seed=0, ood_families=())["id"] + make_tasks("word_add", "eval", 2)
    batched = gen.generate_greedy(prompts, max_new_tokens=5)
    gen.batch_size = 1
    assert gen.generate_greedy(prompts, max_new_tokens=5) == batched
    sampled = gen.generate_texts([p.text for p in prompts], 5, temperature=0.7, seed=1)
    assert sampled == gen.generate_texts([p.text for p in prompts], 5, temperature=0.7, seed=1)
    out = evaluate(gen, {"id": prompts[:4]}, max_new_tokens=5)
    assert 0.0 <= out["eval/id/accuracy"] <= 1.0 and out["eval/id/n"] == 4


@pytest.mark.slow
def test_smollm2_greedy_accuracy_matches_calibration():
    """SmolLM2-135M-Instruct on the ID held-out set stays in the calibrated band (docs/tasks.md)."""
    from ftis_fed.learn.evaluation import run_eval_cli

    out = run_eval_cli("smollm2", "id", 64, print_json=False)
    assert 0.05 <= out["eval/id/accuracy"] <= 0.6
