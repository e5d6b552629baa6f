"""The recipe: one YAML file that says *what* to train. Config files under accelerate_configs/ say *how*.

`load_recipe(path, overrides)` reads the YAML, applies `key.path=value` overrides from the command line,
and validates everything with pydantic (unknown keys, wrong types, missing local files) before any
process group or model exists. Every problem is reported as `<file>: <key>: <what is wrong>`.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from disttrain.errors import RecipeError

LOCAL_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class _Section(BaseModel):
    # forbid: a typo such as `trainig.lr` must fail loudly instead of silently using the default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    name_or_path: str = Field(description="Hub id or local dir passed to from_pretrained")
    revision: str | None = Field(None, description="A Hub branch, tag or commit of the model")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("bfloat16", description="The weights' dtype "
                                                                     "as loaded (auto: the checkpoint's own)")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa", description="transformers' attention kernel (flash_attention_*: the flash-attn package, CUDA)")
    gradient_checkpointing: bool = Field(False, description="Non-reentrant activation checkpointing: each layer's "
                                         "forward is recomputed in the backward pass (less memory, ~1/3 more compute)")
    trust_remote_code: bool = Field(False, description="Run the model repository's own Python code: only for "
                                    "models you trust")
    tokenizer_name_or_path: str | None = Field(None, description="Another tokenizer than the model's")
    quantization: Literal["4bit"] | None = Field(None, description="QLoRA: 4-bit NF4 base weights "
                                                         "(needs a lora section and CUDA)")
    router_aux_loss_coef: float | None = Field(
        None, ge=0.0, description="mixture of experts: train with the router's load-balancing loss at this weight "
        "(turns on the model's output_router_logits; null keeps the model config's choice, off for Qwen3-MoE and "
        "Mixtral as published); a dense model is refused in one line")
    router_balance: Literal["micro_batch", "global"] = Field(
        "micro_batch", description="mixture of experts: what the router's load-balancing loss balances. "
        "micro_batch: each rank's micro-batch (transformers' own loss); global: every rank's micro-batch together "
        "(expert counts all-reduced, as one process on all those rows: disttrain/objectives/router_balance.py)")
    freeze: list[Literal["vision", "projector", "language"]] | None = Field(
        None, description="Vision-language models: the parts left as they are (vision: the image encoder, "
        "projector: what maps its features into the language model, language: the language model and its head); "
        "null: [vision]. Under LoRA the adapters go on the parts not frozen (docs/vlm.md); a text model with a "
        "freeze list is refused in one line")


DataFormat = Literal["alpaca", "chat", "sharegpt", "text", "preference", "unpaired", "prompt"]
# the record fields each format reads; `columns` maps them to a dataset's own column names
FORMAT_FIELDS = {"alpaca": ("instruction", "input", "output", "system"), "chat": ("messages", "tools", "images"),
                 "sharegpt": ("conversations", "tools", "system", "images"), "text": ("text",),
                 "unpaired": ("prompt", "completion", "label", "tools"), "prompt": ("prompt", "tools")}


class _SourceFields(_Section):
    """What one data source says: where its records are, how to read them, and its evaluation data."""

    split: str = Field("train", description="The split to train on (hub datasets)")
    subset: str | None = Field(None, description="The hub dataset's configuration, e.g. main for openai/gsm8k")
    chat_prompt: bool = Field(False, description="format prompt: a string prompt becomes the user's turn of a "
                              "conversation (after system_prompt, if set), rendered by the chat template with its "
                              "generation prompt; false: a string prompt is used as it is (as TRL does)")
    eval_path: str | None = Field(None, description="Evaluation data: a file in the same format")
    eval_split: str | None = Field(None, description="Evaluation data: a split of the same dataset")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Evaluation data: this fraction held out of the "
                                 "training records (seeded)")
    system_prompt: str | None = Field(None, description="System message for conversations that have none")
    columns: dict[str, str] = Field(default_factory=dict, description="format field -> this dataset's column, "
                                    "e.g. {instruction: prompt, output: response}")
    roles: dict[str, str] = Field(default_factory=dict, description="sharegpt: extra `from` value -> role "
                                  "(user, assistant, system, tool, function_call)")
    image_dir: str | None = Field(None, description="Vision-language data: where relative image paths start "
                                  "(default: the data file's folder; docs/vlm.md)")

    @model_validator(mode="after")
    def _check_eval(self):
        if self.eval_fraction and (self.eval_path or self.eval_split):
            raise ValueError("set either eval_fraction or eval_path/eval_split, not both")
        return self


class SourceSection(_SourceFields):
    path: str = Field(description="Local .jsonl/.json/.parquet file, or a `datasets` hub name")
    format: DataFormat = Field(description="alpaca, chat, sharegpt, text, preference, unpaired or prompt "
                               "(docs/data.md)")
    name: str | None = Field(None, description="Shown in reports and eval metrics; default: the file's stem")
    weight: float = Field(1.0, gt=0, description="Sampling probability in the mixture (normalised over sources; "
                          "a small source is oversampled, not cut)")

    def label(self) -> str:
        return self.name or Path(self.path).stem.replace(".", "_") or self.path


class DataSection(_SourceFields):
    path: str | None = Field(None, description="One source: a local .jsonl/.json/.parquet file or glob "
                             "(data/part-*.jsonl), or a `datasets` hub name")
    format: DataFormat | None = Field(None, description="alpaca, chat, sharegpt, text (docs/data.md), preference "
                                      "(DPO pairs, docs/preference.md), unpaired (KTO's {prompt, completion, "
                                      "label}) or prompt (online RL, docs/rl.md)")
    sources: list[SourceSection] | None = Field(None, description="A mixture instead of path/format: a list of "
                                                "{path, format, name, weight, split, eval_*, columns, roles, "
                                                "system_prompt}, sampled by weight")
    max_seq_len: int = Field(2048, ge=16, description="Tokens per row: longer records are truncated (format "
                             "prompt: the longest prompt; a longer one stops the run in one line)")
    packing: bool = Field(False, description="Several records per row, none attending to another (position ids "
                          "restart per record); training.objective dpo (KTO included) / reward: each micro-batch's "
                          "sequences padding-free (as TRL's padding_free), the same pairs per micro-batch; grpo: the "
                          "rollouts' training rows padding-free")
    text_field: str = Field("text", description="format text: the column holding the text")
    messages_field: str = Field("messages", description="format chat: the column holding the messages")
    concat_and_chunk: bool = Field(False, description="format text: join all documents with EOS and cut them into "
                                   "max_seq_len rows (continued pretraining) instead of truncating each")
    chunk_isolate_documents: bool = Field(False, description="with concat_and_chunk: documents in one row do not "
                                          "attend to each other (position ids restart, as in packing)")
    num_proc: int | None = Field(None, ge=1, description="Processes for tokenising; default: the CPUs available "
                                 "(at most 16), one per 20k records")
    shuffle: bool = Field(True, description="Shuffle the training rows each epoch (seeded, the same on every rank)")
    max_pixels: int | None = Field(None, ge=1, description="Vision-language data: images larger than this many "
                                   "pixels are scaled down (aspect kept). A processor that counts image tokens by "
                                   "size (Qwen-VL's layout) gets it as its own limit, kept in the exported model; "
                                   "default there: its own, lowered so one image fills at most half of max_seq_len")
    min_pixels: int | None = Field(None, ge=1, description="Vision-language data: smaller images are scaled up "
                                   "(default there: the processor's own)")
    max_images: int = Field(8, ge=1, description="Vision-language data: more images in one conversation stop the "
                            "run in one line naming the record")
    streaming: bool = Field(False, description="Read the training data as a stream (local files or the hub): "
                            "tokenised and packed on the fly, each rank its own shards, nothing cached; "
                            "needs training.max_steps (docs/data.md; the configs it is proven under: "
                            "docs/compatibility.md)")
    # set by the recipe (preference.loss: kto): records become KTO's examples, each with a KL partner
    _unpaired: bool = PrivateAttr(False)

    def unpaired_examples(self) -> bool:
        """Whether records are prepared as KTO's unpaired examples (data/unpaired.py): the recipe says so when
        training.objective is dpo with preference.loss: kto."""
        return self._unpaired

    @model_validator(mode="after")
    def _one_form(self):
        if self.sources is None and not (self.path and self.format):
            raise ValueError("give path and format (one source) or sources (a mixture)")
        if self.sources is not None:
            if self.path or self.format:
                raise ValueError("give either path/format or sources, not both")
            if not self.sources:
                raise ValueError("sources is empty")
            labels = [s.label() for s in self.sources]
            if len(set(labels)) != len(labels):
                raise ValueError(f"source names must differ (got {labels}): set name: for each source")
        if self.chunk_isolate_documents and not self.concat_and_chunk:
            raise ValueError("chunk_isolate_documents needs concat_and_chunk: true")
        if self.concat_and_chunk and any(s.format != "text" for s in self.all_sources()):
            raise ValueError("concat_and_chunk applies to format: text only")
        if self.streaming and any(s.eval_fraction for s in self.all_sources()):
            raise ValueError("eval_fraction cannot split a stream: give eval_path (or eval_split) with streaming")
        return self

    def all_sources(self) -> list[SourceSection]:
        """The single-source form as one source, so the pipeline has one path."""
        if self.sources is not None:
            return self.sources
        columns = {"text": self.text_field, "messages": self.messages_field, **self.columns}
        return [SourceSection(path=self.path, format=self.format, name="train", split=self.split, subset=self.subset,
                              chat_prompt=self.chat_prompt, eval_path=self.eval_path, eval_split=self.eval_split,
                              eval_fraction=self.eval_fraction, system_prompt=self.system_prompt, columns=columns,
                              roles=self.roles, image_dir=self.image_dir)]


class TrainingSection(_Section):
    epochs: int = Field(1, ge=1, description="Passes over the training data (unless max_steps is set)")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides epochs (grpo: batches of "
                                  "prompts, each trained on rl.num_iterations times)")
    micro_batch_size: int = Field(1, ge=1, description="Sequences per device per forward (grpo: prompts, each with "
                                  "rl.num_generations completions)")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step: the global batch is "
                            "micro_batch_size x grad_accum x data-parallel processes")
    lr: float = Field(2e-5, gt=0, description="Peak learning rate")
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = Field(
        "cosine", description="The schedule, stepped once per optimizer step")
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Warm-up as a fraction of the optimizer steps")
    warmup_steps: int = Field(0, ge=0, description="Wins over warmup_ratio when > 0")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay (never on biases and norms)")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient norm (null: no clipping; "
                                        "the norm is logged either way)")
    optimizer: Literal["adamw", "adamw_8bit"] = Field("adamw", description="adamw_8bit: bitsandbytes' 8-bit "
                                                      "states (EXTRAS=test,quant)")
    adam_beta1: float = Field(0.9, description="AdamW beta1")
    adam_beta2: float = Field(0.999, description="AdamW beta2")
    adam_epsilon: float = Field(1e-8, description="AdamW epsilon")
    mixed_precision: Literal["no", "bf16", "fp16", "fp8"] = Field(
        "bf16", description="Autocast precision (no: the weights' dtype throughout); fp8: bf16 autocast with the "
        "aligned linear layers in float8 (torchao through accelerate; emulated on CPU; docs/strategies.md, 'FP8')")
    seed: int = Field(42, description="Seeds the data order, initialisation and dropout (resumed exactly)")
    eval_every: int | None = Field(None, ge=1, description="Optimizer steps between evaluations")
    stop_at_step: int | None = Field(None, ge=1, description="End this invocation at this step (checkpointed); "
                                     "the schedule still runs to the full length on resume")
    loss_impl: Literal["chunked", "plain", "trl"] = Field("chunked", description="chunked: the loss from the final "
                                                          "hidden states a chunk of target tokens at a time, in fp32, "
                                                          "never holding full-vocabulary logits; plain: transformers' "
                                                          "loss from the full logits; trl: TRL's fused LM head "
                                                          "(SFT only; needs trl; docs/benchmarks.md, 'Loss engines')")
    offload_activations: bool = Field(False, description="keep the activations saved for the backward pass in "
                                      "(pinned) host memory instead of GPU memory (torch.autograd.graph."
                                      "save_on_cpu): less GPU memory, slower steps (a copy each way per activation)")
    compile: bool = Field(False, description="torch.compile each repeated transformer block (regional "
                          "compilation through accelerate's TorchDynamoPlugin, inductor backend); proven under "
                          "one process, DDP and FSDP2, refused under the others unless DISTTRAIN_ALLOW_UNVERIFIED=1")
    pp_schedule: Literal["1f1b", "gpipe"] = Field("1f1b", description="Pipeline parallelism (fsdp_pp.yaml): the "
                                                  "schedule of each step's grad_accum micro-batches (torch.distributed."
                                                  "pipelining): 1f1b keeps at most PP micro-batches' activations per "
                                                  "stage, gpipe all of them; grad_accum >= PP keeps the bubble small")
    neftune_alpha: float | None = Field(None, gt=0, description="NEFTune: uniform noise of scale alpha / "
                                        "sqrt(seq x hidden) on the input embeddings while training (5 is usual)")
    objective: Literal["sft", "dpo", "grpo", "reward", "distill"] = Field(
        "sft", description="sft: learn the targets; dpo: preference tuning on {prompt, chosen, rejected} pairs (the "
        "preference section); grpo: online RL on prompts, completions generated by the policy and scored by rewards "
        "(the rl section, docs/rl.md); reward: a reward model (a scalar head) trained on the same pairs, "
        "Bradley-Terry (docs/rl.md); distill: a student matching a teacher's token distributions (the distill "
        "section, docs/distill.md)")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no_is_false(cls, value):
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false


class PreferenceSection(_Section):
    """training.objective: dpo. Losses as in TRL: sigmoid (DPO), ipo, hinge (with a reference), simpo and orpo
    (reference-free), kto (unpaired examples, with a reference)."""

    loss: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo", "kto"] = Field(
        "sigmoid", description="The DPO-family loss (each checked against TRL's); kto: KTO on examples judged one "
        "by one (data.format: unpaired, or preference pairs split in two; docs/preference.md)")
    beta: float = Field(0.1, gt=0, description="DPO/IPO/hinge/SimPO/KTO temperature; ORPO: the odds-ratio weight "
                        "lambda")
    desirable_weight: float = Field(1.0, gt=0, description="kto: the weight of desirable examples' losses (TRL's "
                                    "desirable_weight)")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: the weight of undesirable examples' losses")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="sigmoid and simpo: the probability that a "
                                   "pair's preference is flipped (conservative DPO)")
    simpo_gamma: float = Field(0.5, ge=0.0, description="SimPO's target reward margin gamma")
    reference: Literal["auto", "model", "precomputed", "none"] = Field(
        "auto", description="auto: LoRA -> the base model with the adapters disabled; full fine-tuning -> "
        "precomputed; simpo/orpo -> none. model: a frozen copy next to the policy. precomputed: one pass of "
        "reference log-probs before training, saved in output.dir")

    def reference_free(self) -> bool:
        return self.loss in ("simpo", "orpo")


class RewardModelSection(_Section):
    """training.objective: reward. The loss as TRL's RewardTrainer computes it: -log sigmoid(r_chosen - r_rejected)
    per pair, plus center_rewards_coefficient x (r_chosen + r_rejected)^2."""

    center_rewards_coefficient: float | None = Field(None, ge=0.0, description="Keeps the rewards centred on 0 "
                                                     "(Eisenstein et al. 2023 use 0.01); null: off")


class RewardSection(_Section):
    function: str | None = Field(None, description="`module:function` (a dotted module, e.g. "
                                 "trl.rewards:think_format_reward, or a .py file relative to the working directory, "
                                 "e.g. recipes/tiny/rewards.py:exact_answer), called as TRL calls reward functions: "
                                 "(prompts=, completions=, completion_ids=, **the dataset's other columns) -> one "
                                 "number (or None) per completion")
    model: str | None = Field(None, description="Instead of a function: a reward model (a local directory or Hub id "
                              "of a sequence-classification checkpoint with one label, e.g. the final/ of a "
                              "training.objective: reward run), scoring prompt + completion; held whole on every "
                              "rank, in eval mode")
    args: dict[str, Any] | None = Field(None, description="With function: the function is a factory, called "
                                        "with these keyword arguments to make the reward function (TRL's "
                                        "trl.rewards:get_soft_overlong_punishment with {max_completion_len: 256, "
                                        "soft_punish_cache: 64}, say)")
    weight: float = Field(1.0, description="Its weight in the summed reward")

    @model_validator(mode="after")
    def _one_scorer(self):
        if (self.function is None) == (self.model is None):
            raise ValueError("give function (module:function) or model (a reward model's directory), one of them")
        if self.args is not None and self.function is None:
            raise ValueError("args are given to a reward function factory (function:), not to a reward model")
        return self

    def label(self) -> str:
        """The reward's name in the metrics (rewards/<label>/mean)."""
        return self.function.rpartition(":")[2] if self.function else "reward_model"


