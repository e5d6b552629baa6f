"""Build the Accelerator for whatever `accelerate launch --config_file ...` chose, on GPUs or on CPU.

The strategy (DDP, FSDP, DeepSpeed) comes from the launcher's environment, never from the recipe. On a
machine without an accelerator the same configs run over gloo:
- DDP / single process: `cpu=True` gives MULTI_CPU (gloo).
- DeepSpeed: no `cpu` flag (DeepSpeed picks its CPU accelerator itself), but the process group must be
  told to use gloo, otherwise accelerate sees one process and every rank would read the same batches.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import sys
from datetime import timedelta

import torch

from disttrain.recipe.schema import Recipe


def launcher_strategy() -> str:
    """'deepspeed', 'fsdp', 'ddp' or 'single', as set by `accelerate launch` from the config file."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    return "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"


def _deepspeed_zero() -> tuple[int | None, bool]:
    """(ZeRO stage, anything offloaded) of a DeepSpeed launch. accelerate exports the stage only when the
    config names it inline; with a DeepSpeed JSON (as every shipped config has) it lives in that file."""
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    offload = any(os.environ.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{what}_DEVICE", "none") not in ("none", "")
                  for what in ("OPTIMIZER", "PARAM"))
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            zero = json.load(f).get("zero_optimization", {})
        stage = zero.get("stage", stage)
        offload = any(str(zero.get(key, {}).get("device", "none")) != "none"
                      for key in ("offload_optimizer", "offload_param"))
    return (int(stage) if stage not in (None, "", "auto") else None), offload


def zero_stage() -> int | None:
    return _deepspeed_zero()[0] if launcher_strategy() == "deepspeed" else None


MESH_DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")  # accelerate's ParallelismConfig, in its order
# Expert parallelism: accelerate's ParallelismConfig has no such dimension, so its size travels in a variable
# named like accelerate's own (make train-fsdp-ep EP=N sets it); unset, every process of a replica holds a slice
EXPERT_PARALLEL_ENV = "PARALLELISM_CONFIG_EP_SIZE"
PIPELINE_ENV = "PARALLELISM_CONFIG_PP_SIZE"  # likewise for pipeline parallelism (make train-fsdp-pp PP=N)


def pipeline_size() -> int:
    """The pipeline's stages (1: no pipeline parallelism)."""
    return int(os.environ.get(PIPELINE_ENV) or 1)


def mesh_sizes() -> dict[str, int] | None:
    """The mesh `accelerate launch` set from a config's `parallelism_config:` block (or its flags), as
    {dimension: size}, with the expert-parallel size ("ep"); None for a one-dimensional launch. A MULTI_GPU launch
    with dp_shard_size > 1 and no tensor parallelism is expert parallelism (fsdp_ep.yaml, the one config that
    launches so): its experts spread over each replica's processes unless PARALLELISM_CONFIG_EP_SIZE says fewer."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    sizes = {dim: int(os.environ.get(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", "1")) for dim in MESH_DIMS}
    expert_launch = launcher_strategy() == "ddp" and sizes["tp"] == 1 and sizes["dp_shard"] > 1
    sizes["ep"] = int(os.environ.get(EXPERT_PARALLEL_ENV) or (sizes["dp_shard"] if expert_launch else 1))
    return sizes


def laid_out_by_transformers() -> bool:
    """Tensor or expert parallelism: transformers splits (and shards) the model as it loads it, on a MULTI_GPU
    launch that accelerate must leave as it is."""
    mesh = mesh_sizes() or {}
    return launcher_strategy() == "ddp" and (mesh.get("tp", 1) > 1 or mesh.get("ep", 1) > 1)


def run_label() -> str:
    """The strategy as output.dir's {strategy} names it, as the accelerate config files are named: single,
    ddp, tp, fsdp_tp, hsdp_tp, fsdp_ep, hsdp_ep, fsdp_pp, fsdp, fsdp_offload, hsdp, fsdp_cp, zero1, zero2, zero3,
    zero3_offload, zero3_ulysses."""
    strategy = launcher_strategy()
    mesh = mesh_sizes()
    if strategy == "ddp" and pipeline_size() > 1:
        return "fsdp_pp"
    if strategy == "fsdp" and mesh and mesh["dp_replicate"] > 1:
        return "hsdp"
    if strategy == "fsdp" and mesh and mesh["cp"] > 1:
        return "fsdp_cp"
    if strategy == "ddp" and mesh and mesh["tp"] > 1:  # alone, or under FSDP2 (replicas x shards around it)
        return {(False, False): "tp", (False, True): "fsdp_tp"}.get(
            (mesh["dp_replicate"] > 1, mesh["dp_shard"] > 1), "hsdp_tp")
    if strategy == "ddp" and mesh and mesh["ep"] > 1:
        return "hsdp_ep" if mesh["dp_replicate"] > 1 else "fsdp_ep"
    if strategy == "deepspeed":
        stage, offload = _deepspeed_zero()
        ulysses = "_ulysses" if mesh and mesh["sp"] > 1 else ""
        return f"zero{'' if stage is None else stage}{'_offload' if offload else ''}{ulysses}"
    if strategy == "fsdp" and os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
        return "fsdp_offload"
    return strategy


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_gpu() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def _wandb_offline_without_key(report_to: list[str]) -> None:
    """No key configured -> log to local files (`wandb sync` later) instead of failing on a login prompt."""
    if "wandb" in report_to and not os.environ.get("WANDB_API_KEY"):
        netrc = os.path.expanduser("~/.netrc")
        if not (os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read()):
            os.environ.setdefault("WANDB_MODE", "offline")


def _unwrap_without_deepspeed() -> None:
    """accelerate's unwrap_model imports DeepSpeed whenever it is installed, to recognise a DeepSpeed engine:
    1.3 s of every rank's start-up. A launch that is not DeepSpeed has no such engine to recognise."""
    import accelerate.utils.other

    accelerate.utils.other.is_deepspeed_available = lambda: False


