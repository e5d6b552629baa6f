"""The launch's mesh, read and checked: the sizes accelerate's ParallelismConfig was given (HSDP's replicas x
shards, Ulysses' groups x sp, context parallelism's groups x cp, tensor parallelism alone or under FSDP2) and the
expert-parallel size beside them, each combination that is not supported refused in one line naming the config
file to use."""

from __future__ import annotations

from typing import NamedTuple

from disttrain.errors import DisttrainError
from disttrain.runtime.backends import EXPERT_PARALLEL_ENV, mesh_sizes, pipeline_size


class Mesh(NamedTuple):
    label: str | None  # "dp_replicate=R,dp_shard=S", "dp_shard=D,sp=S", ...; None for a one-dimensional launch
    sp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    fsdp_data: tuple[int, int] = (1, 1)  # (replicas, shards) of the FSDP2 laid over TP, EP or a pipeline's stages
    pp: int = 1


def read_mesh(strategy: str, processes: int) -> Mesh:
    """The launch's mesh, checked, with its sequence-, context-, tensor- and expert-parallel sizes and the
    data-parallel dimensions transformers lays around tensor or expert parallelism: HSDP (replicas x shards) or
    context parallelism (groups x cp) under FSDP2, Ulysses (groups x sp) under DeepSpeed; tensor parallelism
    alone (tp = every process) or under FSDP2 laid by transformers (replicas x shards x tp); expert parallelism
    under FSDP2 laid by transformers (replicas x shards, the experts over ep of each replica's shards); it must
    cover every process."""
    pp = pipeline_size()
    if pp > 1:
        return _pipeline_mesh(strategy, processes, pp)
    sizes = mesh_sizes()
    if sizes is None:
        return Mesh(None)
    if sizes["tp"] > 1:
        return _tensor_parallel_mesh(strategy, processes, sizes)
    if sizes["ep"] > 1:
        return _expert_parallel_mesh(strategy, processes, sizes)
    if sizes["cp"] > 1:
        if strategy != "fsdp" or sizes["dp_replicate"] > 1 or sizes["sp"] > 1:
            raise DisttrainError(f"parallelism_config: cp_size={sizes['cp']} needs FSDP2 without dp_replicate or "
                                 "sp (torch's ring attention, as accelerate runs it); use accelerate_configs/"
                                 "fsdp_cp.yaml")
        if sizes["dp_shard"] * sizes["cp"] != processes:
            raise DisttrainError(f"parallelism_config: dp_shard_size={sizes['dp_shard']} x cp_size={sizes['cp']} "
                                 f"must equal the {processes} processes launched; set --parallelism_config_dp_"
                                 "shard_size to processes / cp_size (make train-fsdp-cp CP=... does)")
        return Mesh(f"dp_shard={sizes['dp_shard']},cp={sizes['cp']}", cp=sizes["cp"])
    if sizes["sp"] > 1:
        if strategy != "deepspeed" or sizes["dp_replicate"] > 1:
            raise DisttrainError(f"parallelism_config: sp_size={sizes['sp']} needs DeepSpeed without "
                                 "dp_replicate (Ulysses is DeepSpeed's); use accelerate_configs/zero3_ulysses.yaml")
        if sizes["dp_shard"] * sizes["sp"] != processes:
            raise DisttrainError(f"parallelism_config: dp_shard_size={sizes['dp_shard']} x sp_size={sizes['sp']} "
                                 f"must equal the {processes} processes launched; set --parallelism_config_dp_"
                                 "shard_size to processes / sp_size (make train-zero3-ulysses SP=... does)")
        return Mesh(f"dp_shard={sizes['dp_shard']},sp={sizes['sp']}", sp=sizes["sp"])
    if sizes["dp_replicate"] * sizes["dp_shard"] != processes:
        raise DisttrainError(f"parallelism_config: dp_replicate_size={sizes['dp_replicate']} x dp_shard_size="
                             f"{sizes['dp_shard']} must equal the {processes} processes launched; set "
                             "--parallelism_config_dp_replicate_size to the nodes and --parallelism_config_"
                             "dp_shard_size to the GPUs per node (make train-hsdp does)")
    return Mesh(f"dp_replicate={sizes['dp_replicate']},dp_shard={sizes['dp_shard']}")