class VLLMSection(_Section):
    """rl.engine: vllm -- a vLLM server (docs/rl.md, 'vLLM'; unverified on this project's machines)."""

    server: str = Field("http://localhost:8000", description="The server's base URL (started apart: "
                        "VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{\"backend\": \"nccl\"}' "
                        "--logprobs-mode processed_logprobs --max-logprobs -1, on GPUs of its own)")
    timeout_s: float = Field(240.0, ge=0, description="How long to wait for the server to answer at the start")
    group_port: int = Field(51216, ge=1, le=65535, description="The weight-transfer group's port (TRL's)")
    importance_sampling: Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate", "off"] = Field(
        "sequence_mask", description="The correction for the server's and the trainer's log-probs differing, as "
        "TRL's vllm_importance_sampling_mode computes it (off: none)")
    importance_sampling_min: float | None = Field(None, ge=0, description="Ratios below this are clipped (truncate) "
                                                  "or masked (mask); null: no lower bound")
    importance_sampling_max: float = Field(3.0, gt=0, description="Ratios above this are clipped or masked")


class RLSection(_Section):
    """training.objective: grpo. The policy-gradient losses as TRL 1.16's GRPOTrainer computes them."""

    loss: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"] = Field(
        "dapo", description="How token losses are aggregated (TRL's loss_type, each checked against TRL): grpo (mean "
        "per completion, then over completions), dr_grpo (sum / (completions x max_completion_length)), dapo (sum / "
        "completion tokens of the whole step, all ranks), bnpo (per micro-batch token mean), cispo (clipped "
        "importance weights, detached, times the log-prob; aggregated as dapo)")
    importance_sampling: Literal["token", "sequence"] = Field(
        "token", description="token: a ratio per token; sequence: one ratio per completion, the mean of its "
        "tokens' log-ratios (GSPO)")
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group its advantages "
                                 "are relative to); training.micro_batch_size counts prompts, so a micro-batch "
                                 "trains on micro_batch_size x num_generations completions")
    num_iterations: int = Field(1, ge=1, description="Optimizer steps on each batch of completions (mu); above 1 "
                                "the ratios are taken to the log-probs at generation (the old policy)")
    max_completion_length: int = Field(256, ge=1, description="Tokens generated per completion at most")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the log-probs trained on are taken at "
                               "it too, as TRL does")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus sampling")
    top_k: int | None = Field(None, ge=1, description="Top-k sampling (null: off)")
    min_p: float | None = Field(None, gt=0, lt=1.0, description="Min-p sampling: tokens below min_p x the most "
                                "likely token's probability are left out (null: off)")
    repetition_penalty: float = Field(1.0, gt=0, description="transformers' repetition penalty (1.0: off); the "
                                      "log-probs trained on do not include it, as in TRL")
    rows_per_generate: int | None = Field(None, ge=1, description="Completions sampled per generate() call at "
                                          "most (null: all of the step's on this rank in one call); lower it when "
                                          "the KV cache of the whole step does not fit. The samples do not depend "
                                          "on it")
    engine: Literal["generate", "static", "vllm"] = Field(
        "generate", description="What samples the completions: generate -> transformers' generate() with its "
        "dynamic KV cache, in the trainer; static -> the same with transformers' static KV cache, whose decode step "
        "transformers compiles on GPUs (on CPU processes nothing is compiled); vllm -> a vLLM server (rl.vllm), "
        "the weights pushed to it before each rollout (docs/rl.md)")
    vllm: VLLMSection = VLLMSection()
    generation_weights: Literal["auto", "whole", "per_layer"] = Field(
        "auto", description="FSDP2 and ZeRO-3 rollouts: whole -> the model gathered once per rollout (no "
        "collectives while decoding); per_layer -> each layer gathered for every generated token; auto -> whole "
        "when the gathered model and the KV cache fit in 90% of the device's free memory (docs/rl.md)")
    epsilon: float = Field(0.2, gt=0, description="Clipping: the ratio is kept within [1 - epsilon, 1 + "
                           "epsilon_high]")
    epsilon_high: float | None = Field(None, gt=0, description="The upper clip (null: epsilon; DAPO uses 0.28; "
                                       "cispo: the cap on the importance weight, 5.0 recommended)")
    beta: float = Field(0.0, ge=0.0, description="KL penalty to the reference (k3 estimator, as TRL); 0: no "
                        "reference")
    reference: Literal["auto", "model", "adapters"] = Field(
        "auto", description="With beta > 0: auto -> LoRA: the base model with the adapters disabled; full "
        "fine-tuning: a frozen copy of the initial weights, sharded like the policy (model)")
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = Field(
        "grpo", description="The advantage estimator: grpo (reward - its group's mean, scaled by scale_rewards), "
        "rloo (reward - the mean of its group's other completions, as TRL's RLOOTrainer), reinforce_pp "
        "(REINFORCE++-baseline: reward - its group's mean, whitened over every completion token of the step, as "
        "verl's reinforce_plus_plus_baseline)")
    scale_rewards: Literal["group", "batch", "none"] | None = Field(
        None, description="grpo: divided by the group's std (group, its default), the std of the step's rewards "
        "on all ranks (batch) or not at all (none, Dr. GRPO); rloo: batch whitens the step's advantages (TRL's "
        "normalize_advantages), none (its default) leaves them; reinforce_pp: batch (its default) whitens over "
        "the step's completion tokens, none leaves them")
    mask_truncated_completions: bool = Field(False, description="Completions cut at max_completion_length (no EOS) "
                                             "are left out of the loss")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus: minus this x the mean entropy of the "
                                "policy at the completion tokens of each micro-batch (as TRL's entropy_coef)")
    dynamic_sampling: int = Field(0, ge=0, description="DAPO's dynamic sampling: a prompt whose completions all "
                                  "got the same reward (no signal) is sampled again with fresh seeds, up to this "
                                  "many rounds per step (0: off); metrics: dynamic_sampling/resampled_groups")
    disable_dropout: bool = Field(True, description="Dropout off in the policy (LoRA's included): the completions, "
                                  "the old policy's log-probs and the trained ones then come from one distribution, "
                                  "and the first ratio of rl.num_iterations is exactly 1 (TRL's disable_dropout; "
                                  "its default is false)")
    rewards: list[RewardSection] = Field(default_factory=list, description="The reward functions and their "
                                         "weights: [{function: module:function, weight: 1.0}, ...]")
    tools: list[str] = Field(default_factory=list, description="Tools the policy may call during a rollout "
                             "(TRL's tools): [path.py:function, module:function], plain functions with type hints "
                             "and a Google-style docstring (their JSON schemas: transformers' get_json_schema), "
                             "listed to the model by its chat template; a call's result becomes a tool message the "
                             "policy continues from, never trained on (docs/rl.md, 'Agents')")
    environment: str | None = Field(None, description="A class (path.py:Class or module:Class) whose public methods "
                                    "are tools (TRL's environment_factory): one instance per completion, reset(**the "
                                    "prompt's record) before it (text it returns is appended to the last user turn), "
                                    "get_reward() -- when it has one -- a reward named after the class, weight 1")
    max_tool_calling_iterations: int | None = Field(None, ge=1, description="Tool-calling turns per completion at "
                                                    "most (null: until a turn without calls or "
                                                    "max_completion_length, counted over the whole trajectory)")
    tool_timeout: float = Field(10.0, gt=0, description="Seconds a tool call may take; one that takes longer, "
                                "raises or is called with unknown arguments becomes a tool message saying so (the "
                                "run goes on; metrics: tools/failures)")

    def agentic(self) -> bool:
        """Rollouts of several turns, with tools (rl.tools or rl.environment)."""
        return bool(self.tools) or self.environment is not None

    @model_validator(mode="after")
    def _scale_of_the_estimator(self):
        if self.advantage != "grpo" and self.scale_rewards == "group":
            raise ValueError(f"scale_rewards=group divides by each group's std, GRPO's scaling; with advantage="
                             f"{self.advantage} use batch or none")
        return self

    @property
    def reward_scale(self) -> str:
        """scale_rewards, or the estimator's own default when the recipe leaves it out."""
        default = {"grpo": "group", "rloo": "none", "reinforce_pp": "batch"}[self.advantage]
        return self.scale_rewards or default


