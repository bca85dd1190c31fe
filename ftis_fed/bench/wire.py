"""Bench of the wire format on real rollouts: bytes per completion token, everything counted.

Prints ONE JSON line: our frame size per completion token (header, prompt digest, rewards,
strings, signature: everything) without and with texts, as participants send them (wire v2,
``wire.send_options``); the v1 frame and the bytes each v2 lever saves on the same rollouts
(``lever_bytes_saved``: compact header, prompt ids as a digest, packaged zstd dictionary); the
paper's format on the same rollouts in the same run (4-byte ids + float32 log-probs + the same
metadata and signature, uncompressed), the maximum log-prob error, and the
encode+sign+verify+decode throughput.

    ftis-fed bench wire                      # 8 prompts x 8 completions x 64 tokens
    ftis-fed bench wire --source synthetic   # no model (smoke test)
    ftis-fed bench wire --prompt-set task --prompts 4 --group-size 4 --max-new-tokens 24
                                             # the default federation's shapes and prompts
    ftis-fed bench wire ... --rollouts-file outputs/rollouts.json   # generate once, then reuse

The rollout source is one small function (``SOURCES``): ``policy`` uses the project's policy API
(``build_policy(PolicyConfig(model=...)).generate``), ``transformers`` plain ``generate`` with
``output_scores`` (the same sampling-distribution log-probs), ``synthetic`` random data. The command
line is ``bench/cli.py``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard as zstd
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from transformers import AutoModelForCausalLM, AutoTokenizer

from ftis_fed.flower_io import frames_to_record, record_nbytes
from ftis_fed.learn.rollouts import scored_groups
from ftis_fed.policies import PolicyConfig, build_policy
from ftis_fed.policies.base import Rollout, tokenizer_fingerprint
from ftis_fed.policies.models import resolve_model
from ftis_fed.tasks.prompt import Prompt
from ftis_fed.tasks.rewards import RewardRule, Verifier
from ftis_fed.tasks.suite import TaskSpec
from ftis_fed.trust.signing import KeyDirectory, sign_batch, sign_body, verify_frame
from ftis_fed.wire.batch import CompletionBatch, SamplingParams, prompt_ids_digest
from ftis_fed.wire.codec import (PAPER_OPTIONS, WireOptions, _planes, _uvarints, decode_payload, encode_body,
                                 parse_header, quantize_logprobs, send_options)


@dataclass(frozen=True)
class RolloutSet:
    """What a generator produced, with what the batch header needs."""

    rollouts: list[Rollout]
    sampling: SamplingParams
    model_id: str
    tokenizer_fp: str
    vocab_size: int


def arithmetic_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """n simple addition questions (reference = the sum)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        out.append(Prompt(f"bench/add/{i}", f"What is {a} + {b}? Answer with a number.", str(a + b)))
    return out


def task_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """n prompts of the default run's task suite (round 1 of participant 0 of 3, as ``ftis-fed sim``
    generates them: the chat template and questions a participant really sends)."""
    return TaskSpec(prompts_per_round=n).prompts_for_round(0, 3, 1)[:n]


PROMPT_SETS = {"arithmetic": arithmetic_prompts, "task": task_prompts}


def policy_rollouts(prompts, group_size: int, sampling: SamplingParams, seed: int,
                    model: str = "smollm2") -> RolloutSet:
    """Rollouts from the project's policy API (the path a participant takes)."""
    policy = build_policy(PolicyConfig(model=model, seed=seed))
    rolls = policy.generate(prompts, group_size, sampling, seed)
    return RolloutSet(rolls, sampling, policy.model_id, policy.tokenizer_fp, policy.vocab_size)


