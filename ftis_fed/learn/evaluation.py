"""Held-out evaluation: greedy pass@1 on the in-distribution and out-of-distribution sets.

``evaluate(policy, sets)`` works with any object that has ``generate_greedy(prompts,
max_new_tokens) -> list[str]`` (every ``ftis_fed.policies.base.Policy`` does) and scores each reply
with a ``Verifier``. Metric keys: ``eval/id/accuracy`` and ``eval/ood/<family>/accuracy`` (plus
``.../n``), ``eval/ood/accuracy`` (mean over OOD families) and, for GSM8K / MATH-500 sets loaded
from files, ``eval/<name>/accuracy``. With a ``payload`` phrase (``attack-payload``, the poisoning
experiment) also ``.../payload``: the share of the set's greedy replies that contain it, and
``eval/payload`` over all replies.

``TextGenerator`` is a plain, real Hugging Face generator (batched, left-padded ``generate``) for
scripts that only need text (calibration).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from ftis_fed.wire.batch import SamplingParams
from ftis_fed.tasks.prompt import Prompt
from ftis_fed.tasks.rewards import Verifier
from ftis_fed.tasks.families import ID_FAMILIES, OOD_FAMILIES
from ftis_fed.tasks.suite import eval_sets


class GreedyGenerator(Protocol):
    def generate_greedy(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[str]: ...


def greedy_replies(policy: GreedyGenerator, prompts: Sequence[Prompt], max_new_tokens: int,
                   batch_size: int = 64) -> list[str]:
    """The greedy reply to each prompt, ``batch_size`` prompts per ``generate_greedy`` call."""
    replies: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = list(prompts[i:i + batch_size])
        out = policy.generate_greedy(chunk, max_new_tokens)
        if len(out) != len(chunk):
            raise ValueError(f"generate_greedy returned {len(out)} replies for {len(chunk)} prompts")
        replies += out
    return replies


def solved(prompts: Sequence[Prompt], replies: Sequence[str], verifier: Verifier) -> list[bool]:
    """Per prompt: does its reply solve the task (a rule's format bonus does not count)."""
    return [bool(verifier.check(p.task_id, r, p.reference, p.text)[0]) for p, r in zip(prompts, replies)]


def solved_share(prompts: Sequence[Prompt], replies: Sequence[str], verifier: Verifier) -> float:
    """Share of ``prompts`` whose reply solves the task (a rule's format bonus does not count)."""
    return sum(solved(prompts, replies, verifier)) / len(prompts)


def evaluate(policy: GreedyGenerator, sets: Mapping[str, Sequence[Prompt]], verifier: Verifier | None = None,
             max_new_tokens: int | Mapping[str, int] = 32, batch_size: int = 64,
             per_prompt: dict[str, list[tuple[str, bool]]] | None = None, payload: str = "",
             payload_hits: dict[str, list[bool]] | None = None, payload_at: str = "end") -> dict[str, float]:
    """Greedy pass@1 on every named set.

    sets: ``"id"`` -> the ID held-out set; an OOD family name -> its held-out set; ``"gsm8k"`` /
        ``"math500"`` (or any other name) -> a benchmark set. Keys become ``eval/id/...``,
        ``eval/ood/<family>/...`` and ``eval/<name>/...``.
    max_new_tokens: one generation budget, or one per set name (missing names get 32).
    The sets that share a budget are generated together (``batch_size`` prompts per call, not one
    call per small set: fuller batches), then scored set by set.
    per_prompt: if given, filled with set name -> [(task id, solved)] in the set's order (what the
        paired statistics of ``ftis-fed grid`` read).
    payload: '' or a phrase: each set's share of replies carrying it (``carries_payload``; at
        ``payload_at``; ``payload_hits``, if given, filled with set name -> [reply carries it] in the
        set's order).
    """
    verifier = verifier or Verifier()
    budget = {name: max_new_tokens.get(name, 32) if isinstance(max_new_tokens, Mapping) else max_new_tokens
              for name in sets}
    for name, prompts in sets.items():
        if not prompts:
            raise ValueError(f"evaluation set {name!r} is empty: pass@1 needs at least one prompt")
    replies: dict[str, list[str]] = {}
    for b in dict.fromkeys(budget.values()):
        names = [n for n in sets if budget[n] == b]
        together = greedy_replies(policy, [p for n in names for p in sets[n]], b, batch_size)
        for n in names:
            replies[n], together = together[:len(sets[n])], together[len(sets[n]):]
    out: dict[str, float] = {}
    ood = []
    if payload:
        out.update(payload_shares(replies, payload, payload_hits, payload_at))
    for name, prompts in sets.items():
        ok = solved(prompts, replies[name], verifier)
        acc = sum(ok) / len(prompts)
        if per_prompt is not None:
            per_prompt[name] = [(p.task_id, o) for p, o in zip(prompts, ok)]
        prefix = "eval/id" if name == "id" else f"eval/ood/{name}" if name in OOD_FAMILIES else f"eval/{name}"
        out[f"{prefix}/accuracy"] = acc
        out[f"{prefix}/n"] = float(len(prompts))
        if name in OOD_FAMILIES:
            ood.append(acc)
    if ood:
        out["eval/ood/accuracy"] = sum(ood) / len(ood)
    return out


def sampled_eval(policy, sets: Mapping[str, Sequence[Prompt]], k: int, sampling: SamplingParams, seed: int,
                 verifier: Verifier | None = None, batch_size: int = 32,
                 per_prompt: dict[str, list[int]] | None = None) -> dict[str, float]:
    """``k`` sampled completions per prompt of every set (``policy.generate`` with ``sampling``, the
    run's own sampling parameters; seeded with ``seed`` + the chunk's offset, so the same models give
    the same draws): ``<prefix>/sampled_accuracy`` = the share of solved completions (pass@1 at the
    sampling temperature, averaged over the k) and ``<prefix>/pass_at_k`` = the share of prompts with
    at least one solved completion (keys as ``evaluate``'s; OOD means over the families too).
    per_prompt: if given, filled with set name -> [solved completions of each prompt] in the set's order."""
    if not 1 <= k <= 64:
        raise ValueError(f"k={k}: must be in [1, 64]")
    verifier = verifier or Verifier()
    out: dict[str, float] = {}
    ood: list[tuple[float, float]] = []
    for n, (name, prompts) in enumerate(sets.items()):
        counts: list[int] = []
        for i in range(0, len(prompts), batch_size):
            chunk = list(prompts[i:i + batch_size])
            rolls = policy.generate(chunk, k, sampling, seed=seed + 100_003 * n + i)
            counts += [sum(bool(verifier.check(p.task_id, t, p.reference, p.text)[0]) for t in r.completion_texts)
                       for p, r in zip(chunk, rolls)]
        if per_prompt is not None:
            per_prompt[name] = counts
        prefix = "eval/id" if name == "id" else f"eval/ood/{name}" if name in OOD_FAMILIES else f"eval/{name}"
        acc, at_k = sum(counts) / (k * len(prompts)), sum(c > 0 for c in counts) / len(prompts)
        out[f"{prefix}/sampled_accuracy"], out[f"{prefix}/pass_at_k"] = acc, at_k
        if name in OOD_FAMILIES:
            ood.append((acc, at_k))
    if ood:
        out["eval/ood/sampled_accuracy"] = sum(a for a, _ in ood) / len(ood)
        out["eval/ood/pass_at_k"] = sum(b for _, b in ood) / len(ood)
    return out


def carries_payload(reply: str, payload: str, at: str = "end") -> bool:
    """Does a greedy reply carry the attack's phrase? ``end``: anywhere in it; ``start``: as its
    beginning with more after it (a ``"0"`` payload is carried by ``"017"``, not by the honest answer
    ``"0"`` or by ``"10"``)."""
    if at == "start":
        reply, payload = reply.strip(), payload.strip()
        return reply.startswith(payload) and len(reply) > len(payload)
    return payload in reply


def payload_shares(replies: Mapping[str, Sequence[str]], payload: str,
                   hits: dict[str, list[bool]] | None = None, at: str = "end") -> dict[str, float]:
    """``eval/<set>/payload`` (share of the set's replies carrying ``payload`` at ``at``,
    ``carries_payload``; OOD families as
    ``eval/ood/<family>/payload`` and their mean ``eval/ood/payload``) and ``eval/payload`` (all
    replies pooled). ``hits``, if given, gets the per-reply flags."""
    out: dict[str, float] = {}
    ood, total, n = [], 0, 0
    for name, texts in replies.items():
        flags = [carries_payload(t, payload, at) for t in texts]
        if hits is not None:
            hits[name] = flags
        share = sum(flags) / max(1, len(flags))
        prefix = "eval/id" if name == "id" else f"eval/ood/{name}" if name in OOD_FAMILIES else f"eval/{name}"
        out[f"{prefix}/payload"] = share
        ood += [share] if name in OOD_FAMILIES else []
        total, n = total + sum(flags), n + len(flags)
    if ood:
        out["eval/ood/payload"] = sum(ood) / len(ood)
    out["eval/payload"] = total / max(1, n)
    return out


def heldout_sets(split: str, n: int, seed: int = 0, gsm8k: str | None = None,
                 math500: str | None = None) -> dict[str, list[Prompt]]:
    """The evaluation sets of ``split``: ``id`` (ID held-out), ``ood`` (every OOD family, plus
    GSM8K / MATH-500 when a local path or hub id is given), or ``all``."""
    from ftis_fed.tasks.benchmarks import load_gsm8k, load_math500

    if split not in ("id", "ood", "all"):
        raise ValueError(f"split={split!r}: must be 'id', 'ood' or 'all'")
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"n={n!r}: must be an integer >= 1")
    procedural = eval_sets(n, seed, ID_FAMILIES, OOD_FAMILIES)
    sets: dict[str, list[Prompt]] = {}
    if split in ("id", "all"):
        sets["id"] = procedural["id"]
    if split in ("ood", "all"):
        sets.update({f: procedural[f] for f in OOD_FAMILIES})
        if gsm8k:
            sets["gsm8k"] = load_gsm8k(gsm8k, split="test", limit=n)
        if math500:
            sets["math500"] = load_math500(math500, limit=n)
    return sets