class DistillSection(_Section):
    """training.objective: distill. Generalised knowledge distillation (GKD) as TRL's GKDTrainer computes it: the
    generalised Jensen-Shannon divergence between the student's and the teacher's next-token distributions at
    every completion token, on the dataset's completions, the student's own samples (lmbda) or the teacher's
    (seq_kd)."""

    teacher: str | None = Field(None, description="The teacher: a local directory or Hub id of a causal LM sharing "
                                "the student's tokenizer (a mismatch is refused before any weight loads); frozen, "
                                "sharded like the student")
    teacher_revision: str | None = Field(None, description="A Hub branch, tag or commit of the teacher")
    teacher_dtype: Literal["float32", "bfloat16", "float16", "auto"] | None = Field(
        None, description="The teacher's weights' dtype as loaded (null: model.dtype)")
    lmbda: float = Field(0.5, ge=0.0, le=1.0, description="The share of optimizer steps trained on completions the "
                         "student samples from the step's prompts (on-policy; TRL's lmbda, drawn per step from the "
                         "seed alike on every rank); the others train on the dataset's completions")
    beta: float = Field(0.5, ge=0.0, le=1.0, description="The generalised JSD's interpolation: 0 -> KL(teacher || "
                        "student) (forward KL), 1 -> KL(student || teacher) (reverse KL), between: beta KL(teacher || "
                        "m) + (1 - beta) KL(student || m), m = beta teacher + (1 - beta) student")
    temperature: float = Field(0.9, gt=0, description="Sampling temperature of the on-policy (and seq_kd) "
                               "completions (TRL's temperature)")
    loss_temperature: float = Field(1.0, gt=0, description="Both models' logits divided by this before the "
                                    "divergence (the temperature argument of TRL's generalized_jsd_loss; its "
                                    "trainer uses 1)")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus sampling of the sampled completions")
    top_k: int | None = Field(None, ge=1, description="Top-k sampling of the sampled completions (null: off)")
    max_completion_length: int = Field(128, ge=1, description="Tokens sampled per completion at most (TRL's "
                                       "max_new_tokens)")
    seq_kd: bool = Field(False, description="Steps that are not on-policy train on completions the teacher samples "
                         "(sequence-level KD) instead of the dataset's")
    rows_per_generate: int | None = Field(None, ge=1, description="Completions sampled per generate() call at most "
                                          "(null: all of the step's on this rank in one call)")

    def sampling(self):
        """The sampling settings as online RL's sampler reads them (rollout.py, sampling.py)."""
        return RLSection(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                         max_completion_length=self.max_completion_length, rows_per_generate=self.rows_per_generate)