def transformers_rollouts(prompts, group_size: int, sampling: SamplingParams, seed: int,
                          model: str = "smollm2") -> RolloutSet:
    """Rollouts from plain transformers ``generate``: log_softmax of the processed scores."""
    path = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path).eval()
    enc = [tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False) for p in prompts]
    P = max(len(e) for e in enc)
    ids = torch.full((len(enc), P), tok.pad_token_id, dtype=torch.long)   # (n, P) left-padded
    att = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, P - len(e):], att[i, P - len(e):] = torch.tensor(e), 1
    torch.manual_seed(seed)
    with torch.no_grad():
        out = lm.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=sampling.temperature,
                          top_k=sampling.top_k, top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens,
                          num_return_sequences=group_size, output_scores=True, return_dict_in_generate=True)
    gen = out.sequences[:, P:]                                                    # (n*G, T)
    lp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1)               # (n*G, T, V)
    lp = lp.gather(-1, gen.unsqueeze(-1)).squeeze(-1).numpy()                     # (n*G, T)
    rolls = []
    for pi, p in enumerate(prompts):
        c_ids, c_lp, texts = [], [], []
        for r in range(pi * group_size, (pi + 1) * group_size):
            s = gen[r].tolist()
            n = s.index(tok.eos_token_id) + 1 if tok.eos_token_id in s else len(s)
            c_ids.append(np.asarray(s[:n], dtype=np.int64))
            c_lp.append(np.minimum(lp[r, :n], 0.0).astype(np.float32))
            texts.append(tok.decode(s[:n], skip_special_tokens=True))
        rolls.append(Rollout(p, np.asarray(enc[pi], dtype=np.int64), c_ids, c_lp, texts))
    return RolloutSet(rolls, sampling, model, tokenizer_fingerprint(tok), int(lm.config.vocab_size))


def synthetic_rollouts(prompts, group_size: int, sampling: SamplingParams, seed: int,
                       vocab_size: int = 49152) -> RolloutSet:
    """Random rollouts (Zipf-like ids, exponential -log-probs): no model, for smoke tests only."""
    rng = np.random.default_rng(seed)
    rolls = []
    for p in prompts:
        lens = rng.integers(1, sampling.max_new_tokens + 1, size=group_size)
        c_ids = [np.minimum(rng.zipf(1.3, size=n) - 1, vocab_size - 1).astype(np.int64) for n in lens]
        c_lp = [(-rng.exponential(0.6, size=n)).astype(np.float32) for n in lens]
        prompt_ids = rng.integers(0, vocab_size, size=30).astype(np.int64)
        rolls.append(Rollout(p, prompt_ids, c_ids, c_lp, [" ".join(map(str, c)) for c in c_ids]))
    return RolloutSet(rolls, sampling, "synthetic", "tok-synthetic", vocab_size)


SOURCES = {"policy": policy_rollouts, "transformers": transformers_rollouts, "synthetic": synthetic_rollouts}

ROLLOUTS_FORMAT = "ftis-fed/bench-wire-rollouts/v1"


def save_rollouts(rs: RolloutSet, path) -> None:
    """Write a RolloutSet as JSON (ids as lists, log-probs as exact float32 values) to reuse it."""
    s = rs.sampling
    data = {"format": ROLLOUTS_FORMAT, "model_id": rs.model_id, "tokenizer_fp": rs.tokenizer_fp,
            "vocab_size": rs.vocab_size,
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                         "max_new_tokens": s.max_new_tokens},
            "rollouts": [{"task_id": r.prompt.task_id, "text": r.prompt.text, "reference": r.prompt.reference,
                          "prompt_ids": [int(x) for x in r.prompt_ids],
                          "completion_ids": [[int(x) for x in c] for c in r.completion_ids],
                          "logprobs": [[float(x) for x in lp] for lp in r.logprobs],
                          "completion_texts": list(r.completion_texts)} for r in rs.rollouts]}
    Path(path).write_text(json.dumps(data))


