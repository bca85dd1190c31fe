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

from typing import Any, Mapping, NamedTuple


class TrlName(NamedTuple):
    trl: str          # TRL's name
    ours: str         # the ftis-fed key(s) / value(s), '' = no counterpart
    trl_default: str  # TRL 1.16's default as a Python literal ('' = not stated: a trainer argument)
    note: str


#: One entry per TRL name: ``TRL name | ftis-fed key ('' = none) | TRL's default | note``; indented
#: lines continue the note. TRL's defaults are those of the installed TRL 1.16 (``GRPOConfig``,
#: ``ModelConfig``; ``tests/test_trl_names.py`` checks each against it); ours come from the knobs.
_TABLE = """
num_generations | group-size | 8 | G, completions per prompt (horizontal advantage groups: split among
    participants).
max_completion_length | max-new-tokens | 512 | also Dr. GRPO's normalisation constant, as in TRL.
temperature | temperature | 1.0 | every participant samples and scores with it.
top_p | top-p | 1.0 |
top_k | top-k | 0 | an int; 0 disables.
min_p |  | None | not supported (no min-p sampling).
repetition_penalty |  | 1.0 | not supported: always 1.0 (the recorded log-probs are the sampling distribution's).
learning_rate | lr | 1e-06 | ftis-fed's 0 = auto (1e-5 full, 2e-4 LoRA).
lr_scheduler_type |  | 'linear' | none: the rate is constant after the optional warm-up (lr-warmup-steps), as
    TRL's constant_with_warmup; TRL's default (linear) decays it to 0 over the run.
warmup_steps | lr-warmup-steps | 0 | linear warm-up over the first n updates, then constant. Update s (s = 1,
    2, ...) trains at lr * min(1, s / n), so the first update has lr / n where transformers' first step has 0
    (its schedule is ours one step later); a float below 1 (transformers: a ratio of the total steps) is not
    accepted.
epsilon | clip-eps | 0.2 | the PPO clip; symmetric only.
epsilon_high |  | None | no asymmetric (DAPO clip-higher) bound: clip-eps both ways.
delta |  | None | no two-sided (INTELLECT-2) upper clip.
beta |  | 0.0 | no reference-model KL term: always beta = 0, TRL's default.
loss_type | length-norm | 'dapo' | grpo -> sequence (ours); dapo (TRL's default) and bnpo -> token; dr_grpo ->
    constant (with scale-rewards = none, as the Dr. GRPO paper); cispo, sapo, luspo, vespo: none.
scale_rewards | scale-rewards | 'group' | group or none; TRL's batch has no counterpart.
importance_sampling_level | ratio-level | 'token' | token -> token; sequence (GSPO: the MEAN per-token
    log-ratio) -> sequence-mean. ratio-level = sequence is the SUMMED log-ratio (TRL's
    vllm_importance_sampling_mode = sequence_truncate); cross-tokenizer samples are summed at token level.
vllm_importance_sampling_correction | loss-mode | True | TRL weighs vLLM's samples by the trainer's
    log-probs over vLLM's; ftis-fed weighs samples from another policy (a peer's) by the learner's log-probs
    over the sender's: TIS / F-TIS (default); noIS: off.
vllm_importance_sampling_mode | ratio-level | 'sequence_mask' | token_truncate -> ratio-level = token;
    sequence_truncate -> sequence; token_mask and sequence_mask (TRL's default): no counterpart (ftis-fed
    truncates, it never masks by the ratio).
vllm_importance_sampling_clip_max | trunc-c | 3.0 | C, the truncation cap.
vllm_importance_sampling_cap | trunc-c | None | TRL's deprecated name for vllm_importance_sampling_clip_max.
vllm_importance_sampling_clip_min |  | None | no lower bound.
off_policy_mask_threshold | filter-g | None | with kl-estimator = mean-k1 it is TRL's DeepSeek-V3.2 mask
    (negative-advantage sequences whose mean per-token KL exceeds delta are dropped); ftis-fed's default
    estimator is the summed KL (sum-k1, filter-g 50), and the filter is on by default (F-TIS).
reward_weights | task-reward-weights | None | one per reward function (docs/own-task.md).
multi_objective_aggregation |  | 'sum_then_normalize' | sum_then_normalize only (TRL also has
    normalize_then_sum, GDPO's per-function normalisation).
num_iterations |  | 1 | one update per batch, TRL's default.
steps_per_generation |  | None | optimizer steps per generation batch: always one here (one update per
    round, every micro-batch accumulated into it).
generation_batch_size | prompts-per-round, group-size | None | TRL counts completions per generation
    batch: here a participant's round generates prompts-per-round x group-size completions.
mask_truncated_completions |  | False | not supported: truncated completions keep their reward (as TRL's default).
use_vllm | backend | False | backend = vllm.
vllm_mode | backend | 'colocate' | colocate only: one engine per participant, in its worker (no vLLM server).
vllm_tensor_parallel_size |  | 1 | one GPU per engine.
vllm_gpu_memory_utilization | gpu-memory-utilization | 0.3 | the fraction of the card the engine reserves;
    ours 0 = derived from the participant's gpu-memory-share.
vllm_max_model_length | max-model-len | None | ours 0 = the model's context length, as TRL's None.
per_device_train_batch_size | micro-batch | 8 | completions per forward/backward.
gradient_accumulation_steps |  | 1 | no key: every micro-batch of a round accumulates into one update (a
    round's completions / micro-batch steps).
num_train_epochs | num-rounds | 3.0 | one update per participant per round.
max_steps | num-rounds | -1 | one update per participant per round.
eval_steps | eval-every | None | rounds between held-out evaluations (greedy pass@1).
max_grad_norm | max-grad-norm | 1.0 |
weight_decay | weight-decay | 0.0 |
optim | optimizer | 'adamw_torch_fused' | adamw_torch(_fused) -> adamw; adamw_8bit / paged_adamw_8bit ->
    adamw-8bit / paged-adamw-8bit.
gradient_checkpointing | grad-checkpointing | True |
bf16 | dtype | None | dtype = bf16 (autocast; TRL: bf16 unless fp16 is set); weights-dtype = bf16 loads the
    weights in bf16.
seed | seed | 42 |
save_steps | checkpoint-every | 500 | rounds between checkpoints.
resume_from_checkpoint | resume | None | resume = true continues from output-dir's saved state.
output_dir | output-dir | None |
report_to | report-to | 'none' | none, tensorboard, wandb.
push_to_hub | push-to-hub | False | ours is the repo id itself (TRL: a bool with hub_model_id): after the run
    each participant uploads its export with huggingface_hub's upload_folder; '' = never.
hub_model_id | push-to-hub | None | the repo id, {participant} replaced by each participant's name (without it:
    <id>-<participant>).
log_completions | log-completions | False | ours counts prompts: the first k prompts of every round, with all
    their completions, rewards per function and solved (completions.jsonl and completions.md); TRL: a bool,
    every logging_steps, num_completions_to_print of them.
train_dataset | task-data |  | with task-source = user: a local file or folder (read by datasets.load_dataset
    where installed), a save_to_disk folder or a hub id; columns: task-prompt-column, task-answer-column
    (docs/own-task.md).
reward_funcs | task-rewards |  | import paths, module:function or path/to/file.py:function; a factory with
    task-reward-kwargs; async def functions. Reward models (a model id) are not supported.
model_name_or_path | model | None | p<i>-model per participant.
dtype | weights-dtype | 'float32' | the dtype the weights are loaded in.
use_peft | adapter | False | adapter = lora.
lora_r | lora-r | 16 |
lora_alpha | lora-alpha | 32 |
lora_dropout | lora-dropout | 0.05 |
lora_target_modules |  | None | always all linear layers.
load_in_4bit | quant | False | quant = 4bit (NF4, with adapter = lora: QLoRA).
load_in_8bit | quant | False | quant = 8bit (with adapter = lora).
"""

