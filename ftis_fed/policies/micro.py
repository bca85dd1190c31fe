"""The research tier's model family: small, competent, diverse models made offline from a config.

Every model here is built by project code on first use (no weights are downloaded), seeded end to
end and cached like the derived models (``resolve_model``): a tokenizer made with ``tokenizers``, a
random-initialised ``transformers`` causal LM, and a short supervised **warm-up** on the *train*
split of some task families (``tasks.suite.task_at(..., "train", ...)``; the held-out sets are never
seen) that brings it to a non-trivial, not perfect, greedy accuracy. Generation and a GRPO update
take milliseconds, so a research cell can run 50+ updates per participant on this CPU.

Names (``MICRO_MODELS``; measured sizes, accuracies and round times in docs/models.md, recomputed by
``ftis-fed bench micro --n 64 --round-time``):

=========================  ======  =========  ============  ===========  =================================
name                       arch    tokenizer  size          warm-up on   role
=========================  ======  =========  ============  ===========  =================================
``micro-llama-s``          Llama   BPE        0.33 M, 3 L   add30+sub30  small base
``micro-llama-s-add``      Llama   BPE        0.33 M, 3 L   add30        small addition specialist
``micro-llama-s-sub``      Llama   BPE        0.33 M, 3 L   sub30        small subtraction specialist
``micro-llama-l``          Llama   BPE        3.6 M, 5 L    add30+sub30  large base
``micro-qwen-m``           Qwen2   BPE        1.2 M, 4 L    add30+sub30  other architecture, same tokenizer
``micro-qwen-s-char``      Qwen2   char       0.33 M, 3 L   sub30        other tokenizer (sequence level)
``micro-llama-s-o``        Llama   BPE        0.33 M, 3 L   add30+sub30  base, OOD not at 0 (``pretrain``)
``micro-llama-s-sub-o``    Llama   BPE        0.33 M, 3 L   sub30        specialist, OOD not at 0
``micro-llama-w``          Llama   BPE        0.33 M, 3 L   add99+sub99  worked replies (learning tier)
``micro-llama-w-sub``      Llama   BPE        0.33 M, 3 L   sub99        worked subtraction specialist
``micro-llama-w250``       Llama   BPE        0.33 M, 3 L   add99+sub99  worked, 250 warm-up steps (RL learns)
``micro-llama-w-o``        Llama   BPE        0.33 M, 3 L   add99+sub99  worked base, OOD not at 0
``micro-llama-w-sub-o``    Llama   BPE        0.33 M, 3 L   sub99        worked specialist, OOD not at 0
``micro-qwen-w-sub-char``  Qwen2   char       0.33 M, 3 L   sub99        worked specialist, other tokenizer
``micro-llama-w-t``        Llama   BPE        0.11 M, 2 L   add99+sub99  worked, the size pair's small model
=========================  ======  =========  ============  ===========  =================================

The ``-w`` models (issue #27's learning tier, calibrated: docs/results/calibration/) answer
two-digit problems with their column steps (``worked``: "7+8=15; 4+3+1=8; so 85", ~22 tokens), from
problem spaces of 8,100 / 4,095 problems that RL cannot memorise (add30/sub30 have ~670 / ~350 train
problems, and a 100-round run at 16 prompts a round sees each ~2-5 times); 200 warm-up steps leave them
at 22-25 % greedy (500 steps: 100 %); ``micro-llama-w250`` (250 steps) starts at 56-67 % greedy but 29-31 %
pass@1 sampled at T = 0.7 and 84-91 % pass@8, the start from which RL's updates raised the trained
family by ~20 points in 60 updates (docs/results/calibration/README.md, sweep-2).

The ``-o`` models give part of their warm-up to OOD families (``MicroSpec.pretrain``): the
"pretraining" knowledge of families a run never trains on, so OOD accuracy can move. ``micro-llama-s-o``
/ ``micro-llama-s-sub-o``: 15 % add3 and word_add. ``micro-llama-w-o`` / ``micro-llama-w-sub-o`` (the
worked tier's OOD-aware pair): 30 % add3 and next (word problems did not learn at 15 %), their step
counts chosen so the worked families start where ``micro-llama-w250`` / ``micro-llama-w-sub`` do
(docs/models.md).

The Llama and Qwen2 BPE models share one tokenizer (the BPE is trained on the same seeded corpus),
so batches between them are token-level (F-TIS's per-token ratios); ``micro-qwen-s-char`` and, on the
learning tier, ``micro-qwen-w-sub-char`` (the mixed pair's specialist beside ``micro-llama-w250``) are the
participants whose batches must be re-tokenized.

Tokenizers (``build_tokenizer``), both real ``transformers`` fast tokenizers saved with the model,
with pad / EOS tokens and a chat template (``CHAT_TEMPLATE``: ``<|user|>question<|assistant|>reply
<|end|>``, what ``Policy.format_prompt`` applies):

- ``char``: byte-level, no merges: one token per byte (per character for the task's ASCII text),
  261 tokens; any text a peer sends re-tokenizes without loss.
- ``bpe``: byte-level BPE trained here with ``tokenizers`` on train-split task text (digits kept
  one per token, as Llama and Qwen tokenizers do), up to ``BPE_VOCAB`` tokens. The two
  tokenizers' fingerprints differ, so batches between a ``char`` and a ``bpe`` model are
  re-tokenized from text and scored at sequence level (docs/method.md).

Determinism: the warm-up runs with one thread and ``torch.use_deterministic_algorithms``; the same
spec and seed give bit-identical weights on the same software (tests/test_micro.py).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# torch is imported inside the builders: importing this module only registers them (the launcher's
# model-name check does, and needs no torch)
from ftis_fed.policies.store import OFFLINE_MODELS, RECIPES, TRAINED_BUILDS

#: Special tokens, ids 0.. in this order: padding, end of reply (EOS), the two chat roles.
PAD, EOS, USER, ASSISTANT, SYSTEM = "<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"
SPECIALS = (PAD, EOS, USER, ASSISTANT, SYSTEM)
#: The chat format: each message is its role token then its content; an assistant message ends with
#: EOS; the generation prompt is the assistant role token.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ '<|end|>' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
TOKENIZERS = ("char", "bpe")
#: Largest vocabulary the BPE trainer may reach (the task text's merges run out before it).
BPE_VOCAB = 512
#: Problems drawn per family for the BPE training corpus (train split, task seed ``CORPUS_SEED``).
CORPUS_PROBLEMS = 2000
CORPUS_SEED = 0
ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class MicroSpec:
    """One model of the family: architecture, tokenizer, size, warm-up.

    arch: ``llama`` or ``qwen2``; tokenizer: ``char`` or ``bpe``; hidden / layers / heads /
    kv_heads / intermediate: the transformer's shape (hidden % heads == 0, heads % kv_heads == 0);
    families: the task families whose train split the warm-up draws from (round-robin);
    steps x batch: warm-up problems; lr: peak AdamW learning rate (linear warm-up over the first
    10 % of steps, then linear decay to 10 % of it); seed: initialisation, problem draw and order;
    pretrain, pretrain_share: further families the warm-up gives that share of its problems
    (round-robin among them): the "pretraining" knowledge of families a run never trains on, so
    that its OOD evaluation does not start at 0 (() / 0.0: none, the models before this existed).
    """

    arch: str
    tokenizer: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    families: tuple[str, ...]
    steps: int
    lr: float
    batch: int = 32
    seed: int = 0
    pretrain: tuple[str, ...] = ()
    pretrain_share: float = 0.0
    #: the warm-up teaches the families' worked solutions (``tasks.suite.worked_reply``: column steps,
    #: then the number) instead of the bare answer; the same for families that have none.
    worked: bool = False

    def __post_init__(self) -> None:
        from ftis_fed.tasks.families import get_family

        if self.arch not in ARCHITECTURES:
            raise ValueError(f"micro.arch={self.arch!r}: must be one of {ARCHITECTURES}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"micro.tokenizer={self.tokenizer!r}: must be one of {TOKENIZERS}")
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"micro: hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}: need "
                             "hidden % heads == 0, heads % kv_heads == 0 and an even head size (RoPE)")
        if min(self.layers, self.intermediate, self.steps + 1, self.batch) < 1 or self.lr < 0:
            raise ValueError(f"micro: layers, intermediate, batch must be >= 1, steps >= 0, lr >= 0 ({self})")
        for f in (*self.families, *self.pretrain):
            get_family(f)
        if not 0.0 <= self.pretrain_share < 1.0 or (self.pretrain_share > 0) != bool(self.pretrain):
            raise ValueError(f"micro.pretrain_share={self.pretrain_share}: in [0, 1), and > 0 exactly when "
                             f"pretrain names families (pretrain={self.pretrain})")


# ----------------------------------------------------------------------------- tokenizers

def corpus(families: Sequence[str], n: int = CORPUS_PROBLEMS, seed: int = CORPUS_SEED) -> list[str]:
    """Train-split task text (question and answer) of ``families``: what the BPE is trained on."""
    from ftis_fed.tasks.suite import task_at

    return [t for f in families for p in (task_at(f, "train", seed, i) for i in range(n)) for t in (p.text, p.reference)]


def build_tokenizer(kind: str, families: Sequence[str] = ("add30", "sub30")):
    """A ``PreTrainedTokenizerFast`` of ``kind`` (``char`` or ``bpe``, see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if kind == "char":
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {t: i for i, t in enumerate([*SPECIALS, *alphabet])}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer = byte_level
        tk.add_special_tokens(list(SPECIALS))
    elif kind == "bpe":
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=list(SPECIALS), show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tk.train_from_iterator(corpus(families), trainer=trainer)
    else:
        raise ValueError(f"tokenizer kind {kind!r}: must be one of {TOKENIZERS}")
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=PAD, eos_token=EOS,
                                   additional_special_tokens=[USER, ASSISTANT, SYSTEM], chat_template=CHAT_TEMPLATE)