class LoraSection(_Section):
    r: int = Field(16, ge=1, description="The adapters' rank (a lora section present = LoRA via peft)")
    alpha: int = Field(32, ge=1, description="Scaling: the update is alpha / r x B A")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the adapters' input")
    target_modules: list[str] | Literal["all-linear"] = Field("all-linear", description="Module names to adapt "
                                                              "(all-linear: every linear layer but the LM head)")
    target_parameters: list[str] | None = Field(
        None, description="parameters (not modules) to adapt, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj]: "
        "the experts of a mixture-of-experts block, which transformers stores fused as 3-D tensors (peft's "
        "target_parameters; needs dropout: 0 and no DoRA)")
    modules_to_save: list[str] | None = Field(None, description="Modules trained in full beside the adapters "
                                              "(e.g. embed_tokens after adding tokens)")
    merge_on_export: bool = Field(False, description="final/ holds the merged model instead of the adapter")
    use_dora: bool = Field(False, description="DoRA: a learned magnitude per output feature on top of LoRA")
    use_rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(r) instead of alpha / r")
    init_lora_weights: bool | Literal["gaussian"] = Field(True, description="true: B = 0 (the adapter starts as "
                                                            "a no-op); gaussian; false: random (tests only)")
    rank_pattern: dict[str, int] = Field(default_factory=dict, description="per-module ranks, e.g. {down_proj: 8}")
    alpha_pattern: dict[str, int] = Field(default_factory=dict, description="per-module alphas, like rank_pattern")

    @model_validator(mode="after")
    def _check_parameter_targets(self):
        # peft adapts a parameter as W + B A, so x cannot be dropped out before A (it raises mid-load otherwise)
        if self.target_parameters and (self.dropout or self.use_dora):
            raise ValueError("lora.target_parameters needs lora.dropout: 0 and no DoRA (peft adapts a parameter "
                             "directly, with no input to drop out or normalise)")
        return self


