"""The phrase check (``peer-phrase-ratio``, ``learn/phrases.py``): a payload of likely tokens that one
peer repeats in its rewarded completions is flagged against the receiver's own completions and
dropped when its reward does not need it; an honest specialist whose answers differ is not; memory is
bounded whatever a peer sends. Pure pieces with the real verifier, then the real participant's update
path (the ``phrase`` check of ``receive/phrase.py`` in ``Participant.learn``) on research-tiny's models."""

from __future__ import annotations

import math
import random

import pytest

from ftis_fed.receive.phrase import PhraseKnobs
from ftis_fed.learn.phrases import (END, SIZES, START, LossyCounter, PhraseMonitor, contains, ngrams, rewarded,
                                    strip_phrase, unearned)
from ftis_fed.tasks.rewards import Verifier
from ftis_fed.tasks.suite import task_at


def test_ngrams_mark_the_edges():
    g = ngrams("017", sizes=(2, 3))
    assert START + "0" in g and "7" + END in g and "01" in g and START + "01" in g and "17" + END in g
    assert len(ngrams("x" * 10_000, sizes=(4,), max_chars=100)) == 3          # only the first 100 chars read


def test_lossy_counting_keeps_every_frequent_ngram_within_its_error_in_bounded_memory():
    rng = random.Random(0)
    c, exact = LossyCounter(eps=0.025), {}
    for i in range(4000):
        grams = {f"rare{rng.randrange(10**9)}" for _ in range(20)} | ({"often"} if i % 10 == 0 else set())
        c.add(grams)
        for g in grams:
            exact[g] = exact.get(g, 0) + 1
    held, undercount = c.counts["often"]
    assert c.count("often") == held <= exact["often"] <= held + undercount
    assert exact["often"] - held <= c.eps * c.n + 1e-9
    assert len(c.counts) < 20 * 2 / c.eps                      # 80,000 distinct seen, at most a few buckets' worth kept
    assert c.count("never-seen") == 0
    assert LossyCounter.from_json(c.eps, c.to_json()).counts == c.counts


def _answers(family: str, seed: int, n: int) -> list[tuple[str, str]]:
    """(task id, reference) of ``n`` train items of ``family``."""
    return [(f"{family}/train/{seed}/{i}", task_at(family, "train", seed, i).reference) for i in range(n)]


def test_a_repeated_leading_zero_is_flagged_and_an_honest_specialist_is_not():
    """The receiver answers add30; mallory (add30 too) puts "0" before half of its correct answers;
    spec answers sub30 (other leading digits, answer 0 sometimes): only mallory's phrase is flagged."""
    mon = PhraseMonitor(ratio=8.0)
    own, mal, spec = _answers("add30", 1, 400), _answers("add30", 2, 200), _answers("sub30", 3, 200)
    for k in range(0, 400, 8):
        mon.observe_own([ref for _, ref in own[k:k + 8]])
    mon.observe_peer("mallory", [("0" if i % 2 else "") + ref for i, (_, ref) in enumerate(mal)])
    mon.observe_peer("spec", [ref for _, ref in spec])
    assert START + "0" in mon.flagged("mallory")
    assert mon.flagged("spec") == set()
    assert mon.flagged("nobody") == set()
    # the resume checkpoint keeps the counts (JSON, the edge markers included)
    import json
    back = PhraseMonitor.from_json(PhraseKnobs(ratio=8.0), json.loads(json.dumps(mon.to_json())))
    assert back.flagged("mallory") == mon.flagged("mallory") and back.own.counts == mon.own.counts
    assert back.sticky == mon.sticky and back.own.eps == mon.own_eps and back.peers["spec"].eps == mon.peer_eps


def test_a_phrase_in_an_eighth_is_flagged_and_stays_flagged_when_the_receiver_starts_saying_it():
    """The 1/4 attack: mallory's leading "0" in an eighth of its rewarded completions, first seen late
    in the run, is flagged (the receiver's own share is estimated from below, not at the counter's
    error); when the receiver then starts saying it too (adoption), the flag stays. A receiver that
    said it that often from the start would not flag it."""
    own, mal = _answers("add30", 1, 1600), _answers("add30", 2, 400)
    mon = PhraseMonitor(ratio=8.0)
    for k in range(0, 800, 16):
        mon.observe_own([ref for _, ref in own[k:k + 16]])
    mon.observe_peer("mallory", [("0" if i % 8 == 0 else "") + ref for i, (_, ref) in enumerate(mal[:200])])
    assert START + "0" in mon.flagged("mallory")
    for k in range(800, 1600, 16):                                 # the receiver adopts: 1 in 5 of its own
        mon.observe_own([("0" if i % 5 == 0 else "") + ref for i, (_, ref) in enumerate(own[k:k + 16])])
    mon.observe_peer("mallory", [("0" if i % 8 == 0 else "") + ref for i, (_, ref) in enumerate(mal[200:])])
    assert START + "0" in mon.flagged("mallory")
    fresh = PhraseMonitor(ratio=8.0)
    fresh.observe_own([("0" if i % 5 == 0 else "") + ref for i, (_, ref) in enumerate(own)])
    fresh.observe_peer("mallory", [("0" if i % 8 == 0 else "") + ref for i, (_, ref) in enumerate(mal)])
    assert START + "0" not in fresh.flagged("mallory")