# ----------------------------------------------------------------------------- model

def model_config(spec: MicroSpec, tok):
    """The ``transformers`` config of ``spec`` for tokenizer ``tok`` (tied input/output embeddings)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if spec.arch == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common, use_sliding_window=False)


@contextlib.contextmanager
def deterministic_cpu():
    """One thread and deterministic kernels for the block (bit-identical builds); restored after."""
    import torch
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det)
        torch.set_num_threads(threads)


def warmup_rows(tok, families: Sequence[str], n: int, seed: int, pretrain: Sequence[str] = (),
                pretrain_share: float = 0.0, worked: bool = False) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt ids, reply ids + EOS) of train-split problems, families round-robin, each prompt
    in the chat template; instance i of family f is ``task_at(f, "train", seed, i // len(families))``;
    with ``pretrain``, round(n * pretrain_share) of the n come from those families instead (the same
    way, round-robin among them); then the list is shuffled with ``seed``."""
    from ftis_fed.tasks.suite import task_at, worked_reply

    cache: dict[str, list[int]] = {}

    def ids(text: str, chat: bool) -> list[int]:
        if text not in cache:
            cache[text] = list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)) if chat else \
                list(tok(text, add_special_tokens=False)["input_ids"])
        return cache[text]

    n_pre = round(n * pretrain_share) if pretrain else 0
    rows = []
    for fams, count in ((families, n - n_pre), (tuple(pretrain), n_pre)):
        for i in range(count):
            f, j = fams[i % len(fams)], i // len(fams)
            p = task_at(f, "train", seed, j)
            reply = worked_reply(f, "train", seed, j) if worked else p.reference
            rows.append((ids(p.text, True), ids(reply, False) + [tok.eos_token_id]))
    random.Random(seed).shuffle(rows)
    return rows