class LoggingSection(_Section):
    report_to: list[Literal["wandb", "tensorboard", "mlflow", "none"]] = Field(
        ["none"], description="Trackers beside metrics.jsonl: wandb (offline without an API key), tensorboard, "
        "mlflow (EXTRAS=test,mlflow; MLFLOW_TRACKING_URI says where)")
    every_steps: int = Field(10, ge=1, description="Optimizer steps per metrics line")
    project: str = Field("disttrain", description="The trackers' project name")
    run_name: str | None = Field(None, description="The trackers' run name (default: from output.dir)")
    samples: int = Field(2, ge=0, description="Prompts (the first eval rows) answered greedily at each evaluation "
                         "and at the end, logged to metrics.jsonl and the trackers (0: none)")
    sample_tokens: int = Field(24, ge=1, description="tokens generated per sample")


RUN_PLACEHOLDERS = ("strategy", "processes")


class OutputSection(_Section):
    dir: str = Field(description="Where the run writes; {strategy} (the accelerate config's name: single, ddp, "
                     "fsdp, hsdp, zero3, ...) and {processes} are filled in at launch, so runs of the same recipe "
                     "under other strategies or world sizes get their own directories")
    save_final_model: bool = Field(True, description="Export the trained model (or adapter) to final/ with its "
                                   "tokenizer and model card")
    checkpoint_every: int | None = Field(None, ge=1, description="Optimizer steps between checkpoints (beside "
                                         "checkpoint_minutes; null: none by step count)")
    checkpoint_minutes: float | None = Field(30.0, gt=0, description="Wall-clock minutes between checkpoints, "
                                             "counted from the start (or resume) and from each save: a crash loses "
                                             "at most this much training. null: only checkpoint_every and the end")
    checkpoint_at_end: bool = Field(True, description="A checkpoint after the last step too")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept on disk")
    report: bool = Field(True, description="At the end, the model card (final/README.md) and plots/ (rank 0, a few "
                         "seconds); off, `make report RUN=<dir>` writes them later from the run's files")
    resume: str = Field("auto", description="auto (newest in output.dir/checkpoints), none, or a checkpoint dir")
    push_to_hub: str | None = Field(None, description="a Hub repo id (org/name): the final model and its card are "
                                    "uploaded to a private repo at the end (a token is checked before training)")

    @field_validator("push_to_hub")
    @classmethod
    def _repo_id(cls, value: str | None) -> str | None:
        if value is not None and (value.count("/") != 1 or not all(value.split("/"))):
            raise ValueError(f"{value!r} is not a Hub repo id: give org/name (or user/name)")
        return value

    @field_validator("dir")
    @classmethod
    def _known_placeholders(cls, value: str) -> str:
        try:
            value.format(**{name: name for name in RUN_PLACEHOLDERS})
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"{value!r}: only {{strategy}} and {{processes}} can be filled in ({exc})") from None
        return value

    @model_validator(mode="after")
    def _push_needs_the_model(self):
        if self.push_to_hub and not self.save_final_model:
            raise ValueError("output.push_to_hub uploads the final model: it needs output.save_final_model: true")
        return self

    def for_run(self, strategy: str, processes: int) -> str:
        """The directory of this launch: the placeholders filled in."""
        return self.dir.format(strategy=strategy, processes=processes)