def _import_deepspeed_without_mlflow(report_to: list[str]) -> None:
    """DeepSpeed's autotuner, which a training run never uses, imports mlflow at import time whenever it is
    installed: ~4 CPU-s of every rank's start-up (measured with py-spy on a ZeRO-2 launch). Unless mlflow is one
    of this run's trackers, DeepSpeed is imported while mlflow reads as absent; it is importable again after."""
    if "mlflow" in report_to or "mlflow" in sys.modules or "deepspeed" in sys.modules:
        return
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError, which the autotuner catches
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]


def cpu_info_once() -> None:
    """DeepSpeed's CPU optimizers (ZeRO-Offload's DeepSpeedCPUAdam, and its op builder) ask py-cpuinfo for the
    CPU's features three times per optimizer, and py-cpuinfo answers each call by starting two Python processes
    (~1 CPU-s a call on every rank; measured with py-spy over the test suite). The CPU does not change while a
    process runs: the first answer is kept (a copy handed out each time)."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "kept", False):
        return
    ask = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return copy.deepcopy(ask())

    get_cpu_info.kept = True
    cpuinfo.get_cpu_info = get_cpu_info


def _without_shared_memory_kernels() -> None:
    """DeepSpeed on CPU processes (tests, preflight) JIT-compiles its shared-memory all-reduce kernels in every
    new environment (~70 CPU-s, while the other ranks wait), for `inference_all_reduce` alone: ZeRO's
    collectives go through torch.distributed (gloo) either way, and that function falls back to it. Marked
    unavailable, DeepSpeed skips the build; nothing changes on GPUs."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _process_group_kwargs(recipe: Recipe, strategy: str, gpu: bool, report_to: list[str]):
    """How long a rank waits in a collective for the others (guards.py turns a timeout into one clear line), and
    DeepSpeed readied before the group exists: imported without mlflow, over gloo on CPU processes."""
    from accelerate.utils import InitProcessGroupKwargs

    pg_kwargs = InitProcessGroupKwargs(timeout=timedelta(seconds=recipe.distributed.timeout_s))
    if strategy == "deepspeed":
        _import_deepspeed_without_mlflow(report_to)
        cpu_info_once()
    if not gpu and strategy == "deepspeed":
        pg_kwargs.backend = "gloo"  # (with cpu=True accelerate picks gloo itself)
        _without_shared_memory_kernels()
    return pg_kwargs


