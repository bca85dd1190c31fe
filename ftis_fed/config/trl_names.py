"""TRL's names (``GRPOConfig``, its ``TrainingArguments``, ``ModelConfig``, ``GRPOTrainer``'s
arguments) -> ftis-fed's run-config keys: the table in docs/configuration.md and the hint a
"not a key" error gives for a TRL name.

No aliases are accepted in the run config: Flower rejects undeclared keys, so each alias would be a
second declared key for the same setting (two values that can disagree), in TRL's snake_case next to
Flower's kebab-case keys; and several TRL names are not one key here (``loss_type`` is
``length-norm`` and, for Dr. GRPO, ``scale-rewards``; ``use_peft`` + ``load_in_4bit`` is ``adapter``
+ ``quant``). An unknown key that is a TRL name (``num_generations``, ``num-generations``) is an
error naming the ftis-fed key instead. Standard library only.
"""

from __future__ import annotations

from typing import NamedTuple


class TrlName(NamedTuple):
    trl: str          # TRL's name
    ours: str         # the ftis-fed key(s) / value(s), '' = no counterpart
    note: str


#: One entry per TRL name: ``TRL name | ftis-fed key ('' = none) | note``; indented lines continue the note.
_TABLE = """
num_generations | group-size | G, completions per prompt (horizontal advantage groups: split among
    participants).
max_completion_length | max-new-tokens | also Dr. GRPO's normalisation constant, as in TRL.
temperature | temperature | every participant samples and scores with it.
top_p | top-p |
top_k | top-k | 0 disables (TRL: 0 or None).
learning_rate | lr | TRL's default 1e-6; ftis-fed's 0 = auto (1e-5 full, 2e-4 LoRA).
epsilon | clip-eps | the PPO clip; symmetric only.
epsilon_high |  | no asymmetric (DAPO clip-higher) bound: clip-eps both ways.
beta |  | no reference-model KL term: always TRL's default beta = 0.
loss_type | length-norm | grpo -> sequence; dapo (TRL's default) and bnpo -> token; dr_grpo -> constant (with
    scale-rewards = none, as the Dr. GRPO paper); cispo, sapo, luspo, vespo: none.
scale_rewards | scale-rewards | group or none; TRL's batch has no counterpart.
importance_sampling_level | ratio-level | token or sequence (cross-tokenizer samples are always sequence-level).
vllm_importance_sampling_correction | loss-mode | truncated importance sampling of samples from another policy:
    TIS / F-TIS (default); noIS: off.
vllm_importance_sampling_mode | ratio-level | token_truncate -> ratio-level = token; sequence_truncate ->
    sequence; *_mask: none (ftis-fed truncates, it never masks by the ratio).
vllm_importance_sampling_clip_max | trunc-c | C, the truncation cap (TRL's default 3.0, ours 2.0).
vllm_importance_sampling_cap | trunc-c | TRL's deprecated name for vllm_importance_sampling_clip_max.
vllm_importance_sampling_clip_min |  | no lower bound.
off_policy_mask_threshold | filter-g | with kl-estimator = mean-k1 it is TRL's DeepSeek-V3.2 mask (negative-advantage
    sequences whose mean per-token KL exceeds delta are dropped); ftis-fed's default estimator is the
    summed KL (sum-k1, filter-g 50).
reward_weights | task-reward-weights | one per reward function (docs/own-task.md).
multi_objective_aggregation |  | sum_then_normalize (TRL's default) only.
num_iterations |  | one update per batch (TRL's default 1).
steps_per_generation | prompts-per-round | a participant's round: prompts-per-round prompts x group-size
    completions, one update.
generation_batch_size | prompts-per-round | see steps_per_generation.
mask_truncated_completions |  | not supported: truncated completions keep their reward.
use_vllm | backend | backend = vllm (colocated, one engine per participant).
vllm_gpu_memory_utilization | gpu-memory-share | a participant's share of its GPU.
per_device_train_batch_size | micro-batch | completions per forward/backward.
gradient_accumulation_steps | micro-batch | every micro-batch of a round accumulates into one update.
num_train_epochs | num-rounds | one update per participant per round.
max_steps | num-rounds | one update per participant per round.
max_grad_norm | max-grad-norm |
weight_decay | weight-decay |
optim | optimizer | adamw_torch -> adamw; adamw_8bit / paged_adamw_8bit -> adamw-8bit / paged-adamw-8bit.
gradient_checkpointing | grad-checkpointing |
bf16 | dtype | dtype = bf16 (autocast); weights-dtype = bf16 loads the weights in bf16.
seed | seed |
save_steps | checkpoint-every | rounds between checkpoints.
output_dir | output-dir |
report_to | report-to | none, tensorboard, wandb.
train_dataset | task-data | with task-source = user; columns: task-prompt-column, task-answer-column
    (docs/own-task.md).
reward_funcs | task-rewards | import paths, module:function or path/to/file.py:function.
model_name_or_path | model | p<i>-model per participant.
dtype | weights-dtype | the dtype the weights are loaded in.
use_peft | adapter | adapter = lora.
lora_r | lora-r |
lora_alpha | lora-alpha |
lora_dropout | lora-dropout |
lora_target_modules |  | always all linear layers.
load_in_4bit | quant | quant = 4bit (NF4, with adapter = lora: QLoRA).
load_in_8bit | quant | quant = 8bit (with adapter = lora).
"""

TRL_NAMES: tuple[TrlName, ...] = tuple(TrlName(*(c.strip() for c in entry.split("|", 2)))
                                       for entry in _TABLE.strip().replace("\n    ", " ").splitlines())

_BY_NAME = {t.trl: t for t in TRL_NAMES}


def trl_hint(key: str) -> str:
    """For an unknown run-config key that is a TRL name (snake_case or kebab-case): ``"; TRL's
    num_generations is group-size"`` (or says it has no counterpart); else ''."""
    t = _BY_NAME.get(str(key).strip().lower().replace("-", "_"))
    if t is None:
        return ""
    if not t.ours:
        return f"; TRL's {t.trl} has no ftis-fed key ({t.note.rstrip('.')})"
    return f"; TRL's {t.trl} is {t.ours}"


def reference_section() -> list[str]:
    """The TRL section of docs/configuration.md (markdown lines)."""
    lines = ["## TRL names", "",
             "TRL's `GRPOConfig` (with its `TrainingArguments`), `ModelConfig` and `GRPOTrainer` arguments, and "
             "the ftis-fed keys that do the same. No aliases are accepted: Flower rejects keys a run config does "
             "not declare, so each alias would be a second declared key for one setting (two values that can "
             "disagree), in snake_case beside Flower's kebab-case keys, and several TRL names are not one key "
             "here. Instead `ftis-fed sim --run-config num-generations=8` (or `num_generations=8`) stops with "
             "`not a run-config key; TRL's num_generations is group-size`. (Plain `flwr run` rejects an "
             "undeclared key itself, before ftis-fed sees it.)", "",
             "| TRL | ftis-fed | notes |", "|---|---|---|"]
    for t in TRL_NAMES:
        ours = ", ".join(f"`{k.strip()}`" for k in t.ours.split(",")) if t.ours else "—"
        lines.append(f"| `{t.trl}` | {ours} | {t.note.replace('|', chr(92) + '|')} |")
    return lines + [""]