def _batch(rows: Sequence[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (ids (B,L), attention (B,L), targets (B,L): the next token where it is a reply
    token, else -100)."""
    import torch
    L = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)                       # (B,L)
    attn = torch.zeros((len(rows), L), dtype=torch.long)                             # (B,L)
    tgt = torch.full((len(rows), L), -100, dtype=torch.long)                         # (B,L)
    for b, (p, r) in enumerate(rows):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        attn[b, : len(p) + len(r)] = 1
        tgt[b, len(p) - 1: len(p) + len(r) - 1] = torch.tensor(r)
    return ids, attn, tgt


def warm_up(model, tok, spec: MicroSpec, log: bool = True) -> list[float]:
    """The supervised warm-up of ``spec`` on ``model`` in place: cross-entropy of the reply tokens
    (the bare answer and EOS) given the chat-formatted train-split question. Returns the loss per step."""
    import torch
    rows = warmup_rows(tok, spec.families, spec.steps * spec.batch, spec.seed, spec.pretrain, spec.pretrain_share,
                       spec.worked)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    warm = max(1, spec.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 1.0 - 0.9 * max(0, s - warm) / max(1, spec.steps - warm)))
    model.train()
    losses = []
    for step in range(spec.steps):
        ids, attn, tgt = _batch(rows[step * spec.batch:(step + 1) * spec.batch], tok.pad_token_id)
        logits = model(input_ids=ids, attention_mask=attn).logits                    # (B,L,V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log and (step % 100 == 0 or step == spec.steps - 1):
            print(f"[micro warm-up] step {step + 1}/{spec.steps} loss {loss.item():.4f}", flush=True)
    model.eval()
    return losses


def build_micro(out: Path, spec: MicroSpec, log: bool = True) -> None:
    """Tokenizer, random-initialised model and warm-up of ``spec``, saved into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    with deterministic_cpu():
        tok = build_tokenizer(spec.tokenizer)
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(model_config(spec, tok), dtype=torch.float32)
        warm_up(model, tok, spec, log=log)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)


# ----------------------------------------------------------------------------- the family

_TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=176)
_SMALL = dict(hidden=96, layers=3, heads=4, kv_heads=2, intermediate=256)
_MEDIUM = dict(hidden=160, layers=4, heads=4, kv_heads=2, intermediate=448)
_LARGE = dict(hidden=256, layers=5, heads=8, kv_heads=4, intermediate=688)
_BOTH = ("add30", "sub30")
_PRETRAIN = ("add3", "word_add")
#: the worked tier's OOD-aware pair: one warm-up recipe, 30 % of it from add3 and next (bare-number replies)
_WORKED_O = dict(lr=3e-3, batch=64, worked=True, pretrain=("add3", "next"), pretrain_share=0.3)