def build_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import (DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration,
                                  TorchDynamoPlugin)

    strategy = launcher_strategy()
    gpu = has_gpu()
    report_to = [t for t in recipe.logging.report_to if t != "none"]
    _wandb_offline_without_key(report_to)
    pg_kwargs = _process_group_kwargs(recipe, strategy, gpu, report_to)
    kwargs = dict(
        # The loop fetches each accumulation window up front (to count its target tokens), which makes
        # accelerate's end-of-dataloader flag fire early; sync on the step counter alone instead.
        # FSDP: no-sync micro-batches would keep every layer's unsharded gradient until the last one (see
        # DistributedSection.fsdp_sync_each_micro_batch); reduce-scatter each micro-batch instead.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=recipe.training.grad_accum, sync_with_dataloader=False,
            sync_each_batch=strategy == "fsdp" and recipe.distributed.fsdp_sync_each_micro_batch),
        mixed_precision=recipe.training.mixed_precision,
        # The scheduler is stepped once per optimizer step by the loop. accelerate's default would step
        # it num_processes times per call, silently shortening warmup and decay on many GPUs.
        step_scheduler_with_optimizer=False,
        # Same shuffling on every rank from the seed, then each rank takes its own disjoint shard;
        # set_epoch() reshuffles per epoch and the order is reproducible on resume.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=recipe.training.seed),
        log_with=report_to or None,
        project_config=ProjectConfiguration(project_dir=recipe.output.dir, logging_dir=f"{recipe.output.dir}/runs"),
        kwargs_handlers=[pg_kwargs],
    )
    if recipe.training.mixed_precision == "fp8":
        from disttrain.runtime import fp8

        kwargs["kwargs_handlers"].append(fp8.recipe_kwargs(strategy, gpu))
        if strategy == "fsdp":
            fp8.load_whole_on_every_rank()
    if recipe.training.compile:
        # Regional: the repeated decoder block is compiled once and reused by every layer, so compile time
        # does not grow with depth, and FSDP2's per-block sharding stays outside the compiled graphs.
        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True, dynamic=True)
    if strategy == "deepspeed":
        kwargs["deepspeed_plugin"] = _deepspeed_plugin(recipe)
    else:
        _unwrap_without_deepspeed()
        kwargs["cpu"] = not gpu
    if strategy == "fsdp" and not gpu:
        from disttrain.runtime.fsdp_cpu import fsdp_branch_on_cpu, unpin_offload

        with fsdp_branch_on_cpu(pg_kwargs.timeout):
            accelerator = Accelerator(**kwargs)
        unpin_offload(accelerator)
    elif not gpu and laid_out_by_transformers():
        from disttrain.runtime.fsdp_cpu import tensor_parallel_on_cpu

        with tensor_parallel_on_cpu(pg_kwargs.timeout):
            accelerator = Accelerator(**kwargs)
    else:
        accelerator = Accelerator(**kwargs)
    if strategy == "fsdp" and recipe.distributed.fsdp_reduce_in_fp32:
        _fsdp_reduce_in_fp32(accelerator)
    return accelerator


def _fsdp_reduce_in_fp32(accelerator) -> None:
    """accelerate's FSDP2 mixed precision reduces gradients in the compute dtype (bf16); DDP under autocast
    reduces the fp32 gradients of fp32 weights. Keep the low-precision compute, reduce in fp32. Read by
    accelerator.prepare(), so it is set before."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = accelerator.state.fsdp_plugin
    policy = plugin.mixed_precision_policy
    if isinstance(policy, MixedPrecisionPolicy) and policy.param_dtype not in (None, torch.float32):
        plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=policy.param_dtype, reduce_dtype=torch.float32, output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs)


def _deepspeed_plugin(recipe: Recipe):
    """The DeepSpeed JSON keeps "auto" for what the recipe owns; fill those from the recipe here.
    (accelerate refuses the same settings given both in the JSON and in the accelerate config.)"""
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(gradient_accumulation_steps=recipe.training.grad_accum,
                           gradient_clipping=recipe.training.max_grad_norm or 0.0)


def set_deepspeed_micro_batch(accelerator, micro_batch_size: int) -> None:
    """DeepSpeed's "auto" micro-batch size is read from a prepared dataloader; a stream is not prepared by
    accelerate (each rank reads its own shards), so give the number directly."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size


def shard_loader(accelerator, loader, data_rank: int, data_ranks: int):
    """accelerator.prepare_data_loader with the data rank in place of the process rank (the same settings
    otherwise): for meshes whose processes share rows, which accelerate does not know under DeepSpeed."""
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(
        loader, accelerator.device, num_processes=data_ranks, process_index=data_rank,
        split_batches=accelerator.split_batches, put_on_device=accelerator.device_placement,
        rng_types=accelerator.rng_types.copy(), dispatch_batches=accelerator.dispatch_batches,
        even_batches=accelerator.even_batches, use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader)


