"""The compatibility matrix: every recipe feature that changes a run x every shipped accelerate config.

Each cell is exactly one of:
- Proven: the named tests train it under that config and compare it with one process (losses per step, eval,
  exported weights; for stochastic features, replicas identical every step and the losses of one process
  within the stated tolerance);
- Refused: disttrain/recipe/compat.py stops it in one line before the model's weights load;
- NeedsGpu: refused in one line on a machine without a CUDA GPU (bitsandbytes, fp16); on a GPU it runs,
  not yet verified there (the acceptance item that checks it is named).

This module is the one declaration: docs/compatibility.md is generated from it (`make matrix`), and
tests/test_matrix.py proves every cell (each Refused cell through the checks train.py runs, each Proven cell's
tests exist in the suite and run in CI, each feature run launches what its column's cells claim).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """One shipped accelerate config at the mesh the suite launches it on."""
    config: str  # accelerate_configs/<config>.yaml
    title: str
    processes: int
    data_ranks: int  # processes reading different rows (the rest share a batch: sp, cp, tp groups)
    strategy: str  # what compat checks see: single, ddp, fsdp, deepspeed
    sp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism: its runs use the tiny mixture of experts (a dense model is refused)
    fsdp_data: tuple[int, int] = (1, 1)
    pp: int = 1  # pipeline stages (each over fsdp_data's shards)


COLUMNS = (
    Column("single_gpu", "make train (1 process)", 1, 1, "single"),
    Column("ddp", "DDP", 2, 2, "ddp"),
    Column("fsdp", "FSDP2", 2, 2, "fsdp"),
    Column("fsdp_offload", "FSDP2 + offload", 2, 2, "fsdp"),
    Column("hsdp", "HSDP (2 x 2)", 4, 4, "fsdp"),
    Column("zero1", "ZeRO-1", 2, 2, "deepspeed"),
    Column("zero2", "ZeRO-2", 2, 2, "deepspeed"),
    Column("zero3", "ZeRO-3", 2, 2, "deepspeed"),
    Column("zero3_offload", "ZeRO-3 + offload", 2, 2, "deepspeed"),
    Column("zero3_ulysses", "ZeRO-3 + Ulysses (sp 2)", 2, 1, "deepspeed", sp=2),
    Column("fsdp_cp", "FSDP2 + CP (cp 2)", 2, 1, "fsdp", cp=2),
    Column("tp", "TP (tp 2)", 2, 1, "ddp", tp=2),
    Column("fsdp_tp", "FSDP2 + TP (2 x tp 2)", 4, 2, "ddp", tp=2, fsdp_data=(1, 2)),
    Column("fsdp_ep", "FSDP2 + EP (ep 2)", 2, 2, "ddp", ep=2, fsdp_data=(1, 2)),
    Column("fsdp_pp", "FSDP2 + PP (pp 2 x 2)", 4, 2, "ddp", fsdp_data=(1, 2), pp=2),
)
CONFIGS = tuple(c.config for c in COLUMNS)


@dataclass(frozen=True)
class Feature:
    key: str
    title: str
    overrides: tuple[str, ...]  # recipe overrides that turn it on (over recipes/tiny/sft.yaml)
    moe: bool = False  # needs a mixture-of-experts model (its refusals read the model's config)
    vision: bool = False  # needs a vision-language model (the tiny Gemma-3-shaped one)


@dataclass(frozen=True)
class Proven:
    tests: tuple[str, ...]  # pytest node ids (tests/...::name[id]); "run:<kind>" = tests/test_matrix.py's feature run
    note: str = ""


@dataclass(frozen=True)
class Refused:
    says: str  # a part of the one-line error
    on_gpu: bool = False  # the refusal is the one a GPU machine gets (on a CPU the GPU-only one comes first)


@dataclass(frozen=True)
class NeedsGpu:
    acceptance: str | None  # scripts/gpu/acceptance.py item that verifies it on a GPU (None: none yet)


Cell = Proven | Refused | NeedsGpu

# The feature runs of tests/test_matrix.py: one launch per config with every feature of the kind that the
# config's column marks "run:<kind>" (features whose overrides never touch the same recipe field), against one
# process on the same recipe: `adapters`, `full`, `preference` to the strategy matrix's tolerances;
# `noise` (stochastic) with replicas compared every step and losses within NOISE_TOLERANCE. In the one-process
# column the run is the reference itself: its cells say the features run there.
RUN_KINDS = ("adapters", "full", "noise", "preference", "rl", "reward", "vision", "distill")
NOISE_TOLERANCE = 0.05

FEATURES = (
    Feature("full", "full fine-tuning", ()),
    Feature("lora", "LoRA (dropout 0)", ("lora.r=8", "lora.dropout=0")),
    Feature("lora_dropout", "LoRA, dropout > 0 (stochastic)", ("lora.r=8", "lora.dropout=0.1")),
    Feature("dora", "DoRA", ("lora.r=8", "lora.dropout=0", "lora.use_dora=true")),
    Feature("rslora", "rsLoRA", ("lora.r=8", "lora.dropout=0", "lora.use_rslora=true")),
    Feature("expert_lora", "LoRA on fused experts (target_parameters)",
            ("lora.r=8", "lora.dropout=0", "lora.target_modules=[q_proj]",
             "lora.target_parameters=[mlp.experts.gate_up_proj]"), moe=True),
    Feature("qlora", "QLoRA (4-bit base)", ("lora.r=8", "model.quantization=4bit")),
    Feature("neftune", "NEFTune (stochastic)", ("training.neftune_alpha=5",)),
    Feature("packing", "packing", ("data.packing=true",)),
    Feature("concat_chunk", "concat-and-chunk (text)",
            ("data.path=data/tiny_text.jsonl", "data.format=text", "data.eval_path=null",
             "data.concat_and_chunk=true")),
    Feature("chunk_isolation", "chunk isolation (text)",
            ("data.path=data/tiny_text.jsonl", "data.format=text", "data.eval_path=null", "data.concat_and_chunk=true",
             "data.chunk_isolate_documents=true")),
    Feature("streaming", "streaming", ("data.streaming=true", "training.max_steps=4")),
    Feature("mixture", "mixtures (data.sources)",
            ("data.path=null", "data.format=null", "data.eval_path=null",
             "data.sources=[{path: data/tiny_alpaca.jsonl, format: alpaca, weight: 2}, "
             "{path: data/tiny_chat.jsonl, format: chat, eval_fraction: 0.1}]")),
    Feature("dpo", "DPO with a reference (full: precomputed, LoRA: adapters off)",
            ("training.objective=dpo", "data.path=data/tiny_dpo.jsonl", "data.format=preference",
             "data.eval_path=null", "training.max_steps=2")),
    # its runs share the preference runs' recipe (the pairs, split in two); PREFERENCE_LOSS sets kto there
    Feature("kto", "KTO: unpaired examples, each with a KL partner (full: precomputed, LoRA: adapters off)",
            ("training.objective=dpo", "data.path=data/tiny_dpo.jsonl", "data.format=preference",
             "data.eval_path=null", "training.max_steps=2")),
    Feature("dpo_padding_free", "padding-free pairs (data.packing; KTO: here under zero2, zero3_offload, its "
                                "row's ddp, hsdp, zero3; reward models: their row's variants)",
            ("training.objective=dpo", "data.path=data/tiny_dpo.jsonl", "data.format=preference",
             "data.eval_path=null", "training.max_steps=2", "data.packing=true")),
    Feature("dpo_losses", "preference losses: ipo, hinge, simpo, orpo, kto",
            ("training.objective=dpo", "data.path=data/tiny_dpo.jsonl", "data.format=preference",
             "data.eval_path=null", "training.max_steps=2", "preference.loss=ipo")),
    Feature("grpo", "online RL: GRPO family (rollouts, rewards; the variants below)",
            ("training.objective=grpo", "data.path=data/tiny_prompts.jsonl", "data.format=prompt",
             "data.eval_path=null",
             "rl.rewards=[{function: recipes/tiny/rewards.py:letters}, "
             "{function: recipes/tiny/rewards.py:answer_words, weight: 0.5}]",
             "rl.num_generations=4", "rl.max_completion_length=8")),
    Feature("agent", "online RL with tools: multi-turn rollouts (rl.tools, rl.environment)",
            ("training.objective=grpo", "data.path=data/tiny_tool_prompts.jsonl", "data.format=prompt",
             "data.eval_path=null", "data.max_seq_len=320", "rl.tools=[recipes/tiny/tools.py:lookup]",
             "rl.rewards=[{function: recipes/tiny/tools.py:code_answer}]", "rl.num_generations=4",
             "rl.max_completion_length=96")),
    Feature("reward_model", "reward-model training (a score head, Bradley-Terry; the variants below)",
            ("training.objective=reward", "data.path=data/tiny_dpo.jsonl", "data.format=preference",
             "data.eval_path=data/tiny_dpo_eval.jsonl", "training.eval_every=2")),
    # the feature runs' teacher: the one-layer student model, unlike the tiny model it teaches (same tokenizer)
    Feature("distill", "distillation (GKD: a teacher's distributions, on-policy samples)",
            ("training.objective=distill", "distill.teacher=artifacts/tiny-student", "distill.lmbda=0.5",
             "distill.max_completion_length=8", "training.eval_every=2")),
    Feature("vlm", "vision-language SFT (images; the variants below)",
            ("data.path=data/tiny_vlm_mixed.jsonl", "data.format=chat", "data.eval_path=data/tiny_vlm_eval.jsonl",
             "data.max_seq_len=64", "training.eval_every=2"), vision=True),
    Feature("scoring", "evaluation during training (lm-eval)",
            ("output.checkpoint_every=4", "evaluation.tasks=[disttrain_tiny_choice]", "evaluation.every_steps=4",
             "evaluation.limit=5")),
    Feature("samples", "end-of-run samples", ("logging.samples=1", "logging.sample_tokens=8")),
    Feature("compile", "training.compile (regional)", ("training.compile=true",)),
    Feature("grad_ckpt", "gradient checkpointing", ("model.gradient_checkpointing=true",)),
    Feature("router_loss", "MoE router loss", ("model.router_aux_loss_coef=0.01",), moe=True),
    Feature("router_global", "MoE router loss over every rank's rows (router_balance: global)",
            ("model.router_aux_loss_coef=0.01", "model.router_balance=global"), moe=True),
    Feature("loss_plain", "loss_impl: plain", ("training.loss_impl=plain",)),
    Feature("loss_trl", "loss_impl: trl (TRL's fused head)", ("training.loss_impl=trl",)),
    Feature("bf16", "bf16 mixed precision", ("training.mixed_precision=bf16",)),
    Feature("fp16", "fp16 mixed precision", ("training.mixed_precision=fp16",)),
    Feature("fp8", "fp8 (torchao's float8 layers; emulated on CPU)", ("training.mixed_precision=fp8",)),
    Feature("eval_sets", "eval sets (eval_path, eval_every)", ("training.eval_every=2",)),
    Feature("adamw_8bit", "8-bit AdamW (bitsandbytes)", ("training.optimizer=adamw_8bit",)),
    Feature("offload_activations", "offload_activations", ("training.offload_activations=true",)),
    # a save at every step: the clock's flag agreed in the step's all-reduce under every mesh
    Feature("time_checkpoints", "checkpoints by time (output.checkpoint_minutes)",
            ("output.checkpoint_minutes=0.000001", "output.keep_last=8")),
)
FEATURE = {f.key: f for f in FEATURES}

# ----------------------------------------------------------------------------------------------- the cells
S = "tests/test_strategies.py::test_strategy_matches_single_process"
PF = "tests/test_preflight.py"
TPT = "tests/test_tensor_parallel.py"
FTP = "tests/test_fsdp_tp.py"
ULY = "tests/test_ulysses.py"
CPT = "tests/test_context_parallel.py"
PREF = "tests/test_preference_launch.py"
KTO = "tests/test_kto_launch.py"
DISTILL = ("tests/test_distill_launch.py::"
           "test_on_policy_distillation_trains_like_one_process_and_learns_the_teachers_task")
AGENT = "tests/test_agent_launch.py::test_rollouts_with_a_tool_train_like_one_process"
MOE_OTHER = f"{PF}::test_moe_recipes_train_like_one_process_under_the_other_strategies"
MOE_RESUME = f"{PF}::test_moe_recipes_train_like_one_process_across_their_resume"
COMPILE = "tests/test_compile.py::test_compiled_run_matches_eager_losses_without_recompiles"
FP8 = "tests/test_fp8.py"

ZERO = ("zero1", "zero2", "zero3", "zero3_offload")
FSDP_FAMILY = ("fsdp", "fsdp_offload", "hsdp")
DATA_PARALLEL = ("ddp", *FSDP_FAMILY, *ZERO)  # every process a data rank
SEQUENCE = ("zero3_ulysses", "fsdp_cp")
TENSOR = ("tp", "fsdp_tp")
EPT = "tests/test_expert_parallel.py"
EP_PREFLIGHT = f"{EPT}::test_shipped_moe_recipes_preflight_under_expert_parallelism_and_train_like_ddp"
EP_REFUSAL = "is not supported under expert parallelism"
ALL_LINEAR_ON_EXPERTS = "lora.target_modules=all-linear on"


def _run(kind: str, note: str = "") -> Proven:
    return Proven((f"run:{kind}",), note)


def _each(configs, cell_for) -> dict[str, Cell]:
    return {config: cell_for(config) for config in configs}


ULYSSES_OR_CP = "is not supported under accelerate_configs/"
# The preference runs take the losses in turn (pairwise coverage: each loss under some config, every config under
# some loss; each loss equals TRL's in tests/test_preference.py; the sigmoid loss is the DPO tests' own).
# kto there: LoRA (the adapters-off reference) on pairs split in two.
PREFERENCE_LOSS = {"single_gpu": "orpo", "ddp": "ipo", "fsdp": "hinge", "fsdp_offload": "kto", "hsdp": "ipo",
                   "zero1": "orpo", "zero2": "kto", "zero3": "simpo", "zero3_offload": "kto"}
# padding-free rows (data.packing): a reward model's pairs, the score read at each sequence's last token; online RL's
# training rows (tests/test_padding_free.py: equal to the padded ones)
PADDING_FREE = ("data.packing=true",)
# The online-RL runs take the loss variants in turn (pairwise coverage: each variant under some config, every
# data-parallel config under some variant; each loss equals TRL's in tests/test_policy_loss.py; padded or
# padding-free rows). Each is compared with one process running the same variant.
RL_VARIANT = {
    "single_gpu": ("rl.loss=dapo", "rl.epsilon_high=0.28"),
    # KL to the adapters-off reference; RLOO's leave-one-out baseline
    "ddp": ("rl.loss=dapo", "rl.beta=0.05", "lora.r=8", "lora.dropout=0", "rl.advantage=rloo", *PADDING_FREE),
    "fsdp": ("rl.loss=grpo", "rl.beta=0.05", *PADDING_FREE),  # KL to a frozen copy sharded by FSDP2
    # the rollouts' per-layer gathers (a model too large to gather whole), with a sampling filter each; under
    # FSDP2 also DAPO's resampling in several generate calls (ranks redrawing different numbers of groups agree
    # on the calls: generate() is synced there)
    "fsdp_offload": ("rl.loss=cispo", "rl.epsilon_high=2.0", "rl.entropy_coef=0.05", "rl.generation_weights=per_layer",
                     "rl.top_k=20", "rl.dynamic_sampling=2", "rl.rows_per_generate=3",
                     "rl.rewards=[{function: recipes/tiny/rewards.py:starts_with_a_word}, "
                     "{function: recipes/tiny/rewards.py:answer_words, weight: 0.0}]"),
    # DAPO's resampling, on a coarse reward whose groups often score alike (answer_words logged, weighed 0);
    # REINFORCE++-baseline's whitening over the tokens trained on (truncated completions left out) of 4 processes;
    # a LoRA policy under FSDP2 (its first forward a rollout entering below the root)
    "hsdp": ("rl.loss=bnpo", "rl.mask_truncated_completions=true", "rl.dynamic_sampling=2", "rl.advantage=reinforce_pp",
             "lora.r=8", "lora.dropout=0",
             "rl.rewards=[{function: recipes/tiny/rewards.py:starts_with_a_word}, "
             "{function: recipes/tiny/rewards.py:answer_words, weight: 0.0}]"),
    "zero1": ("rl.loss=dr_grpo", "rl.scale_rewards=batch", "rl.entropy_coef=0.05", "rl.repetition_penalty=1.3"),
    "zero2": ("rl.loss=grpo", "rl.importance_sampling=sequence", "rl.epsilon=0.0003", "rl.epsilon_high=0.0004",
              "rl.rows_per_generate=3"),
    # the old policy (its padding-free rows saved with the checkpoint between iterations); a ZeRO-3 frozen copy
    "zero3": ("rl.loss=dapo", "rl.num_iterations=2", "rl.beta=0.05", *PADDING_FREE),
    "zero3_offload": ("rl.loss=dapo", "rl.scale_rewards=none", "rl.temperature=0.8", "rl.generation_weights=per_layer",
                      "rl.min_p=0.05"),
}
# The reward-model runs: full or LoRA (the score head trained in full beside the adapters), the centring term on
# or off, padded or padding-free, in turn (padding-free == padded: tests/test_padding_free.py).
REWARD_VARIANT = {
    "single_gpu": (), "ddp": ("lora.r=8", "lora.dropout=0", *PADDING_FREE),
    "fsdp": ("reward_model.center_rewards_coefficient=0.01", *PADDING_FREE),
    "fsdp_offload": ("lora.r=8", "lora.dropout=0", "reward_model.center_rewards_coefficient=0.01"),
    "hsdp": ("lora.r=8", "lora.dropout=0"), "zero1": ("reward_model.center_rewards_coefficient=0.01",),
    "zero2": ("lora.r=8", "lora.dropout=0", *PADDING_FREE),
    "zero3": ("reward_model.center_rewards_coefficient=0.01", *PADDING_FREE),
    "zero3_offload": ("lora.r=8", "lora.dropout=0"),
}
# The vision-language runs: the image encoder frozen (the default), LoRA on the language model and projector, or
# every part trained, in turn; each compared with one process running the same variant.
VISION_VARIANT = {
    "single_gpu": (), "ddp": (), "fsdp": (), "fsdp_offload": ("model.freeze=[]",),
    "hsdp": ("lora.r=8", "lora.dropout=0"), "zero1": ("model.freeze=[]",), "zero2": ("lora.r=8", "lora.dropout=0"),
    "zero3": (), "zero3_offload": ("model.freeze=[]",),
}
# The distillation feature runs (the row's ddp, fsdp, zero3 cells: tests/test_distill_launch.py's 80-step runs):
# each step on the student's samples or, per distill.lmbda's draw, the teacher's (seq_kd: the frozen teacher
# sampling) or the dataset's answers (lmbda 0); a LoRA student; the divergence forward or reverse; each compared
# with one process running the same variant (configs sharing a variant share that reference).
DISTILL_VARIANT = {
    "fsdp_offload": ("distill.seq_kd=true",), "zero3_offload": ("distill.seq_kd=true",),
    "hsdp": ("lora.r=8", "lora.dropout=0", "distill.lmbda=1"),
    "zero2": ("lora.r=8", "lora.dropout=0", "distill.lmbda=1"),
    "zero1": ("distill.lmbda=0", "distill.beta=1"),
}
VISION_REFUSAL = "Ulysses, context or tensor parallelism (images"
TP_REFUSAL = "is not supported under tensor parallelism"
SINGLE_REFERENCE = "the one-process reference of every comparison"

CELLS: dict[str, dict[str, Cell]] = {
    "full": {
        "single_gpu": Proven(("tests/test_real_launcher.py::test_the_real_launcher_trains_as_the_warm_one"
                              "[single_gpu]",),
                             SINGLE_REFERENCE),
        **_each(("ddp", "fsdp", "fsdp_offload", *ZERO), lambda c: Proven((f"{S}[{c}-full]",))),
        "hsdp": Proven(("tests/test_hsdp.py::test_hsdp_trains_like_one_process_on_a_two_dimensional_mesh",)),
        "zero3_ulysses": Proven((f"{ULY}::test_ulysses_trains_like_one_process[full]",)),
        "fsdp_cp": Proven((f"{CPT}::test_context_parallelism_trains_like_one_process[full]",)),
        "tp": Proven((f"{TPT}::test_tensor_parallelism_trains_like_one_process[chunked]",)),
        "fsdp_tp": Proven((f"{FTP}::test_fsdp2_with_tensor_parallelism_trains_like_one_process",)),
        "fsdp_ep": Proven((f"{EPT}::test_experts_on_two_of_four_processes_train_like_one_process_and_resume_exactly",
                           f"{EPT}::test_replicas_of_the_expert_parallel_group_train_like_one_process",
                           f"{EP_PREFLIGHT}[qwen3-30b-a3b/full_sft_ep.yaml]")),
    },
    "lora": {
        "single_gpu": Proven((f"{S}[ddp-lora]",), SINGLE_REFERENCE),
        **_each(("ddp", "fsdp", "fsdp_offload", *ZERO), lambda c: Proven((f"{S}[{c}-lora]",))),
        "hsdp": Proven(("tests/test_hsdp.py::test_hsdp_trains_lora_like_one_process",)),
        "zero3_ulysses": Proven((f"{ULY}::test_ulysses_trains_like_one_process[lora]",)),
        "fsdp_cp": Proven((f"{CPT}::test_context_parallelism_trains_like_one_process[lora]",)),
        "tp": Proven((f"{TPT}::test_lora_under_tensor_parallelism_trains_like_one_process_and_resumes_exactly",)),
        "fsdp_tp": Refused("a lora section under FSDP2 + TP"),
        # the row's target_modules (all-linear) adapt the experts on a mixture of experts; LoRA on attention is
        # proven: tests/test_expert_parallel.py (the Mixtral recipe, LoRA with dropout)
        "fsdp_ep": Refused(ALL_LINEAR_ON_EXPERTS),
    },
    "lora_dropout": {
        **_each(CONFIGS, lambda c: _run("noise")),
        "fsdp_tp": Refused("a lora section under FSDP2 + TP"),
        "fsdp_ep": Refused(ALL_LINEAR_ON_EXPERTS),
    },
    "dora": {
        **_each(CONFIGS, lambda c: _run("adapters", "with rsLoRA on: each sets its own field")),
        "tp": Refused("lora.use_dora, lora.target_parameters or lora.modules_to_save"),
        "fsdp_tp": Refused("a lora section under FSDP2 + TP"),
        "fsdp_ep": Refused("lora.use_dora, lora.target_parameters or lora.modules_to_save (adapters on split"),
    },
    "rslora": {
        **_each(CONFIGS, lambda c: _run("adapters", "with DoRA on where DoRA runs: each sets its own field")),
        "fsdp_tp": Refused("a lora section under FSDP2 + TP"),
        "fsdp_ep": Refused(ALL_LINEAR_ON_EXPERTS),
    },
    "expert_lora": {
        "single_gpu": Proven((f"{MOE_RESUME}[qwen3-30b-a3b/lora_sft.yaml]",), SINGLE_REFERENCE),
        "ddp": Proven((f"{MOE_OTHER}[qwen3-30b-a3b/lora_sft.yaml-ddp]",)),
        "fsdp": Proven((f"{MOE_RESUME}[mixtral-8x7b/lora_sft.yaml]",)),
        "zero3": Proven((f"{MOE_RESUME}[qwen3-30b-a3b/lora_sft.yaml]",)),
        **_each(("fsdp_offload", "hsdp", "zero1", "zero2", "zero3_offload"),
                lambda c: Proven((f"{MOE_OTHER}[qwen3-30b-a3b/lora_sft.yaml-{c}]",))),
        # the shipped MoE recipes turn the router loss on, which the sequence meshes refuse; without it the
        # fused experts under them are not proven
        **_each(SEQUENCE, lambda c: Refused("lora.target_parameters (LoRA on fused experts) is not supported under")),
        "tp": Refused("lora.use_dora, lora.target_parameters or lora.modules_to_save"),
        "fsdp_tp": Refused("a lora section under FSDP2 + TP"),
        "fsdp_ep": Refused("lora.use_dora, lora.target_parameters or lora.modules_to_save (adapters on split"),
    },
    "qlora": {
        **_each(("single_gpu", "ddp", *ZERO, "zero3_ulysses"),
                lambda c: NeedsGpu("qlora_ddp" if c in ("single_gpu", "ddp") else None)),
        **_each((*FSDP_FAMILY, "fsdp_cp"), lambda c: Refused("under FSDP2 is unverified on GPU", on_gpu=True)),
        "tp": Refused("model.quantization (QLoRA's 4-bit weights", on_gpu=True),
        "fsdp_tp": Refused("a lora section under FSDP2 + TP", on_gpu=True),
        "fsdp_ep": Refused("model.quantization (4-bit experts", on_gpu=True),
    },
    "neftune": _each(CONFIGS, lambda c: _run("noise")),
    "packing": {
        **_each(CONFIGS, lambda c: _run("adapters")),
        **_each(SEQUENCE, lambda c: Refused("data.packing=true " + ULYSSES_OR_CP)),
    },
    "concat_chunk": _each(CONFIGS, lambda c: _run("full", "with chunk isolation on, but under Ulysses and CP "
                                                           "(which refuse isolation)")),
    "chunk_isolation": {
        **_each(CONFIGS, lambda c: _run("full")),
        **_each(SEQUENCE, lambda c: Refused("data.chunk_isolate_documents=true " + ULYSSES_OR_CP)),
    },
    "streaming": {
        **_each(CONFIGS, lambda c: Refused("data.streaming=true is not proven under")),
        **_each(("single_gpu", "ddp", "fsdp", "zero3"),
                lambda c: Proven((f"tests/test_streaming.py::test_a_streaming_run_resumes_like_uninterrupted[{c}]",),
                                 "exact resume from the saved stream position; not compared with one process: each "
                                 "rank streams its own shards (every record once a pass), so the row order is "
                                 "another by design")),
        **_each(SEQUENCE, lambda c: Refused("data.streaming=true is not supported under accelerate_configs/")),
        **_each(TENSOR, lambda c: Refused("data.streaming=true " + TP_REFUSAL)),
        "fsdp_ep": Refused("data.streaming=true " + EP_REFUSAL),
    },
    "mixture": _each(CONFIGS, lambda c: _run("adapters")),
    "dpo": {
        "single_gpu": Proven((f"{PREF}::test_full_dpo_matches_single_process[ddp]",), SINGLE_REFERENCE),
        **_each(("ddp", "fsdp", "fsdp_offload", *ZERO),
                lambda c: Proven((f"{PREF}::test_full_dpo_matches_single_process[{c}]",))),
        "hsdp": _run("preference", "LoRA, preference.loss=ipo"),
        **_each(SEQUENCE, lambda c: Refused("training.objective=dpo is not supported under")),
        **_each(TENSOR, lambda c: Refused("training.objective=dpo " + TP_REFUSAL)),
        "fsdp_ep": Refused("training.objective=dpo " + EP_REFUSAL),
    },
    "kto": {
        "single_gpu": Proven((f"{KTO}::test_the_tiny_kto_recipe_learns_the_preference",), SINGLE_REFERENCE),
        **_each(("fsdp", "zero1"), lambda c: Proven((f"{KTO}::test_kto_trains_like_one_process[{c}]",))),
        # padding-free there (data.packing), compared with the one padded process
        **_each(("ddp", "hsdp", "zero3"), lambda c: Proven((f"{KTO}::test_kto_trains_like_one_process[{c}]",),
                                                           "padding-free, equal to one padded process")),
        **_each(("fsdp_offload", "zero2", "zero3_offload"), lambda c: _run("preference", "LoRA, pairs split in two")),
        **_each(SEQUENCE, lambda c: Refused("training.objective=dpo is not supported under")),
        **_each(TENSOR, lambda c: Refused("training.objective=dpo " + TP_REFUSAL)),
        "fsdp_ep": Refused("training.objective=dpo " + EP_REFUSAL),
    },
    # the preference runs (zero2, zero3_offload: LoRA KTO) and the kto row's ddp, hsdp and zero3 launches
    # padding-free, each against one padded process
    "dpo_padding_free": {
        **_each(("single_gpu", *DATA_PARALLEL), lambda c: _run("preference", f"LoRA, preference.loss="
                                                             f"{PREFERENCE_LOSS[c]}")),
        **_each(("fsdp", "zero3"), lambda c: Proven(
            (f"{PREF}::test_a_live_reference_model_gives_what_the_precomputed_pass_gives[{c}]",),
            "full, a live reference sharded like the policy, equal to one padded process")),
        "fsdp_offload": Proven((f"{PREF}::test_full_dpo_matches_single_process[fsdp_offload]",),
                               "full, precomputed reference, equal to one padded process"),
        # and the preference run's LoRA KTO there (its examples apart from their partners); fsdp_offload's stays padded
        **_each(("zero2", "zero3_offload"), lambda c: Proven(
            ("run:preference", f"{PREF}::test_full_dpo_matches_single_process[{c}]"),
            "LoRA KTO padding-free (the run), full DPO (the test): each equal to one padded process")),
        **_each(SEQUENCE, lambda c: Refused("data.packing=true " + ULYSSES_OR_CP)),
        **_each(TENSOR, lambda c: Refused("training.objective=dpo " + TP_REFUSAL)),
        "fsdp_ep": Refused("training.objective=dpo " + EP_REFUSAL),
    },
    "dpo_losses": {
        **_each(("single_gpu", *DATA_PARALLEL), lambda c: _run("preference", f"LoRA, preference.loss="
                                                             f"{PREFERENCE_LOSS[c]}: one loss per config, in turn")),
        **_each(SEQUENCE, lambda c: Refused("training.objective=dpo is not supported under")),
        **_each(TENSOR, lambda c: Refused("training.objective=dpo " + TP_REFUSAL)),
        "fsdp_ep": Refused("training.objective=dpo " + EP_REFUSAL),
    },
    "grpo": {
        **_each(("single_gpu", *DATA_PARALLEL), lambda c: _run("rl", ", ".join(RL_VARIANT[c]))),
        **_each(SEQUENCE, lambda c: Refused("training.objective=grpo is not supported under")),
        **_each(TENSOR, lambda c: Refused("training.objective=grpo " + TP_REFUSAL)),
        "fsdp_ep": Refused("training.objective=grpo " + EP_REFUSAL),
    },
    "agent": {
        "single_gpu": Proven((f"{AGENT}[ddp]",), SINGLE_REFERENCE),
        "ddp": Proven((f"{AGENT}[ddp]",), "stopped after step 2 and resumed"),
        **_each(("fsdp", "hsdp"), lambda c: Proven(
            (f"{AGENT}[{c}]",), "each layer gathered per token: generate() synced, every turn's calls agreed")),
        **_each(("fsdp_offload", "zero3_offload"), lambda c: Proven((f"{AGENT}[{c}]",))),
        "zero1": Proven((f"{AGENT}[zero1]",)),
        "zero2": Proven((f"{AGENT}[zero2]",), "a turn sampled in several generate calls (rl.rows_per_generate)"),
        "zero3": Proven((f"{AGENT}[zero3]",), "rl.environment (reset, its methods as tools, its reward); the "
                        "model gathered once per rollout"),
        **_each(SEQUENCE, lambda c: Refused("training.objective=grpo is not supported under")),
        **_each(TENSOR, lambda c: Refused("training.objective=grpo " + TP_REFUSAL)),
        "fsdp_ep": Refused("training.objective=grpo " + EP_REFUSAL),
    },
    "reward_model": {
        **_each(("single_gpu", *DATA_PARALLEL), lambda c: _run("reward", ", ".join(REWARD_VARIANT[c]) or "full")),
        **_each(SEQUENCE, lambda c: Refused("training.objective=reward is not supported under")),
        **_each(TENSOR, lambda c: Refused("training.objective=reward " + TP_REFUSAL)),
        "fsdp_ep": Refused("training.objective=reward " + EP_REFUSAL),
    },
    "distill": {
        **_each(tuple(DISTILL_VARIANT), lambda c: _run("distill", ", ".join(DISTILL_VARIANT[c]))),
        "single_gpu": Proven((f"{DISTILL}[ddp]",), SINGLE_REFERENCE),
        **_each(("ddp", "fsdp", "zero3"), lambda c: Proven((f"{DISTILL}[{c}]",), "lmbda 1: the student's samples, "
                                                           "equal to one process until fp32 rounding parts them")),
        **_each(SEQUENCE, lambda c: Refused("training.objective=distill is not supported under")),
        **_each(TENSOR, lambda c: Refused("training.objective=distill " + TP_REFUSAL)),
        "fsdp_ep": Refused("training.objective=distill " + EP_REFUSAL),
    },
    "vlm": {
        **_each(("single_gpu", *DATA_PARALLEL), lambda c: _run("vision", ", ".join(VISION_VARIANT[c]) or
                                                           "the image encoder frozen")),
        **_each((*SEQUENCE, *TENSOR), lambda c: Refused(VISION_REFUSAL)),
        "fsdp_ep": Refused("is a dense model"),  # the tiny Gemma-3-shaped model; a vision MoE: refused too
    },
    "scoring": _each(CONFIGS, lambda c: _run("adapters")),
    "samples": _each(CONFIGS, lambda c: _run("adapters")),
    "compile": {
        **_each(CONFIGS, lambda c: Refused("training.compile=true is unverified under")),
        "single_gpu": Proven((f"{COMPILE}[single_gpu]",)),
        "ddp": Proven((f"{COMPILE}[ddp]",)),
        "fsdp": Proven((f"{COMPILE}[fsdp]",)),
        **_each(TENSOR, lambda c: Refused("training.compile=true " + TP_REFUSAL)),
        "fsdp_ep": Refused("training.compile=true (the token exchange"),
    },
    "grad_ckpt": _each(CONFIGS, lambda c: _run("adapters")),
    "router_loss": {
        "single_gpu": Proven((f"{MOE_RESUME}[qwen3-30b-a3b/full_sft.yaml]",), SINGLE_REFERENCE),
        "ddp": Proven((f"{MOE_OTHER}[qwen3-30b-a3b/lora_sft.yaml-ddp]",)),
        "fsdp": Proven((f"{MOE_RESUME}[qwen3-30b-a3b/full_sft.yaml]",)),
        "zero3": Proven((f"{MOE_OTHER}[qwen3-30b-a3b/full_sft.yaml-zero3]",)),
        **_each(("fsdp_offload", "hsdp", "zero1", "zero2", "zero3_offload"),
                lambda c: Proven((f"{MOE_OTHER}[qwen3-30b-a3b/lora_sft.yaml-{c}]",))),
        **_each(SEQUENCE, lambda c: Refused("the router's load-balancing loss) is not supported under")),
        "tp": Proven((f"{TPT}::test_shipped_full_fine_tunes_preflight_under_tensor_parallelism_and_train_like_one_"
                      "process[qwen3-30b-a3b/full_sft.yaml]",)),
        "fsdp_tp": Proven((f"{FTP}::test_shipped_full_fine_tunes_preflight_under_fsdp2_with_tensor_parallelism"
                           "[qwen3-30b-a3b/full_sft.yaml-ddp]",),
                          "equal to DDP on the same micro-batches (the router loss is per micro-batch, as one "
                          "process with the same micro-batches computes it)"),
        "fsdp_ep": Proven((f"{EP_PREFLIGHT}[qwen3-30b-a3b/full_sft_ep.yaml]",
                           f"{EP_PREFLIGHT}[mixtral-8x7b/lora_sft_ep.yaml]"),
                          "equal to DDP on the same micro-batches, as under FSDP2 + TP"),
    },
    "router_global": {
        **_each(CONFIGS, lambda c: Refused("model.router_balance=global is not proven under")),
        **_each(("single_gpu", "ddp", "fsdp_ep"), lambda c: Proven(
            (f"{EPT}::test_the_router_balanced_over_every_ranks_rows_trains_like_one_process",),
            "equal to one process reading the step's rows in one micro-batch, gradient norms included")),
    },
    "loss_plain": _each(CONFIGS, lambda c: _run("full")),
    "loss_trl": {
        **_each(CONFIGS, lambda c: _run("adapters")),
        **_each(TENSOR, lambda c: Refused("training.loss_impl=trl (TRL's fused head reads lm_head whole) "
                                          + TP_REFUSAL)),
        "fsdp_ep": Refused("training.loss_impl=trl (TRL's fused head reads lm_head whole) " + EP_REFUSAL),
    },
    "bf16": _each(CONFIGS, lambda c: _run("noise", "bf16 autocast / FSDP2 bf16 compute: within the noise tolerance")),
    "fp16": {
        **_each(CONFIGS, lambda c: NeedsGpu("full_fp16" if c == "single_gpu" else None)),
        **_each(TENSOR, lambda c: Refused("training.mixed_precision=fp16 (its loss scaler", on_gpu=True)),
        "fsdp_ep": Refused("training.mixed_precision=fp16 (its loss scaler", on_gpu=True),
    },
    "fp8": {
        **_each(CONFIGS, lambda c: Refused("training.mixed_precision=fp8 is not supported under")),
        "single_gpu": Proven((f"{FP8}::test_fp8_trains_like_bf16_and_exports_the_plain_model",), SINGLE_REFERENCE),
        "ddp": Proven((f"{FP8}::test_fp8_under_ddp_resumes_equal_to_one_process",), "stopped after step 3, resumed"),
        "fsdp": Proven((f"{FP8}::test_fp8_under_fsdp2_trains_like_one_process",),
                       "within the noise tolerance (FSDP2 gathers the weights in bf16 before their float8 cast); "
                       "through the real accelerate launch"),
    },
    "eval_sets": _each(CONFIGS, lambda c: _run("adapters")),
    "adamw_8bit": {
        "single_gpu": NeedsGpu("adamw_8bit"),
        "ddp": NeedsGpu("adamw_8bit"),
        **_each((*FSDP_FAMILY, "fsdp_cp"), lambda c: Refused("training.optimizer=adamw_8bit is not supported with fsdp",
                                                            on_gpu=True)),
        **_each((*ZERO, "zero3_ulysses"), lambda c: Refused("training.optimizer=adamw_8bit is not supported with "
                                                           "deepspeed", on_gpu=True)),
        **_each(TENSOR, lambda c: Refused("training.optimizer=adamw_8bit (on tensor-parallel DTensors", on_gpu=True)),
        "fsdp_ep": Refused("training.optimizer=adamw_8bit (on split experts", on_gpu=True),
    },
    "offload_activations": _each(CONFIGS, lambda c: _run("full")),
    "time_checkpoints": _each(CONFIGS, lambda c: _run("full", "a checkpoint at every step, each complete")),
}


# Pipeline parallelism: full fine-tuning proven (stages alone, across a resume; FSDP2 over the stages through make),
# LoRA, bf16, text chunks, mixtures and eval sets, the checkpoints' clock; everything else refused by
# parallel/checks.check_pipeline (or the model check) until a stage carries it
PPT = "tests/test_pipeline.py"
PIPELINE_REFUSAL = "pipeline parallelism (accelerate_configs/fsdp_pp.yaml"
PIPELINE_CELLS: dict[str, Cell] = {
    "full": Proven((f"{PPT}::test_pipeline_stages_alone_train_like_one_process_and_resume_exactly",
                    f"{PPT}::test_fsdp2_over_pipeline_stages_trains_like_one_process_through_make",
                    f"{PPT}::test_a_mixture_of_experts_on_pipeline_stages_trains_like_one_process")),
    "lora": Proven((f"{PPT}::test_lora_on_pipeline_stages_trains_like_one_process",),
                   "each stage's adapters, FSDP2 over 2 processes each; merged on export"),
    **_each(("bf16", "concat_chunk", "eval_sets"), lambda c: Proven(
        (f"{PPT}::test_bf16_stages_train_and_evaluate_like_one_process[text_chunks]",),
        "pp 2 alone, bf16 on text chunks, a held-out tenth evaluated")),
    "mixture": Proven((f"{PPT}::test_bf16_stages_train_and_evaluate_like_one_process[mixture]",),
                      "pp 2 alone, bf16, eval per source"),
    "time_checkpoints": Proven((f"{PPT}::test_pipeline_stages_alone_train_like_one_process_and_resume_exactly",),
                               "a checkpoint at every step, each complete; resumed from step 5"),
    "fp8": Refused("training.mixed_precision=fp8 is not supported under fsdp_pp"),
    "router_global": Refused("model.router_balance=global is not proven under fsdp_pp"),
    **_each(("qlora", "fp16", "adamw_8bit"), lambda c: Refused(PIPELINE_REFUSAL, on_gpu=True)),
}
for _key, _cells in CELLS.items():
    _cells["fsdp_pp"] = PIPELINE_CELLS.get(_key, Refused(PIPELINE_REFUSAL))


def cell(feature: str, config: str) -> Cell:
    return CELLS[feature][config]


def run_features(kind: str, config: str) -> list[Feature]:
    """The features a feature run of this kind turns on under this config: every one its column proves by it."""
    return [f for f in FEATURES
            if isinstance(value := cell(f.key, config), Proven) and f"run:{kind}" in value.tests]



# ----------------------------------------------------------------------------------------------- the docs
SYMBOL = {Proven: "✓", Refused: "✗", NeedsGpu: "GPU"}


def markdown() -> str:
    """docs/compatibility.md, generated (tests/test_matrix.py fails when the file differs)."""
    head = ["# Compatibility matrix: every feature on every strategy", "",
            "Generated from `disttrain/recipe/matrix.py` by `make matrix`; do not edit by hand "
            "(`tests/test_matrix.py` fails when this file and the declaration differ).", "",
            "- **✓** proven on CPU processes over gloo: trained under that config and compared with one process "
            "(losses per step, eval losses, exported weights; stochastic features: replicas identical every step "
            f"and per-step losses within {NOISE_TOLERANCE:.0%} of one process's), unless the cell's note says what "
            "else it is compared with (compile: compiled vs eager; streaming: resumed vs uninterrupted). In the "
            "one-process column ✓ means the feature runs there: that run is the reference of the others. FSDP2 + "
            "CP runs here on the project's test-only CPU ring kernel (`tests/cpu_ring`); a CPU user's fsdp_cp "
            "launch is refused. Not verified on GPUs (docs/strategies.md, GPU paths).",
            "- **✗** refused in one line before the model's weights load (`disttrain/recipe/compat.py`); the reason "
            "is listed below.",
            "- **GPU** needs a CUDA GPU (bitsandbytes, fp16): refused in one line on a machine without one; on a GPU "
            "it runs, not yet verified there (the acceptance item is named below).", "",
            "| feature | " + " | ".join(c.title for c in COLUMNS) + " |",
            "|---|" + "---|" * len(COLUMNS)]
    rows = [f"| {f.title} | " + " | ".join(SYMBOL[type(cell(f.key, c.config))] for c in COLUMNS) + " |"
            for f in FEATURES]
    detail = ["", "## Each cell", "",
              "`run:<kind>` is a feature run of `tests/test_matrix.py` (`test_feature_run_trains_like_one_process"
              "[<config>-<kind>]`): one launch under that config with every feature its column proves by that "
              "kind of run, against one process on the same recipe.", ""]
    for f in FEATURES:
        detail.append(f"### {f.title}")
        detail.append("")
        for c in COLUMNS:
            value = cell(f.key, c.config)
            if isinstance(value, Proven):
                text = "✓ " + ", ".join(f"`{t}`" for t in value.tests) + (f" ({value.note})" if value.note else "")
            elif isinstance(value, Refused):
                text = f"✗ \"…{value.says}…\"" + (" (the refusal on a GPU machine)" if value.on_gpu else "")
            else:
                item = (f"acceptance item `{value.acceptance}`" if value.acceptance
                        else "no acceptance item yet: unverified")
                text = "GPU: refused without a CUDA GPU; " + item
            detail.append(f"- {c.title}: {text}")
        detail.append("")
    return "\n".join(head + rows + detail)


def main() -> None:
    from pathlib import Path

    out = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
    out.write_text(markdown())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