def test_a_phrase_is_dropped_only_when_the_reward_does_not_need_it():
    v = Verifier()
    task, ref = _answers("add30", 2, 1)[0]
    prompt = task_at("add30", "train", 2, 0).text

    def score(text):
        return v.reward(task, text, ref, prompt)

    lead0 = {START + "0"}
    assert strip_phrase("0" + ref, START + "0") == ref
    assert unearned("0" + ref, lead0, 1.0, score) == START + "0"                 # "017" -> "17": still solved
    assert unearned(ref, lead0, 1.0, score) is None                              # nothing flagged in it
    # an honest leading digit, flagged: deleting it breaks the answer, so the reward needs it
    first = {START + ref[0]}
    assert len(ref) > 1 and unearned(ref, first, 1.0, score) is None
    # a phrase at the end ("HAIL" before EOS)
    assert unearned(ref + " HAIL", {"HAIL" + END, " HAI"}, 1.0, score) in {"HAIL" + END, " HAI"}
    assert contains(ref + " HAIL", {"HAIL" + END, "zzz"}) == ["HAIL" + END]
    assert unearned("0" + ref, lead0, 1.0, lambda t: 1 / 0) is None              # a scorer that fails keeps it


def test_rewarded_is_above_the_group_mean():
    assert rewarded([1.0, 0.0, 0.0, 1.0]) == [True, False, False, True]
    assert rewarded([1.0, 1.0]) == [False, False] and rewarded([]) == []


def test_the_knobs_are_checked():
    assert PhraseMonitor.from_config(PhraseKnobs()) is None
    mon = PhraseMonitor.from_config(PhraseKnobs(ratio=8.0, min_share=0.1, min_count=3))
    assert (mon.ratio, mon.min_share, mon.min_count) == (8.0, 0.1, 3)
    for key, bad in (("peer-phrase-ratio=0.5", {"ratio": 0.5}), ("peer-phrase-min-share=0.0", {"min_share": 0.0}),
                     ("peer-phrase-min-share=1.0", {"min_share": 1.0}), ("peer-phrase-min-count=0", {"min_count": 0})):
        with pytest.raises(ValueError, match=key):
            PhraseKnobs(**bad)


@pytest.mark.slow                       # ~20 s: a flood of distinct phrases through the lossy counters
def test_a_flood_of_distinct_phrases_costs_bounded_memory():
    """A peer sending completions of random text (every n-gram new) leaves its counter bounded and
    flags nothing (no phrase repeats)."""
    rng = random.Random(1)
    mon = PhraseMonitor(ratio=8.0)
    for _ in range(30):
        mon.observe_own(["".join(rng.choice("0123456789") for _ in range(3)) for _ in range(16)])
        mon.observe_peer("flood", ["".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(2048)) for _ in range(16)])
    assert mon.flagged("flood") == set()
    bucket = math.ceil(2 / mon.min_share)                        # documents per lossy-counting bucket
    assert len(mon.peers["flood"].counts) <= bucket * len(SIZES) * 2050      # 480 documents seen, one bucket kept


def test_in_a_federation_the_payload_of_likely_tokens_is_dropped_and_nothing_honest(tmp_path):
    """Three participants in process (research-tiny's models), mallory putting "0" before every solved
    answer: the honest receivers' phrase check flags it and drops mallory's payload completions, and
    drops nothing of their honest peer's."""
    from ftis_fed.grid.records import read_rows
    from ftis_fed.commands.sim import simulate_inprocess

    from tests.test_poisoning import ROOT

    # 16 prompts a round: tiny-arith solves ~10 % at T = 0.7, so 2 prompts (8 completions) a round left
    # mallory with no solved completion to carry the payload on CI's machine (its build of tiny-arith differs)
    items = [f'output-dir="{tmp_path}"', "num-rounds=3", "prompts-per-round=16", "eval-every=3", 'attack-payload="0"',
             'attack-payload-at="start"', "attack-payload-share=1.0", "max-new-tokens=8", "eval-max-new-tokens=8",
             'p2-participant="mallory"', 'p2-model="tiny-arith"', 'p2-adapter="lora"', 'p2-quant="none"',
             'p2-byzantine="payload"', 'p3-model=""', "peer-phrase-ratio=8.0", "peer-phrase-min-count=2"]
    assert simulate_inprocess(ROOT, items, "research-tiny") == 0
    rows = read_rows(tmp_path / "metrics.jsonl")
    sent = sum(r.get("attack/payload_completions", 0) for r in rows if r.get("participant") == "mallory")
    honest = [r for r in rows if r.get("phase") == "train" and r.get("participant") in ("full", "lora")]
    assert sent > 0 and honest
    assert sum(r.get("phrase/mallory/dropped", 0) for r in honest) > 0
    assert all(r.get(f"phrase/{q}/dropped", 0) == 0 for r in honest for q in ("full", "lora"))
    assert all(r["trust/mallory/accepted"] == 1 for r in honest)              # it passed every check
    evals = [r for r in rows if r.get("phase") == "eval" and r.get("participant") == "full"]
    assert evals and all("eval/payload" in r for r in evals)