class ReplicatedLoader:
    """Every batch of `loader`, whole, on this process's device, and not registered with accelerate: for eval
    sets under tensor parallelism, whose processes all run the same batches. Gathered for metrics, each batch
    then counts tp times on both sides of the ratios an evaluation reports (losses, accuracies), which leaves
    them exact; accelerate's end-of-loader truncation assumes a split loader and would not."""

    def __init__(self, loader, device):
        self.loader, self.device = loader, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        from accelerate.utils import send_to_device

        for batch in self.loader:
            yield send_to_device(batch, self.device)


def bare_model(accelerator, model):
    """The model itself, out of its DDP / FSDP / DeepSpeed wrapper and of regional compilation: accelerate's
    unwrap_model keeps the compiled wrapper by default, and under DDP + training.compile that wrapper is a copy of
    the DDP module (no config, no save_pretrained, no input embeddings). The blocks are shared with the compiled
    copy, so hooks and weights are the trained ones."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


@contextlib.contextmanager
def generating(accelerator, model):
    """The bare model ready for generate() in eval mode, train mode restored after. Under FSDP2, generate() may
    enter below the root module (peft's generate calls the base model), so the root's own parameters would stay
    sharded: they are gathered for the whole generation (the layers gather themselves per forward). And where a
    generation is the run's first forward (online RL's first rollout, distillation's first on-policy step), the
    first unit it entered would make itself FSDP2's root and the training forward after it would stop ("FSDP
    state has already been lazily initialized"): the real root initialises first, as its own forward would."""
    module = bare_model(accelerator, model)
    root = module if _is_fsdp2(module) else None
    if root is not None:
        root._get_fsdp_state()._lazy_init()  # idempotent: a no-op once the root has run a forward
        root.unshard()
    was_training = model.training
    model.eval()
    try:
        yield module
    finally:
        model.train(was_training)
        if root is not None:
            root.reshard()


def _is_fsdp2(module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def shards_weights(accelerator) -> bool:
    """True under FSDP and ZeRO-3, where no rank holds the whole model."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


def fsdp_layout(model) -> str | None:
    """How FSDP2 laid the parameters out: the device mesh of the first sharded parameter and its placements
    ("(dp_replicate=2, dp_shard_cp=2) as (Replicate(), Shard(dim=0))" under HSDP); None when nothing is a
    DTensor (no FSDP2)."""
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            dims = ", ".join(f"{name}={size}" for name, size in zip(mesh.mesh_dim_names or (), mesh.shape))
            return f"({dims}) as ({', '.join(str(p) for p in param.placements)})"
    return None


def moe_block_classes(model) -> list[str]:
    """Class names of the model's mixture-of-experts blocks: modules holding a router and their `experts`."""
    import torch

    names = {type(m).__name__ for m in model.modules()
             if isinstance(getattr(m, "experts", None), torch.nn.Module) and hasattr(m, "gate")}
    return sorted(names)


def deepspeed_model_settings(accelerator, model) -> None:
    """What DeepSpeed takes from the model before accelerate prepares it: MoE blocks gathered whole
    (gather_moe_blocks_whole) and the bucket sizes left "auto", from the language model's hidden size (accelerate
    reads `config.hidden_size`, which a vision-language model keeps in its text config: it would stop)."""
    gather_moe_blocks_whole(accelerator, model)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if plugin is None or config is None or hasattr(config, "hidden_size") or not hasattr(config, "get_text_config"):
        return
    hidden = config.get_text_config().hidden_size
    zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
    for key, value in (("reduce_bucket_size", hidden * hidden), ("stage3_prefetch_bucket_size", int(0.9 * hidden ** 2)),
                       ("stage3_param_persistence_threshold", 10 * hidden)):  # accelerate's own formulas
        if zero.get(key) == "auto":
            zero[key] = value


def gather_moe_blocks_whole(accelerator, model) -> list[str]:
    """ZeRO-3 gathers a layer's weights when it is entered. Inside an MoE block, which experts are entered
    depends on the tokens each rank routes, so ranks would wait in different gathers (the hang DeepSpeed
    documents for Mixtral and Qwen-MoE): its blocks become leaf modules (`set_z3_leaf_modules`, through
    accelerate's `transformer_moe_cls_names`), gathered whole on every rank. Other strategies: nothing to do."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or plugin.zero_stage != 3:
        return []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    classes = moe_block_classes(base)
    if classes and plugin.transformer_moe_cls_names is None:
        plugin.transformer_moe_cls_names = ",".join(classes)
        accelerator.print(f"ZeRO-3: MoE blocks gathered whole on every rank ({', '.join(classes)})")
    return classes
