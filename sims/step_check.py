"""How often a model's rewarded worked replies reach the right answer through the right steps.

The learning tier's reward reads only the final ``so N`` of a worked reply (``47 + 38`` ->
``7+8=15; 4+3+1=8; so 85``), so a reply whose steps are wrong but whose last number is right earns
the full reward. This check samples ``--k`` replies to ``--n`` train-split prompts per family from
each model (temperature 0.7, the runs' sampling), and counts per model and family: the rewarded
replies, those equal to the family's worked solution (``tasks.suite.worked_reply``: the steps the
warm-up taught), and those whose every step is arithmetically true. One JSON line each:

    python -m sims.step_check --models micro-llama-w250 micro-llama-w-sub --families sub99,add99 \
        > docs/results/research-w-spec/step_check.jsonl
"""

from __future__ import annotations

import argparse
import json
import re

import torch

STEP = re.compile(r"(\d+)([-+])(\d+)(?:([-+])(\d+))?=(-?\d+)")


def steps_true(reply: str) -> bool:
    """Every ``a±b(±c)=d`` step of ``reply`` is arithmetically true, and it has at least two."""
    steps = [STEP.fullmatch(part.replace(" ", "")) for part in reply.split(";")]
    steps = [m for m in steps if m]
    for a, op, b, op2, c, d in (m.groups() for m in steps):
        v = int(a) - int(b) if op == "-" else int(a) + int(b)
        if op2:
            v = v - int(c) if op2 == "-" else v + int(c)
        if v != int(d):
            return False
    return len(steps) >= 2


def check(model: str, family: str, n: int, k: int, seed: int, max_new_tokens: int = 40) -> dict:
    from ftis_fed.tasks.rewards import Verifier
    from ftis_fed.tasks.suite import task_at, worked_reply
    from sims.kl_probe import _load

    lm, tok = _load(model)
    verifier = Verifier()
    torch.manual_seed(seed)
    c = {"replies": 0, "rewarded": 0, "rewarded_worked": 0, "rewarded_steps_true": 0, "worked": 0}
    for i in range(n):
        task = task_at(family, "train", seed, i)
        text = tok.apply_chat_template([{"role": "user", "content": task.text}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
        with torch.no_grad():
            out = lm.generate(prompt[None].repeat(k, 1), do_sample=True, temperature=0.7, top_p=1.0, top_k=0,
                              max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id)
        worked = worked_reply(family, "train", seed, i)
        for o in out:
            reply = tok.decode(o[len(prompt):], skip_special_tokens=True).strip()
            r = verifier.reward(task.task_id, reply, task.reference) > 0
            c["replies"] += 1
            c["worked"] += reply == worked
            c["rewarded"] += r
            c["rewarded_worked"] += r and reply == worked
            c["rewarded_steps_true"] += r and steps_true(reply)
    share = (lambda x: round(x / c["rewarded"], 3)) if c["rewarded"] else (lambda x: None)
    return {"model": model, "family": family, "prompts": n, "k": k, "seed": seed, **c,
            "rewarded_share": round(c["rewarded"] / c["replies"], 3),
            "of_rewarded_worked": share(c["rewarded_worked"]), "of_rewarded_steps_true": share(c["rewarded_steps_true"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--families", default="sub99,add99")
    ap.add_argument("--n", type=int, default=60, help="train-split prompts per family")
    ap.add_argument("--k", type=int, default=4, help="replies per prompt")
    ap.add_argument("--seed", type=int, default=11)
    a = ap.parse_args(argv)
    if a.n < 1 or a.k < 1:
        ap.error(f"--n={a.n} and --k={a.k} must be >= 1")
    torch.set_num_threads(1)
    for family in a.families.split(","):
        for model in a.models:
            print(json.dumps(check(model, family, a.n, a.k, a.seed)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