TRL_NAMES: tuple[TrlName, ...] = tuple(TrlName(*(c.strip() for c in entry.split("|", 3)))
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


def reference_section(defaults: Mapping[str, Any] | None = None) -> list[str]:
    """The TRL section of docs/configuration.md (markdown lines); ``defaults``: ftis-fed key -> its
    default, for the column beside TRL's."""
    defaults = defaults or {}
    lines = ["## TRL names", "",
             "TRL's `GRPOConfig` (with its `TrainingArguments`), `ModelConfig` and `GRPOTrainer` arguments, and "
             "the ftis-fed keys that do the same. No aliases are accepted: Flower rejects keys a run config does "
             "not declare, so each alias would be a second declared key for one setting (two values that can "
             "disagree), in snake_case beside Flower's kebab-case keys, and several TRL names are not one key "
             "here. Instead `ftis-fed sim --run-config num-generations=8` (or `num_generations=8`) stops with "
             "`not a run-config key; TRL's num_generations is group-size`. (Plain `flwr run` rejects an "
             "undeclared key itself, before ftis-fed sees it.) Defaults differ: TRL's column is TRL 1.16's own "
             "(`GRPOConfig` with its `TrainingArguments`, `ModelConfig`; `tests/test_trl_names.py` reads each back "
             "from the installed classes), ours is the key's default; `—` = no counterpart.", "",
             "| TRL | TRL 1.16 default | ftis-fed | ftis-fed default | notes |", "|---|---|---|---|---|"]
    for t in TRL_NAMES:
        keys = [k.strip() for k in t.ours.split(",")] if t.ours else []
        ours = ", ".join(f"`{k}`" for k in keys) or "—"
        mine = ", ".join(f"`{_literal(defaults[k])}`" for k in keys if k in defaults) or "—"
        theirs = f"`{t.trl_default}`" if t.trl_default else "—"
        lines.append(f"| `{t.trl}` | {theirs} | {ours} | {mine} | {t.note.replace('|', chr(92) + '|')} |")
    return lines + [""]


def _literal(value: Any) -> str:
    """A knob's default as the run config writes it (TOML: ``true``, ``"sync"``, ``0.7``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return '"' + ",".join(map(str, value)) + '"'
    return str(value)