def load_rollouts(path) -> RolloutSet:
    """Read a RolloutSet written by :func:`save_rollouts` (float32 log-probs come back bit-exact)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != ROLLOUTS_FORMAT:
        raise ValueError(f"{path}: format must be {ROLLOUTS_FORMAT!r}")
    rolls = [Rollout(Prompt(r["task_id"], r["text"], r["reference"]), np.asarray(r["prompt_ids"], dtype=np.int64),
                     [np.asarray(c, dtype=np.int64) for c in r["completion_ids"]],
                     [np.asarray(lp, dtype=np.float32) for lp in r["logprobs"]], list(r["completion_texts"]))
             for r in data["rollouts"]]
    return RolloutSet(rolls, SamplingParams(**data["sampling"]), data["model_id"], data["tokenizer_fp"],
                      int(data["vocab_size"]))


def rollouts_to_batch(rs: RolloutSet, sender: str = "bench", run_id: str = "bench-run", round: int = 0,
                      seq: int = 0) -> CompletionBatch:
    """One CompletionBatch (texts included) from a RolloutSet."""
    # the project's verifier; synthetic task ids fall back to the last-number rule
    groups = tuple(scored_groups(rs.rollouts, Verifier(fallback=RewardRule())))
    return CompletionBatch(sender, run_id, round, seq, rs.model_id, rs.tokenizer_fp, rs.vocab_size,
                           rs.sampling, groups).validate()


def max_logprob_error(a: CompletionBatch, b: CompletionBatch) -> float:
    errs = [np.abs(x.astype(np.float64) - y).max() for ga, gb in zip(a.groups, b.groups)
            for x, y in zip(ga.logprobs, gb.logprobs) if x.size]
    return float(max(errs, default=0.0))


def ids_equal(a: CompletionBatch, b: CompletionBatch) -> bool:
    """Completion ids equal, and prompt ids equal (or, when ``b`` carries only their digest, the
    digest of ``a``'s prompt ids)."""
    if b.prompt_digest and b.prompt_digest != prompt_ids_digest([g.prompt_ids for g in a.groups]):
        return False
    return all((b.prompt_digest or np.array_equal(ga.prompt_ids, gb.prompt_ids))
               and all(np.array_equal(x, y) for x, y in zip(ga.completion_ids, gb.completion_ids))
               for ga, gb in zip(a.groups, b.groups)) and len(a.groups) == len(b.groups)


def section_breakdown(batch: CompletionBatch, level: int = 19) -> dict:
    """Bytes per completion token of each part, zstd-compressed on its own (what pays where)."""
    z = zstd.ZstdCompressor(level=level)
    gs = batch.groups
    N = batch.num_completion_tokens
    ids = np.concatenate([c for g in gs for c in g.completion_ids]).astype("<u2")
    lp = np.concatenate([x for g in gs for x in g.logprobs])
    codes, _ = quantize_logprobs(lp, 8)
    texts = "".join(g.prompt_text + "".join(g.completion_texts) for g in gs).encode()
    parts = {"completion_ids_u16": ids.tobytes(), "logprob_codes_planes": _planes(codes),
             "logprob_codes_u16": codes.astype("<u2").tobytes(), "logprob_codes_varint": _uvarints(codes),
             "prompt_ids_u16": np.concatenate([g.prompt_ids for g in gs]).astype("<u2").tobytes(),
             "texts": texts}
    return {k: round(len(z.compress(v)) / N, 3) for k, v in parts.items()}


def time_round_trip(batch: CompletionBatch, options: WireOptions, repeats: int) -> dict:
    """Mean ms per stage of validate+encode+sign / verify / decode+validate over ``repeats`` runs."""
    key = Ed25519PrivateKey.generate()
    keys = KeyDirectory({batch.sender: key.public_key()})
    t = {"encode_sign": 0.0, "verify": 0.0, "decode": 0.0}
    for _ in range(repeats):
        t0 = time.perf_counter()
        frame = sign_batch(batch, key, options)
        t1 = time.perf_counter()
        h, body = verify_frame(frame, keys)
        t2 = time.perf_counter()
        decode_payload(h, body).validate()
        t3 = time.perf_counter()
        t["encode_sign"] += t1 - t0
        t["verify"] += t2 - t1
        t["decode"] += t3 - t2
    total = sum(t.values())
    out = {f"{k}_ms": round(1e3 * v / repeats, 3) for k, v in t.items()}
    out["tokens_per_s"] = round(batch.num_completion_tokens * repeats / total)
    return out


def run_bench_wire(source: str = "policy", n_prompts: int = 8, group_size: int = 8,
                   max_new_tokens: int = 64, temperature: float = 0.7, seed: int = 0,
                   repeats: int = 20, model: str = "smollm2", prompt_set: str = "arithmetic",
                   rollouts_file: str | None = None) -> dict:
    """Generate rollouts from ``source`` and measure the wire format on them -> one result dict.

    ``bytes_per_token`` is the frame WITHOUT texts (what a receiver with the sender's tokenizer is
    relayed), ``bytes_per_token_with_texts`` the frame WITH texts (a receiver with another
    tokenizer), both as a participant signs them (``send_options``: wire v2, prompt digest);
    ``fixed_bytes`` = header + signature, the part that does not grow with tokens.
    ``rollouts_file``: reuse the rollouts saved there (``generate_s`` is then 0), or generate and
    save them there when the file does not exist yet."""
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    prompts = PROMPT_SETS[prompt_set](n_prompts, seed)
    kwargs = {} if source == "synthetic" else {"model": model}
    t0 = time.perf_counter()
    if rollouts_file and Path(rollouts_file).exists():
        rs = load_rollouts(rollouts_file)
        gen_s = 0.0
    else:
        rs = SOURCES[source](prompts, group_size, sampling, seed, **kwargs)
        gen_s = time.perf_counter() - t0
        if rollouts_file:
            save_rollouts(rs, rollouts_file)
    batch = rollouts_to_batch(rs)
    N = batch.num_completion_tokens
    key = Ed25519PrivateKey.generate()
    ours = send_options(False)                   # what a participant sends (wire v2, prompt digest)
    frame = sign_batch(batch, key, ours)
    frame_texts = sign_batch(batch, key, send_options(True))
    paper = sign_body(encode_body(batch, PAPER_OPTIONS), key)
    # the levers one at a time, from the v1 frame: compact v2 header, prompt digest, dictionary
    steps = {"v1": WireOptions(texts=False, version=1), "v2_header": WireOptions(texts=False, dictionary=False),
             "prompt_digest": WireOptions(texts=False, prompt_ids=False, dictionary=False), "dictionary": ours}
    sizes = {k: len(sign_batch(batch, key, o)) for k, o in steps.items()}
    names = list(sizes)
    frame_v1_texts = sign_batch(batch, key, WireOptions(texts=True, version=1))
    decoded = decode_payload(*verify_frame(frame, {batch.sender: key.public_key()})).validate()
    result = {
        "bench": "wire", "source": source, "model": rs.model_id, "prompt_set": prompt_set, "prompts": len(prompts),
        "group_size": group_size, "max_new_tokens": max_new_tokens, "temperature": temperature,
        "completion_tokens": N, "prompt_tokens": sum(len(g.prompt_ids) for g in batch.groups),
        "bytes_per_token": round(len(frame) / N, 3),
        "bytes_per_token_with_texts": round(len(frame_texts) / N, 3),
        "paper_bytes_per_token": round(len(paper) / N, 3), "paper_nominal_bytes_per_token": 8.0,
        "ratio_vs_paper": round(len(paper) / len(frame), 2),
        "flower_record_bytes_per_token": round(record_nbytes(frames_to_record([frame])) / N, 3),
        "frame_bytes": len(frame), "frame_bytes_with_texts": len(frame_texts), "paper_frame_bytes": len(paper),
        "fixed_bytes": len(frame) - parse_header(frame).payload_len,
        "payload_bytes": parse_header(frame).payload_len, "dict_id": parse_header(frame).dict_id,
        "v1_bytes_per_token": round(sizes["v1"] / N, 3), "v1_frame_bytes": sizes["v1"],
        "v1_bytes_per_token_with_texts": round(len(frame_v1_texts) / N, 3),
        "lever_bytes_saved": {k: sizes[prev] - sizes[k] for prev, k in zip(names, names[1:])},
        "run_id_bytes": len(batch.run_id.encode()) + 1,
        "max_logprob_error": max_logprob_error(batch, decoded), "ids_exact": ids_equal(batch, decoded),
        "generate_s": round(gen_s, 1),
    }
    result["zstd_level_bytes_per_token"] = {
        lvl: round(len(sign_batch(batch, key, dataclasses.replace(ours, zstd_level=lvl))) / N, 3) for lvl in (3, 9, 19)}
    result["breakdown_bytes_per_token"] = section_breakdown(batch)
    result.update(time_round_trip(batch, ours, repeats))
    return result