#: name -> spec of every model of the research tier (registered in ``OFFLINE_MODELS`` below).
MICRO_MODELS: dict[str, MicroSpec] = {
    "micro-llama-s": MicroSpec("llama", "bpe", **_SMALL, families=_BOTH, steps=550, lr=3e-3, batch=64),
    "micro-llama-s-add": MicroSpec("llama", "bpe", **_SMALL, families=("add30",), steps=250, lr=3e-3, batch=64),
    "micro-llama-s-sub": MicroSpec("llama", "bpe", **_SMALL, families=("sub30",), steps=400, lr=3e-3, batch=64),
    "micro-llama-l": MicroSpec("llama", "bpe", **_LARGE, families=_BOTH, steps=250, lr=1e-3, batch=64),
    "micro-qwen-m": MicroSpec("qwen2", "bpe", **_MEDIUM, families=_BOTH, steps=400, lr=2e-3, batch=64),
    "micro-qwen-s-char": MicroSpec("qwen2", "char", **_SMALL, families=("sub30",), steps=600, lr=3e-3, batch=64),
    # the research-ood pair: 15 % of the warm-up from two OOD families (pretraining knowledge a run never trains)
    "micro-llama-s-o": MicroSpec("llama", "bpe", **_SMALL, families=_BOTH, steps=550, lr=3e-3, batch=64,
                                 pretrain=_PRETRAIN, pretrain_share=0.15),
    "micro-llama-s-sub-o": MicroSpec("llama", "bpe", **_SMALL, families=("sub30",), steps=400, lr=3e-3, batch=64,
                                     pretrain=_PRETRAIN, pretrain_share=0.15),
    # the learning tier (issue #27): worked column-step replies on two-digit problems
    "micro-llama-w": MicroSpec("llama", "bpe", **_SMALL, families=("add99", "sub99"), steps=200, lr=3e-3, batch=64,
                               worked=True),
    "micro-llama-w250": MicroSpec("llama", "bpe", **_SMALL, families=("add99", "sub99"), steps=250, lr=3e-3,
                                  batch=64, worked=True),
    "micro-llama-w-sub": MicroSpec("llama", "bpe", **_SMALL, families=("sub99",), steps=200, lr=3e-3, batch=64,
                                   worked=True),
    "micro-llama-w-o": MicroSpec("llama", "bpe", **_SMALL, families=("add99", "sub99"), steps=325, **_WORKED_O),
    "micro-llama-w-sub-o": MicroSpec("llama", "bpe", **_SMALL, families=("sub99",), steps=230, **_WORKED_O),
    # the learning tier's mixed pair: another architecture and tokenizer than micro-llama-w250, the same
    # worked subtraction (215 steps: greedy 0.50, pass@1 at T 0.7 0.22 on sub99; 200 / 225 gave 0.28 / 0.83)
    "micro-qwen-w-sub-char": MicroSpec("qwen2", "char", **_SMALL, families=("sub99",), steps=215, lr=3e-3, batch=64,
                                       worked=True),
    # the learning tier's size pair's small model: a third of micro-llama-w250's parameters (0.11 M), the same
    # worked families, started where micro-llama-w250 starts (350 steps: pass@1 at T 0.7 0.30 / 0.28 on add99 /
    # sub99; 340 steps started at 0.155 sampled and gained +3.7 alone in 100 rounds: docs/models.md)
    "micro-llama-w-t": MicroSpec("llama", "bpe", **_TINY, families=("add99", "sub99"), steps=350, lr=3e-3, batch=64,
                                 worked=True),
}

for _name, _spec in MICRO_MODELS.items():
    OFFLINE_MODELS[_name] = lambda out, spec=_spec: build_micro(out, spec)
TRAINED_BUILDS.update(MICRO_MODELS)               # warm-ups: built with pinned kernels (store.TRAINED_BUILDS)
RECIPES.update({_name: repr(_spec) for _name, _spec in MICRO_MODELS.items()})   # a changed spec rebuilds