class EvaluationSection(_Section):
    """lm-evaluation-harness tasks scored during training, on the checkpoints it writes (off by default)."""
    tasks: list[str] = Field(default_factory=list, description="lm-eval task names (its registry or local YAMLs, as "
                             "`make eval TASKS=`); empty: no evaluation during training")
    every_steps: int | None = Field(None, ge=1, description="Score the checkpoint written at every multiple of this "
                                    "many steps (a multiple of output.checkpoint_every): the main process rebuilds "
                                    "the model from it while the other ranks wait")
    limit: int | None = Field(None, ge=1, description="At most this many examples per task: keep it cheap. "
                              "Scores land in metrics.jsonl as `lm_eval/<task>/<metric>` (docs/evaluation.md)")
    include: list[str] = Field(default_factory=list, description="Directories of your own task YAMLs")
    chat_template: Literal["auto", "yes", "no"] = Field("auto", description="Wrap prompts in the chat template "
                                                        "(auto: when the tokenizer has one)")
    batch_size: int | Literal["auto"] = Field(8, description="lm-eval's batch size (auto: it probes the largest)")
    wait_s: int = Field(21600, ge=1, description="How long the other ranks wait for the main process's scoring: "
                        "they poll the process group's store, outside any collective, so distributed.timeout_s "
                        "does not bound a long scoring")


class DistributedSection(_Section):
    timeout_s: int = Field(1800, ge=1, description="Process-group timeout: how long a rank waits in a collective "
                           "for the others (raise it when tokenising a huge dataset on the main process)")
    check_replicas_every: int | None = Field(200, ge=1, description="Optimizer steps between parameter checksum "
                                             "comparisons across ranks while weights are replicated (DDP, ZeRO-1/2)")
    loss_spread_warning: float | None = Field(0.5, gt=0, description="Warn when per-rank losses of a log window "
                                              "differ by more than this fraction of the mean loss")
    fsdp_sync_each_micro_batch: bool = Field(True, description="FSDP: reduce-scatter gradients after every "
                                             "micro-batch, so only the gradient shard is held between them. false "
                                             "skips the collective on non-final micro-batches but keeps every layer's "
                                             "unsharded gradient until the last one (+2-4 bytes/parameter per GPU, "
                                             "not divided by the world size)")
    fsdp_reduce_in_fp32: bool = Field(True, description="FSDP with bf16/fp16 mixed precision: reduce gradients "
                                      "in fp32, as DDP under autocast does (accelerate's default reduces in the "
                                      "low precision)")


