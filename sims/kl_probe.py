"""How far one model's samples are from another model, before any training: the per-sample KL the F
filter would see (issue #27: choosing a pair on which g = 50 can act).

    python -m sims.kl_probe --sender micro-llama-w250 --receivers micro-llama-w micro-llama-w-sub \
        --families add99,sub99 --n 48

The sender completes ``--n`` train-split prompts (alternating the families; ``--seed`` picks them and
the sampling) at ``--temperature`` with the run's sampling rule (top-p 1, no top-k); each receiver that
shares the sender's tokenizer scores the same tokens. Per sample: KL = the sum over the completion's
tokens of log pi_sender(t) - log pi_receiver(t), both at the temperature, each token's term clamped
to +-20 (the objective's ``sum-k1`` estimate with its default ``log-ratio-clamp``, as a receiver's
filter computes it at the first update). One JSON line per receiver: the quantiles, the mean, the
largest, the share >= g, per family and over all (a receiver with another tokenizer is reported as
such: its KL would be a sequence-level one).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

CLAMP = 20.0


def _load(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftis_fed.policies.models import resolve_model

    path = resolve_model(name)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def completion_logprobs(model, ids: torch.Tensor, prompt_len: int, temperature: float) -> torch.Tensor:
    """(T,) log-probs at ``temperature`` of the tokens of ``ids`` after the first ``prompt_len``."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0][prompt_len - 1:]


def summarize(kl: list[float], g: float) -> dict:
    v = np.asarray(kl, dtype=float)
    return {"n": int(v.size), "p50": round(float(np.median(v)), 2), "p90": round(float(np.quantile(v, 0.9)), 2),
            "p99": round(float(np.quantile(v, 0.99)), 2), "mean": round(float(v.mean()), 2),
            "max": round(float(v.max()), 2), "ge_g": round(float((v >= g).mean()), 3)}


def probe(sender: str, receivers: list[str], families: list[str], n: int, seed: int, temperature: float,
          max_new_tokens: int, g: float) -> list[dict]:
    from ftis_fed.tasks.suite import task_at

    torch.manual_seed(seed)
    model, tok = _load(sender)
    others = {name: _load(name) for name in receivers}
    kls: dict[str, dict[str, list[float]]] = {r: {f: [] for f in families} for r in receivers}
    for i in range(n):
        family = families[i % len(families)]
        task = task_at(family, "train", seed, i)
        text = tok.apply_chat_template([{"role": "user", "content": task.text}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
        with torch.no_grad():
            out = model.generate(prompt[None], do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)[0]
        own = completion_logprobs(model, out, len(prompt), temperature)
        for name, (m, t) in others.items():
            if t.get_vocab() == tok.get_vocab():
                theirs = completion_logprobs(m, out, len(prompt), temperature)
                kls[name][family].append(float((own - theirs).clamp(-CLAMP, CLAMP).sum()))
    rows = []
    for name in receivers:
        every = [x for f in families for x in kls[name][f]]
        if not every:
            rows.append({"sender": sender, "receiver": name, "tokenizer": "different (sequence-level KL)"})
            continue
        rows.append({"sender": sender, "receiver": name, "families": ",".join(families), "seed": seed,
                     "temperature": temperature, "g": g, "all": summarize(every, g),
                     **{f: summarize(kls[name][f], g) for f in families}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sender", required=True, help="the model whose samples travel")
    ap.add_argument("--receivers", nargs="+", required=True, help="the models that score them")
    ap.add_argument("--families", default="add99,sub99")
    ap.add_argument("--n", type=int, default=48, help="samples (prompts, one completion each)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--g", type=float, default=50.0, help="the filter's threshold the share >= g is read at")
    a = ap.parse_args(argv)
    if a.n < 1 or a.temperature <= 0:
        ap.error(f"--n={a.n} must be >= 1 and --temperature={a.temperature} > 0")
    torch.set_num_threads(1)
    for row in probe(a.sender, a.receivers, a.families.split(","), a.n, a.seed, a.temperature, a.max_new_tokens, a.g):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
