"""The launch's mesh, read and checked: the sizes accelerate's ParallelismConfig was given (HSDP's replicas x
shards, Ulysses' groups x sp, context parallelism's groups x cp, tensor parallelism alone or under FSDP2), each
combination that is not supported refused in one line naming the config file to use."""

from __future__ import annotations

from disttrain.errors import DisttrainError
from disttrain.runtime.backends import mesh_sizes


def read_mesh(strategy: str, processes: int) -> tuple[str | None, int, int, int, tuple[int, int]]:
    """The launch's mesh, checked, with its sequence-, context- and tensor-parallel sizes and the data-parallel
    dimensions around tensor parallelism: HSDP (replicas x shards) or context parallelism (groups x cp) under
    FSDP2, Ulysses (groups x sp) under DeepSpeed; tensor parallelism alone (tp = every process) or under FSDP2
    laid by transformers (replicas x shards x tp); it must cover every process."""
    sizes = mesh_sizes()
    if sizes is None:
        return None, 1, 1, 1, (1, 1)
    if sizes["tp"] > 1:
        return _tensor_parallel_mesh(strategy, processes, sizes)
    if sizes["cp"] > 1:
        if strategy != "fsdp" or sizes["dp_replicate"] > 1 or sizes["sp"] > 1:
            raise DisttrainError(f"parallelism_config: cp_size={sizes['cp']} needs FSDP2 without dp_replicate or "
                                 "sp (torch's ring attention, as accelerate runs it); use accelerate_configs/"
                                 "fsdp_cp.yaml")
        if sizes["dp_shard"] * sizes["cp"] != processes:
            raise DisttrainError(f"parallelism_config: dp_shard_size={sizes['dp_shard']} x cp_size={sizes['cp']} "
                                 f"must equal the {processes} processes launched; set --parallelism_config_dp_"
                                 "shard_size to processes / cp_size (make train-fsdp-cp CP=... does)")
        return f"dp_shard={sizes['dp_shard']},cp={sizes['cp']}", 1, sizes["cp"], 1, (1, 1)
    if sizes["sp"] > 1:
        if strategy != "deepspeed" or sizes["dp_replicate"] > 1:
            raise DisttrainError(f"parallelism_config: sp_size={sizes['sp']} needs DeepSpeed without "
                                 "dp_replicate (Ulysses is DeepSpeed's); use accelerate_configs/zero3_ulysses.yaml")
        if sizes["dp_shard"] * sizes["sp"] != processes:
            raise DisttrainError(f"parallelism_config: dp_shard_size={sizes['dp_shard']} x sp_size={sizes['sp']} "
                                 f"must equal the {processes} processes launched; set --parallelism_config_dp_"
                                 "shard_size to processes / sp_size (make train-zero3-ulysses SP=... does)")
        return f"dp_shard={sizes['dp_shard']},sp={sizes['sp']}", sizes["sp"], 1, 1, (1, 1)
    if sizes["dp_replicate"] * sizes["dp_shard"] != processes:
        raise DisttrainError(f"parallelism_config: dp_replicate_size={sizes['dp_replicate']} x dp_shard_size="
                             f"{sizes['dp_shard']} must equal the {processes} processes launched; set "
                             "--parallelism_config_dp_replicate_size to the nodes and --parallelism_config_"
                             "dp_shard_size to the GPUs per node (make train-hsdp does)")
    return f"dp_replicate={sizes['dp_replicate']},dp_shard={sizes['dp_shard']}", 1, 1, 1, (1, 1)


def _tensor_parallel_mesh(strategy: str, processes: int, sizes: dict[str, int]):
    """tp alone (tp.yaml) or under FSDP2 (fsdp_tp.yaml): both are MULTI_GPU launches, because transformers, not
    accelerate, splits and shards the model as it loads it (accelerate 1.16's own FSDP2 + TP path imports
    transformers' ReplicateParallel, which transformers 5 removed)."""
    tp, replicas, shards = sizes["tp"], sizes["dp_replicate"], sizes["dp_shard"]
    others = {dim: sizes[dim] for dim in ("cp", "sp") if sizes[dim] > 1}
    if strategy != "ddp" or others:
        raise DisttrainError(f"parallelism_config: tp_size={tp} runs alone (accelerate_configs/tp.yaml) or under "
                             "FSDP2 laid out by transformers (accelerate_configs/fsdp_tp.yaml, distributed_type "
                             f"MULTI_GPU), not with {'an FSDP or DeepSpeed config' if strategy != 'ddp' else others}; "
                             "use one of those two files, or set tp_size to 1")
    if replicas * shards * tp != processes:
        raise DisttrainError(f"parallelism_config: dp_replicate_size={replicas} x dp_shard_size={shards} x tp_size="
                             f"{tp} must equal the {processes} processes launched; set --parallelism_config_tp_size "
                             "to the processes (make train-tp) or --parallelism_config_dp_shard_size to processes / "
                             "tp_size (make train-fsdp-tp TP=... does)")
    dims = [f"dp_replicate={replicas}"] * (replicas > 1) + [f"dp_shard={shards}"] * (shards > 1) + [f"tp={tp}"]
    return ",".join(dims), 1, 1, tp, (replicas, shards)