class Recipe(_Section):
    model: ModelSection
    data: DataSection
    training: TrainingSection = TrainingSection()
    lora: LoraSection | None = None
    preference: PreferenceSection = PreferenceSection()
    rl: RLSection = RLSection()
    reward_model: RewardModelSection = RewardModelSection()
    distill: DistillSection = DistillSection()
    logging: LoggingSection = LoggingSection()
    distributed: DistributedSection = DistributedSection()
    evaluation: EvaluationSection = EvaluationSection()
    output: OutputSection

    @model_validator(mode="after")
    def _check_cross_fields(self) -> Recipe:
        if self.model.quantization and self.lora is None:
            raise ValueError("model.quantization needs a lora section: quantized base weights cannot be trained")
        self._check_objective()
        self._check_evaluation()
        self._check_adapted_head()
        if self.data.streaming and self.training.max_steps is None:
            raise ValueError("data.streaming: true needs training.max_steps (a stream has no length to count "
                             "epochs in)")
        return self


    def _check_adapted_head(self) -> None:
        """LoRA (or modules_to_save) on lm_head wraps it: the chunked and TRL loss engines read lm_head as a plain
        Linear; said here, before anything loads (it was a TypeError traceback after the model loaded)."""
        lora = self.lora
        targets = [*(lora.target_modules if lora and isinstance(lora.target_modules, list) else []),
                   *(lora.modules_to_save or [] if lora else [])]
        if "lm_head" in targets and self.training.loss_impl != "plain":
            raise ValueError(f"lora adapts lm_head, which training.loss_impl={self.training.loss_impl} reads as a "
                             "plain Linear: remove lm_head from lora.target_modules / modules_to_save, or set "
                             "training.loss_impl: plain")

    def _check_evaluation(self) -> None:
        every, saved = self.evaluation.every_steps, self.output.checkpoint_every
        if self.evaluation.tasks and every is None:
            raise ValueError("evaluation.tasks is set: give evaluation.every_steps too (a multiple of "
                             "output.checkpoint_every), or use `make eval` after the run")
        if every is not None and (saved is None or every % saved):
            raise ValueError(f"evaluation.every_steps={every} scores the checkpoints training writes: it must be a "
                             f"multiple of output.checkpoint_every (now {saved})")

    def _check_objective(self) -> None:
        formats = [s.format for s in self.data.all_sources()]
        objective = self.training.objective
        kto = objective == "dpo" and self.preference.loss == "kto"
        self.data._unpaired = kto
        pairs = [f == "preference" for f in formats]
        if objective not in ("dpo", "reward") and any(pairs):
            raise ValueError("data.format: preference holds {prompt, chosen, rejected} pairs: set "
                             "training.objective: dpo or reward (or give SFT data)")
        if not kto and "unpaired" in formats:
            raise ValueError("data.format: unpaired holds {prompt, completion, label} examples judged one by one: set "
                             "training.objective: dpo with preference.loss: kto (or give preference pairs)")
        if objective not in ("grpo", "distill") and "prompt" in formats:
            raise ValueError("data.format: prompt holds prompts without answers: set training.objective: grpo (online "
                             "RL, docs/rl.md) or distill, or give data with answers")
        if objective == "grpo":
            self._check_rl(formats)
        if objective == "distill":
            self._check_distill(formats)
        if objective == "reward":
            self._check_reward_model(pairs)
        if objective != "dpo":
            return
        if kto:
            self._check_unpaired(formats)
        else:
            self._check_pairs(pairs)
        if self.training.loss_impl != "chunked":
            raise ValueError("training.objective: dpo computes its log-probs with the chunked loss: remove "
                             f"training.loss_impl: {self.training.loss_impl}")
        pref = self.preference
        if pref.reference_free() and pref.reference not in ("auto", "none"):
            raise ValueError(f"preference.loss: {pref.loss} is reference-free: set preference.reference: auto or none")
        if not pref.reference_free() and pref.reference == "none":
            raise ValueError(f"preference.loss: {pref.loss} compares the policy with a reference: set "
                             "preference.reference to auto, model or precomputed (or use loss simpo / orpo)")
        if pref.reference == "model" and self.lora is not None:
            raise ValueError("preference.reference: model with LoRA would hold a second copy of the base model; "
                             "use auto (the base model with the adapters disabled is the reference)")

    def _check_rl(self, formats: list[str]) -> None:
        rl = self.rl
        if any(f != "prompt" for f in formats):
            raise ValueError("training.objective: grpo needs data.format: prompt (a `prompt` column: a string or chat "
                             "messages ending with the user's turn) for every source")
        if not rl.rewards and rl.environment is None:
            raise ValueError("training.objective: grpo needs rl.rewards: at least one {function: module:function, "
                             "weight: 1.0} (docs/rl.md), or an rl.environment with get_reward()")
        if rl.agentic() and rl.engine == "vllm":
            raise ValueError("rl.tools / rl.environment run their turns in the trainer's generate(): rl.engine: vllm "
                             "is not built for them yet; use rl.engine: generate")
        if self.data.streaming:
            raise ValueError("training.objective: grpo generates its own rows: data.streaming does not apply (remove "
                             "it; data.packing makes the rollouts' training rows padding-free)")
        if self.training.loss_impl != "chunked":
            raise ValueError("training.objective: grpo computes its log-probs with the chunked loss: remove "
                             f"training.loss_impl: {self.training.loss_impl}")
        if any(s.eval_path or s.eval_split or s.eval_fraction for s in self.data.all_sources()) or \
                self.training.eval_every:
            raise ValueError("training.objective: grpo has no held-out evaluation yet: remove data.eval_path / "
                             "eval_split / eval_fraction and training.eval_every (the rewards of every step are in "
                             "metrics.jsonl)")
        if rl.engine == "vllm" and self.lora is not None and (self.lora.use_dora or self.lora.target_parameters):
            raise ValueError("rl.engine: vllm pushes each weight with LoRA's update added (W + B A): DoRA and "
                             "lora.target_parameters are not pushed yet; use rl.engine: generate")
        if rl.beta > 0 and rl.reference == "adapters" and self.lora is None:
            raise ValueError("rl.reference: adapters needs a lora section (the base model with the adapters disabled "
                             "is the reference); use auto or model")
        if rl.beta > 0 and rl.reference == "model" and self.lora is not None:
            raise ValueError("rl.reference: model with LoRA would hold a second copy of the base model; use auto "
                             "(the base model with the adapters disabled is the reference)")

    def _check_distill(self, formats: list[str]) -> None:
        d = self.distill
        if not d.teacher:
            raise ValueError("training.objective: distill needs distill.teacher: the teacher's directory or Hub id "
                             "(docs/distill.md)")
        prompts = [f == "prompt" for f in formats]
        if any(prompts) and not all(prompts):
            raise ValueError("training.objective: distill reads either prompts (data.format: prompt) or records with "
                             "answers (chat, alpaca, sharegpt) in one run, not both: give every source one kind")
        if all(prompts) and d.lmbda < 1 and not d.seq_kd:
            raise ValueError(f"data.format: prompt has no completions to distil on: set distill.lmbda: 1 (the "
                             f"student samples them; now {d.lmbda}) or distill.seq_kd: true (the teacher does)")
        if "text" in formats and (d.lmbda > 0 or d.seq_kd):
            raise ValueError("data.format: text has no prompt to sample a completion from: set distill.lmbda: 0 and "
                             "distill.seq_kd: false (the text's own tokens), or give prompts or chat records")
        if self.data.packing or self.data.concat_and_chunk or self.data.streaming:
            raise ValueError("training.objective: distill samples completions in place of rows' answers: "
                             "data.packing, concat_and_chunk and streaming are not supported with it (remove them)")
        if self.training.loss_impl != "chunked":
            raise ValueError("training.objective: distill computes its divergence with the chunked loss: remove "
                             f"training.loss_impl: {self.training.loss_impl}")
        if all(prompts) and (any(s.eval_path or s.eval_split or s.eval_fraction for s in self.data.all_sources())
                             or self.training.eval_every):
            raise ValueError("training.objective: distill on prompts has no held-out answers to evaluate: remove "
                             "data.eval_path / eval_split / eval_fraction and training.eval_every (the divergence "
                             "of every step is in metrics.jsonl)")
        if any(s.image_dir for s in self.data.all_sources()):
            raise ValueError("training.objective: distill is built for text models: remove data.image_dir")

    def _check_pairs(self, pairs: list[bool]) -> None:
        """What the pair objectives (dpo, reward) need of their data: pairs, chosen and rejected side by side
        (padding-free with data.packing)."""
        objective = self.training.objective
        if not all(pairs):
            raise ValueError(f"training.objective: {objective} needs data.format: preference ({{prompt, chosen, "
                             "rejected} records) for every source")
        if self.data.concat_and_chunk or self.data.streaming:
            raise ValueError(f"training.objective: {objective} keeps each pair's chosen and rejected side by side in "
                             "one micro-batch: concat_and_chunk and streaming are not supported with it (data.packing "
                             "is: padding-free pairs)")

    def _check_unpaired(self, formats: list[str]) -> None:
        """preference.loss: kto -- examples judged one by one: unpaired records, or pairs split in two."""
        if any(f not in ("unpaired", "preference") for f in formats):
            raise ValueError("preference.loss: kto needs data.format: unpaired ({prompt, completion, label} records) "
                             "or preference (pairs, split into a desirable and an undesirable example) for every "
                             "source")
        if self.data.concat_and_chunk or self.data.streaming:
            raise ValueError("preference.loss: kto pairs each example with another's response for its KL estimate: "
                             "concat_and_chunk and streaming are not supported with it (data.packing is: "
                             "padding-free batches)")

    def _check_reward_model(self, pairs: list[bool]) -> None:
        self._check_pairs(pairs)
        if self.training.loss_impl != "chunked":
            raise ValueError(f"training.loss_impl: {self.training.loss_impl} does not apply to training.objective: "
                             "reward (its head is one score, not the vocabulary): remove it")
        if self.evaluation.tasks:
            raise ValueError("training.objective: reward trains a scoring model, which generates no text for lm-eval "
                             "to score: remove evaluation.tasks (its eval sets report pair accuracy)")

    def generates_text(self) -> bool:
        """Whether the trained model is a language model (samples, lm-eval); a reward model scores instead (its
        logging.samples are ignored)."""
        return self.training.objective != "reward"

    def rl_reference(self) -> str:
        """What the GRPO reference is in this run: none (beta 0), adapters (LoRA: adapters disabled), model."""
        if self.rl.beta == 0:
            return "none"
        if self.rl.reference == "auto":
            return "adapters" if self.lora is not None else "model"
        return self.rl.reference

    def for_launch(self, strategy: str, processes: int) -> Recipe:
        """This recipe with output.dir's {strategy} and {processes} filled in for the running launch."""
        output = self.output.model_copy(update={"dir": self.output.for_run(strategy, processes)})
        return self.model_copy(update={"output": output})

    def reference_mode(self) -> str:
        """What the reference is in this run: none, adapters (LoRA: adapters disabled), precomputed, model."""
        pref = self.preference
        if pref.reference_free():
            return "none"
        if pref.reference == "auto":
            return "adapters" if self.lora is not None else "precomputed"
        return pref.reference


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """`a.b.c=v`; a number indexes a list (`data.sources.1.weight=2`)."""
    node = tree
    *parents, leaf = dotted.split(".")
    for key in parents:
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise RecipeError(f"override {dotted!r}: {key!r} is not an index of the {len(node)} items there")
            child = node[int(key)]
        else:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
        if not isinstance(child, (dict, list)):
            raise RecipeError(f"override {dotted!r}: {key!r} is a value, not a section")
        node = child
    if isinstance(node, list):
        if not leaf.isdigit() or int(leaf) >= len(node):
            raise RecipeError(f"override {dotted!r}: {leaf!r} is not an index of the {len(node)} items there")
        node[int(leaf)] = value
    else:
        node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`training.lr=1e-4` -> ("training.lr", 1e-4). Values are YAML, so lists and null work too."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {text!r}: expected key.path=value, e.g. training.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else "?"
        raise RecipeError(f"{path}:{line}: invalid YAML: {exc.problem}") from None
    if not isinstance(tree, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping with sections model/data/training/output")
    return tree


def _describe(error: dict, overridden: set[str]) -> str:
    key = ".".join(str(p) for p in error["loc"]) or "(top level)"
    where = " (set on the command line)" if key in overridden else ""
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown key; check the spelling against the recipe fields in docs/recipes.md"
    elif "input" in error and error["type"] != "missing" and not isinstance(error["input"], dict):
        message += f" (got {error['input']!r})"
    return f"{key}{where}: {message}"


def looks_local(path: str) -> bool:
    return path.endswith(LOCAL_DATA_SUFFIXES) or os.path.sep in path and os.path.exists(path)


def _check_files(recipe: Recipe, source: Path) -> None:
    files = [("data.path", recipe.data.path), ("data.eval_path", recipe.data.eval_path)]
    for i, src in enumerate(recipe.data.sources or []):
        files += [(f"data.sources.{i}.path", src.path), (f"data.sources.{i}.eval_path", src.eval_path)]
    for key, value in files:
        if not (value and value.endswith(LOCAL_DATA_SUFFIXES)):
            continue
        if glob.has_magic(value) and not glob.glob(value):
            raise RecipeError(f"{source}: {key}: the pattern {value!r} matches no file (paths are relative to the "
                              f"directory you run from: {os.getcwd()})")
        if not glob.has_magic(value) and not Path(value).is_file():
            raise RecipeError(f"{source}: {key}: data file {value!r} not found (paths are relative to the "
                              f"directory you run from: {os.getcwd()})")
    local_model = recipe.model.name_or_path.startswith((".", "/")) or Path(recipe.model.name_or_path).exists()
    if local_model and not (Path(recipe.model.name_or_path) / "config.json").is_file():
        raise RecipeError(f"{source}: model.name_or_path: {recipe.model.name_or_path!r} has no config.json "
                          "(for the tiny default model run `make tiny` first)")


def load_recipe(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    source = Path(path)
    tree = _read_yaml(source)
    overridden = set()
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
        overridden.add(key)
    try:
        recipe = Recipe.model_validate(tree)
    except ValidationError as exc:
        problems = "; ".join(_describe(e, overridden) for e in exc.errors())
        raise RecipeError(f"{source}: {problems}") from None
    _check_files(recipe, source)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    """Plain dict for trackers and the run's saved copy of its recipe."""
    return recipe.model_dump(mode="json")


def flat_fields(tree: dict, prefix: str = "") -> dict:
    """A nested recipe dict as {'section.field': value}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flat_fields(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