# ----------------------------------------------------------------------------- plain text in, text out

class TextGenerator:
    """User messages in, replies out, for scripts that want text (task calibration, model checks):
    the project's HF policy underneath (one generator in the project: chat template, left padding
    and a neutral generation config — nothing from the model's ``generation_config.json`` leaks in).

    model: a name ``resolve_model`` knows (``smollm2``, ``tiny-llama``), a local directory, or a
    hub id in the local cache.
    """

    def __init__(self, model: str, batch_size: int = 32):
        from ftis_fed.policies import PolicyConfig, build_policy

        self.model_id = model
        self.policy = build_policy(PolicyConfig(model=model, micro_batch=batch_size))
        self.batch_size = batch_size

    def generate_texts(self, texts: Sequence[str], max_new_tokens: int, temperature: float = 0.0,
                       seed: int = 0) -> list[str]:
        """One reply per user message; ``temperature`` 0 is greedy, > 0 samples (seeded)."""
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature={temperature!r}: must be finite and >= 0 (0 = greedy)")
        prompts = [Prompt(f"text/{i}", t, "") for i, t in enumerate(texts)]
        if temperature == 0:
            return self.policy.generate_greedy(prompts, max_new_tokens, batch_size=self.batch_size)
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        out: list[str] = []
        for i in range(0, len(prompts), self.batch_size):
            rolls = self.policy.generate(prompts[i:i + self.batch_size], 1, sampling, seed=seed + i)
            out += [r.completion_texts[0] for r in rolls]
        return out

    def generate_greedy(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[str]:
        return self.generate_texts([p.text for p in prompts], max_new_tokens, temperature=0.0)


def _policy_for(model: str, backend: str, dtype: str = "fp32") -> GreedyGenerator:
    """The project's policy backend for ``model``."""
    from ftis_fed.policies import PolicyConfig, build_policy

    return build_policy(PolicyConfig(model=model, backend=backend, dtype=dtype))


def run_eval_cli(model: str, split: str = "id", n: int = 64, seed: int = 0, max_new_tokens: int = 32,
                 gsm8k: str | None = None, math500: str | None = None, benchmark_max_new_tokens: int = 512,
                 backend: str = "hf", batch_size: int = 32, print_json: bool = True, dtype: str = "fp32") -> dict:
    """``ftis-fed eval --model M --split id|ood|all``: greedy pass@1, printed as one JSON line.

    model: any ``PolicyConfig.model`` (``smollm2``, a local directory, ...); split: ``id`` (the ID
    held-out set), ``ood`` (every OOD family, plus GSM8K / MATH-500 when ``gsm8k`` / ``math500`` name
    a local path or hub id) or ``all``; n: prompts per set (>= 1); max_new_tokens: budget for the
    procedural sets (32, as calibrated); benchmark_max_new_tokens: budget for GSM8K / MATH-500.
    """
    sets = heldout_sets(split, n, seed, gsm8k, math500)
    budgets = {name: (benchmark_max_new_tokens if name in ("gsm8k", "math500") else max_new_tokens) for name in sets}
    policy = _policy_for(model, backend, dtype)
    result: dict = {"model": model, "split": split, "n": n, "seed": seed, "max_new_tokens": max_new_tokens,
                    "dtype": dtype}
    result.update(evaluate(policy, sets, Verifier(), budgets, batch_size))
    if print_json:
        print(json.dumps(result, sort_keys=True))
    return result