def _tensor_parallel_mesh(strategy: str, processes: int, sizes: dict[str, int]):
    """tp alone (tp.yaml) or under FSDP2 (fsdp_tp.yaml): both are MULTI_GPU launches, because transformers, not
    accelerate, splits and shards the model as it loads it (accelerate 1.16's own FSDP2 + TP path imports
    transformers' ReplicateParallel, which transformers 5 removed)."""
    tp, replicas, shards = sizes["tp"], sizes["dp_replicate"], sizes["dp_shard"]
    others = {dim: sizes[dim] for dim in ("cp", "sp", "ep") if sizes[dim] > 1}
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
    return Mesh(",".join(dims), tp=tp, fsdp_data=(replicas, shards))


def _expert_parallel_mesh(strategy: str, processes: int, sizes: dict[str, int]) -> Mesh:
    """Expert parallelism (fsdp_ep.yaml): a MULTI_GPU launch whose model transformers lays out as it loads it,
    the dense weights sharded by FSDP2 over each replica's dp_shard processes, the experts split over groups of
    ep of them (ep divides dp_shard: the rest, dp_shard / ep, hold the same experts and shard them)."""
    ep, replicas, shards = sizes["ep"], sizes["dp_replicate"], sizes["dp_shard"]
    others = {dim: sizes[dim] for dim in ("cp", "sp") if sizes[dim] > 1}
    if strategy != "ddp" or others:
        raise DisttrainError(f"{EXPERT_PARALLEL_ENV}={ep}: expert parallelism runs under FSDP2 laid out by "
                             "transformers (accelerate_configs/fsdp_ep.yaml, distributed_type MULTI_GPU), not with "
                             f"{'an FSDP or DeepSpeed config' if strategy != 'ddp' else others}; use fsdp_ep.yaml")
    if replicas * shards != processes:
        raise DisttrainError(f"parallelism_config: dp_replicate_size={replicas} x dp_shard_size={shards} must equal "
                             f"the {processes} processes launched; set --parallelism_config_dp_shard_size to processes "
                             "/ dp_replicate_size (make train-fsdp-ep EP=... does)")
    if shards % ep:
        raise DisttrainError(f"{EXPERT_PARALLEL_ENV}={ep} must divide dp_shard_size={shards} (the processes of a "
                             "replica: each group of ep of them holds every expert once); make train-fsdp-ep EP=N "
                             "with N dividing GPUS x NODES / HSDP_REPLICAS")
    dims = [f"dp_replicate={replicas}"] * (replicas > 1) + [f"dp_shard={shards}", f"ep={ep}"]
    return Mesh(",".join(dims), ep=ep, fsdp_data=(replicas, shards))


def _pipeline_mesh(strategy: str, processes: int, pp: int) -> Mesh:
    """Pipeline parallelism (fsdp_pp.yaml): a MULTI_GPU launch without accelerate's ParallelismConfig (which has
    no pipeline dimension); pp stages, each over processes / pp data-parallel processes sharded by FSDP2."""
    from disttrain.parallel.pipeline import PIPELINE_CONFIG
    from disttrain.runtime.backends import PIPELINE_ENV

    if strategy != "ddp" or mesh_sizes() is not None:
        raise DisttrainError(f"{PIPELINE_ENV}={pp}: pipeline parallelism runs from {PIPELINE_CONFIG} (distributed_type "
                             "MULTI_GPU, no parallelism_config: disttrain lays out the stages and FSDP2 over them), "
                             f"not from {'this FSDP or DeepSpeed config' if strategy != 'ddp' else 'a mesh config'}")
    if processes % pp:
        raise DisttrainError(f"{PIPELINE_ENV}={pp} must divide the {processes} processes launched (pp stages, each "
                             "over processes / pp data-parallel ones); make train-fsdp-pp PP=N with N dividing "
                             "GPUS x NODES")
    dp = processes // pp
    return Mesh(f"pp={pp}" + (f",dp_shard={dp}" if dp > 1 else ""), fsdp_data=(1, dp), pp=pp)
