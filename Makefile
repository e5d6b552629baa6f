# disttrain — every target composes commands; the logic lives in train.py and disttrain/.
# `make help` lists the targets and the variables they take.

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
ACCELERATE  := $(VENV)/bin/accelerate
# What the last `make setup` installed with: a plain `make train` afterwards keeps it, and only new values of
# TORCH_SPEC, TORCH_INDEX or EXTRAS install again
-include $(VENV)/install-args.mk
# torch as pip finds it: the CUDA build from PyPI on a stock Linux machine, the small CPU build where the index
# serves one first (TORCH_INDEX=https://download.pytorch.org/whl/cpu asks for it); CUDA builds for a driver:
# TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS      ?= test
# GPU=1: the install must be a CUDA build of torch (setup checks it; default: 1 where nvidia-smi lists a GPU)
GPU         ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo 1 || echo 0)

RECIPE      ?= recipes/tiny/sft.yaml
STRATEGY    ?= ddp
GPUS        ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ "$$n" -gt 0 ] && echo $$n || echo 2)
NODES       ?= 1
# train-hsdp, train-fsdp-tp: replica groups (default one per node); the processes of each group shard the model
HSDP_REPLICAS ?= $(NODES)
# train-zero3-ulysses: processes per sequence (Ulysses sequence parallelism; at most the GPUs of a node)
SP          ?= 2
# train-fsdp-cp: processes per sequence around the attention ring (context parallelism)
CP          ?= 2
# train-fsdp-tp: processes per tensor-parallel group (within a node); FSDP2 shards over GPUS x NODES / TP groups
TP          ?= 2
# train-fsdp-ep: processes each MoE block's experts are split over (default: the GPUs of a node); it divides
# GPUS x NODES / HSDP_REPLICAS, and the processes holding the same experts shard them
EP          ?= $(GPUS)
# train-fsdp-pp: pipeline stages (the model's decoder layers cut into PP runs); it divides GPUS x NODES, and FSDP2
# shards each stage over GPUS x NODES / PP processes (stages dp apart: PP=NODES puts one stage on each node)
PP          ?= 2
NODE_RANK   ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
ARGS        ?=
RUN         ?=
# make eval: lm-eval task names (eval_tasks/ holds the project's own, over its synthetic data)
TASKS       ?= disttrain_tiny_choice
PYTEST_ARGS ?=
TINY_MODEL  := artifacts/tiny-llama
TINY_STUDENT := artifacts/tiny-student
TINY_VLM    := artifacts/tiny-gemma3-vl

RDZV_TIMEOUT ?= 600
# On SIGTERM (preemption, scancel, Ctrl-C) the launcher's torchrun agent forwards the signal and SIGKILLs the
# workers this many seconds later (torch's default: 30, too short to checkpoint a large model).
SHUTDOWN_TIMEOUT ?= 600
HOSTFILE    ?=
MAX_RESTARTS ?= 0
# make k8s / make sky: the container image (this repository and its .venv at /workspace/disttrain), the claim or
# bucket output.dir goes on, the Kubernetes kind (job: indexed Job + headless Service; pytorchjob: Kubeflow's),
# SkyPilot's accelerator name and spot instances; OUT: the file to write (default: stdout)
IMAGE       ?=
PVC         ?=
K8S_KIND    ?= job
BUCKET      ?=
ACCELERATOR ?= H100
SPOT        ?= 0
# make k8s: per-pod CPU and memory requests (default: from GPUS and the recipe's model), a Kueue queue (gang
# admission), and space-separated NAME=value variables, key=value node selectors, key[=value]:Effect tolerations
POD_CPUS    ?=
POD_MEMORY  ?=
QUEUE       ?=
POD_ENV     ?=
NODE_SELECTOR ?=
TOLERATIONS ?=
# make ray: stop every node (as a SIGTERM does: they checkpoint) after this many seconds; empty: no limit
RAY_TIMEOUT ?=

# One launcher per node (run the same make command on every node with its NODE_RANK), or, for DeepSpeed
# configs with HOSTFILE=path, one command on the head node that starts the others through pdsh/ssh.
# Node 0 first checks that the rendezvous port is free and names its owner if not (disttrain/runtime/ports.py).
# MAX_RESTARTS=N: torchrun restarts all workers up to N times after a failure (they resume from the newest
# checkpoint); that needs the c10d rendezvous, on MASTER_ADDR:MASTER_PORT (PET_RDZV_ENDPOINT: accelerate sets
# it only for several nodes, torch's default is a fixed port 29400), and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# so that each restart gets a fresh store (with the shared one, restarted workers can read the dead workers'
# addresses: pytorch/pytorch#135712, "Connection refused" in gloo's/NCCL's connect).
RESTART_ENV = $(if $(filter-out 0,$(MAX_RESTARTS)),TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
	PET_RDZV_ENDPOINT=$(MASTER_ADDR):$(MASTER_PORT))
LAUNCH = $(PY) -m disttrain.runtime.ports --port $(MASTER_PORT) --nodes $(NODES) --node-rank $(NODE_RANK) && \
	TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$(SHUTDOWN_TIMEOUT) $(RESTART_ENV) $(call MESH_ENV,$(1)) \
	$(ACCELERATE) launch --config_file accelerate_configs/$(1).yaml \
	--num_processes $$(( $(GPUS) * $(NODES) )) --num_machines $(NODES) --machine_rank $(NODE_RANK) \
	--main_process_ip $(MASTER_ADDR) --main_process_port $(MASTER_PORT) --rdzv_conf timeout=$(RDZV_TIMEOUT) \
	$(if $(filter-out 0,$(MAX_RESTARTS)),--max_restarts $(MAX_RESTARTS) --rdzv_backend c10d) \
	$(if $(HOSTFILE),--deepspeed_multinode_launcher pdsh --deepspeed_hostfile $(HOSTFILE)) \
	$(call MESH_FLAGS,$(1))

# The parallelism flags of a config for GPUS x NODES processes: the one definition the train-* targets use (and so
# every cluster engine's nodes: disttrain/tools/cluster.py runs them; `make mesh-flags` prints them)
MESH_FLAGS = $(if $(filter hsdp,$(1)),--parallelism_config_dp_replicate_size $(HSDP_REPLICAS) \
	--parallelism_config_dp_shard_size $$(( $(GPUS) * $(NODES) / $(HSDP_REPLICAS) ))) \
	$(if $(filter zero3_ulysses,$(1)),--parallelism_config_sp_size $(SP) \
	--parallelism_config_dp_shard_size $$(( $(GPUS) * $(NODES) / $(SP) ))) \
	$(if $(filter fsdp_cp,$(1)),--parallelism_config_cp_size $(CP) \
	--parallelism_config_dp_shard_size $$(( $(GPUS) * $(NODES) / $(CP) ))) \
	$(if $(filter tp,$(1)),--parallelism_config_tp_size $$(( $(GPUS) * $(NODES) ))) \
	$(if $(filter fsdp_tp,$(1)),--parallelism_config_tp_size $(TP) --parallelism_config_dp_replicate_size $(HSDP_REPLICAS) \
	--parallelism_config_dp_shard_size $$(( $(GPUS) * $(NODES) / $(TP) / $(HSDP_REPLICAS) ))) \
	$(if $(filter fsdp_ep,$(1)),--parallelism_config_dp_replicate_size $(HSDP_REPLICAS) \
	--parallelism_config_dp_shard_size $$(( $(GPUS) * $(NODES) / $(HSDP_REPLICAS) )))
# ... and the one a config takes from the environment (accelerate has no expert-parallel dimension)
MESH_ENV = $(if $(filter fsdp_ep,$(1)),PARALLELISM_CONFIG_EP_SIZE=$(EP)) \
	$(if $(filter fsdp_pp,$(1)),PARALLELISM_CONFIG_PP_SIZE=$(PP))
# the mesh variables of STRATEGY, handed to every node's `make train-*` by the cluster entry (k8s, sky, ray)
CLUSTER_VARS = SHUTDOWN_TIMEOUT=$(SHUTDOWN_TIMEOUT) $(if $(filter hsdp fsdp_tp fsdp_ep,$(STRATEGY)),HSDP_REPLICAS=$(HSDP_REPLICAS)) \
	$(if $(filter fsdp_tp,$(STRATEGY)),TP=$(TP)) $(if $(filter zero3_ulysses,$(STRATEGY)),SP=$(SP)) \
	$(if $(filter fsdp_cp,$(STRATEGY)),CP=$(CP)) $(if $(filter fsdp_ep,$(STRATEGY)),EP=$(EP)) \
	$(if $(filter fsdp_pp,$(STRATEGY)),PP=$(PP))

.PHONY: help setup tiny train train-ddp train-fsdp train-fsdp-offload train-hsdp train-fsdp-cp train-tp train-fsdp-tp train-fsdp-ep train-fsdp-pp train-zero1 train-zero2 train-zero3 train-zero3-offload train-zero3-ulysses \
	test test-fast lint matrix docs mesh-flags preflight resume doctor diagnose cost bench bench-overhead bench-memory bench-rollouts bench-pairs bench-long bench-experts bench-data eval export report gpu-kit gpu-acceptance k8s sky ray clean

help: ## list targets and variables
	@echo "disttrain — make <target> [VAR=value ...]"
	@echo
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-22s %s\n", $$1, $$2}'
	@echo
	@echo "Variables: RECIPE=$(RECIPE)  GPUS=$(GPUS) (processes per node; CPU processes without GPUs)"
	@echo "           NODES=$(NODES) NODE_RANK=$(NODE_RANK) MASTER_ADDR=$(MASTER_ADDR) MASTER_PORT=$(MASTER_PORT)"
	@echo "           RDZV_TIMEOUT=$(RDZV_TIMEOUT)s (give up joining the job)  HOSTFILE= (DeepSpeed pdsh launch from the head node)"
	@echo "           MAX_RESTARTS=$(MAX_RESTARTS) (restart all workers after a failure, up to N times; they resume)"
	@echo "           HSDP_REPLICAS=$(HSDP_REPLICAS) (train-hsdp: replica groups, default one per node; each sharded over GPUS x NODES / HSDP_REPLICAS processes)"
	@echo "           SP=$(SP) (train-zero3-ulysses: processes per sequence; GPUS x NODES / SP groups read different rows)"
	@echo "           CP=$(CP) (train-fsdp-cp: processes per sequence around the attention ring; GPUS x NODES / CP groups)"
	@echo "           TP=$(TP) (train-fsdp-tp: processes per tensor-parallel group, within a node; FSDP2 over the GPUS x NODES / TP groups, replicated across HSDP_REPLICAS)"
	@echo "           EP=$(EP) (train-fsdp-ep: processes each MoE block's experts are split over, dividing GPUS x NODES / HSDP_REPLICAS; tokens travel to their experts)"
	@echo "           PP=$(PP) (train-fsdp-pp: pipeline stages, dividing GPUS x NODES and the model's layers; FSDP2 shards each stage over the rest)"
	@echo "           POD_CPUS= POD_MEMORY= QUEUE= POD_ENV='NAME=value ...' NODE_SELECTOR='k=v ...' TOLERATIONS='k[=v]:Effect ...' (make k8s)  RAY_TIMEOUT= (make ray: s)"
	@echo "           IMAGE= PVC= K8S_KIND=$(K8S_KIND) (make k8s)  BUCKET= ACCELERATOR=$(ACCELERATOR) SPOT=$(SPOT) (make sky)  OUT=file (k8s, sky: default stdout)"
	@echo "           SHUTDOWN_TIMEOUT=$(SHUTDOWN_TIMEOUT)s (after SIGTERM, how long the workers may checkpoint before they are killed)"
	@echo "           ARGS='training.max_steps=20 ...' (recipe overrides)"
	@echo "           STRATEGY=$(STRATEGY) (resume, preflight)  TORCH_SPEC=$(TORCH_SPEC)  TORCH_INDEX=$(TORCH_INDEX)  EXTRAS=$(EXTRAS)"
	@echo "           GPU=$(GPU) (setup: 1 = the install must be a CUDA build of torch; default from nvidia-smi)"
	@echo "           LOG=path (diagnose: a log file, a directory of rank logs, or a run's output dir)"
	@echo "           RUN='outputs/tiny-sft/ddp-2 ...' (report: run output dirs; eval: one run, checkpoint, model or adapter dir)"
	@echo "           CHECKPOINT=<run>/checkpoints/step-N OUT=dir (export)"
	@echo "           TASKS=$(TASKS) BASE=1 LIMIT=n INCLUDE=dir (eval: lm-eval tasks, the base model too, examples per task, your task YAMLs)"

# The install follows its arguments: one stamp per (TORCH_SPEC, TORCH_INDEX, EXTRAS), so `make setup
# TORCH_SPEC=torch EXTRAS=test,tracking` after a first `make train` installs again instead of "Nothing to be done";
# install-args.mk records them, so the next plain `make train` or `make test` keeps that install
INSTALL_ARGS := torch: $(TORCH_SPEC)$(if $(TORCH_INDEX), from $(TORCH_INDEX)), extras: [$(EXTRAS)]
INSTALLED    := $(VENV)/.installed-$(shell printf '%s' '$(INSTALL_ARGS)' | cksum | cut -d' ' -f1)

setup: $(INSTALLED) ## create .venv and install the project (TORCH_SPEC, TORCH_INDEX, EXTRAS: changing one reinstalls)

$(INSTALLED): pyproject.toml
	@if ls $(VENV)/.installed-* >/dev/null 2>&1; then echo "setup: installing $(INSTALL_ARGS) (.venv was installed with: $$(cat $(VENV)/.installed-* | head -1))"; fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@# the editable package's bytecode, once: with PYTHONDONTWRITEBYTECODE=1 (CI) every launched process would
	@# otherwise compile disttrain/ from source again (~0.1 s each, ~190 launches x 3 processes in `make test`)
	$(PY) -m compileall -q disttrain
	@# a CPU build on a GPU machine would train on the CPU: stop here (no stamp, so the next setup installs again)
	$(PY) -m disttrain.tools.doctor --torch-build $(if $(filter 1,$(GPU)),--expect-gpu)
	rm -f $(VENV)/.installed-*
	printf 'TORCH_SPEC ?= %s\nTORCH_INDEX ?= %s\nEXTRAS ?= %s\n' '$(TORCH_SPEC)' '$(TORCH_INDEX)' '$(EXTRAS)' \
		> $(VENV)/install-args.mk
	echo '$(INSTALL_ARGS)' > $@

tiny: setup $(TINY_MODEL)/config.json $(TINY_STUDENT)/config.json $(TINY_VLM)/config.json ## build the tiny local models (text; distillation's student; vision-language: recipes/tiny/vlm_sft.yaml)

$(TINY_MODEL)/config.json:
	$(PY) -m disttrain.tools.tiny model --out $(TINY_MODEL)

$(TINY_STUDENT)/config.json:
	$(PY) -m disttrain.tools.tiny student --out $(TINY_STUDENT)

$(TINY_VLM)/config.json:
	$(PY) -m disttrain.tools.tiny vlm --out $(TINY_VLM)

train: tiny ## train RECIPE on 1 process (GPU if present, else CPU): the embedded default
	$(ACCELERATE) launch --config_file accelerate_configs/single_gpu.yaml train.py --recipe $(RECIPE) $(ARGS)

train-ddp: tiny ## DDP on GPUS processes per node (NODES=… for several nodes)
	$(call LAUNCH,ddp) train.py --recipe $(RECIPE) $(ARGS)

train-fsdp: tiny ## FSDP2 full shard
	$(call LAUNCH,fsdp) train.py --recipe $(RECIPE) $(ARGS)

train-fsdp-offload: tiny ## FSDP2 with parameters and optimizer states offloaded to CPU
	$(call LAUNCH,fsdp_offload) train.py --recipe $(RECIPE) $(ARGS)

train-hsdp: tiny ## FSDP2 sharded within HSDP_REPLICAS groups (default: one per node), replicated across them
	$(call LAUNCH,hsdp) train.py --recipe $(RECIPE) $(ARGS)

train-fsdp-cp: tiny ## FSDP2 + context parallelism: each sequence split over CP processes, ring attention (long context)
	$(call LAUNCH,fsdp_cp) train.py --recipe $(RECIPE) $(ARGS)

train-tp: tiny ## tensor parallelism alone: each weight matrix split over the GPUS processes of one node
	$(call LAUNCH,tp) train.py --recipe $(RECIPE) $(ARGS)

train-fsdp-tp: tiny ## FSDP2 + tensor parallelism: weights split over TP processes, FSDP2 over the groups (HSDP across nodes)
	$(call LAUNCH,fsdp_tp) train.py --recipe $(RECIPE) $(ARGS)

train-fsdp-ep: tiny ## FSDP2 + expert parallelism (MoE): experts split over EP processes, tokens sent to them (HSDP across nodes)
	$(call LAUNCH,fsdp_ep) train.py --recipe $(RECIPE) $(ARGS)

train-fsdp-pp: tiny ## FSDP2 + pipeline parallelism: the layers cut into PP stages (1F1B / GPipe), FSDP2 over each stage's processes
	$(call LAUNCH,fsdp_pp) train.py --recipe $(RECIPE) $(ARGS)

k8s: setup ## Kubernetes manifests for RECIPE on NODES pods of GPUS GPUs (IMAGE=, PVC=, K8S_KIND=job|pytorchjob, OUT=file)
	$(PY) -m disttrain.tools.k8s --recipe $(RECIPE) --strategy $(STRATEGY) --nodes $(NODES) --gpus $(GPUS) \
	--image "$(IMAGE)" --pvc "$(PVC)" --kind $(K8S_KIND) $(if $(OUT),--out $(OUT)) \
	$(if $(filter-out 0,$(MAX_RESTARTS)),--max-restarts $(MAX_RESTARTS)) --cpus "$(POD_CPUS)" --memory "$(POD_MEMORY)" \
	--queue "$(QUEUE)" $(foreach e,$(POD_ENV),--env '$(e)') $(foreach e,$(NODE_SELECTOR),--node-selector '$(e)') \
	$(foreach e,$(TOLERATIONS),--toleration '$(e)') $(CLUSTER_VARS) $(ARGS)

sky: setup ## a SkyPilot task for RECIPE on NODES nodes of ACCELERATOR:GPUS (BUCKET=, SPOT=1, OUT=file)
	$(PY) -m disttrain.tools.sky --recipe $(RECIPE) --strategy $(STRATEGY) --nodes $(NODES) --gpus $(GPUS) \
	--accelerator "$(ACCELERATOR)" --bucket "$(BUCKET)" --spot $(SPOT) $(if $(OUT),--out $(OUT)) \
	$(if $(filter-out 0,$(MAX_RESTARTS)),--max-restarts $(MAX_RESTARTS)) $(CLUSTER_VARS) $(ARGS)

ray: setup ## train RECIPE on NODES nodes of a Ray cluster (RAY_ADDRESS; GPUS per node), each running the cluster entry
	$(PY) -m disttrain.tools.ray_launch --recipe $(RECIPE) --strategy $(STRATEGY) --nodes $(NODES) --gpus $(GPUS) \
	$(if $(RAY_TIMEOUT),--timeout-s $(RAY_TIMEOUT)) $(CLUSTER_VARS) $(ARGS)

train-zero1: tiny ## DeepSpeed ZeRO-1
	$(call LAUNCH,zero1) train.py --recipe $(RECIPE) $(ARGS)

train-zero2: tiny ## DeepSpeed ZeRO-2
	$(call LAUNCH,zero2) train.py --recipe $(RECIPE) $(ARGS)

train-zero3: tiny ## DeepSpeed ZeRO-3
	$(call LAUNCH,zero3) train.py --recipe $(RECIPE) $(ARGS)

train-zero3-offload: tiny ## DeepSpeed ZeRO-3 with optimizer + parameter offload to CPU
	$(call LAUNCH,zero3_offload) train.py --recipe $(RECIPE) $(ARGS)

train-zero3-ulysses: tiny ## ZeRO-3 + Ulysses: each sequence split over SP processes (long context)
	$(call LAUNCH,zero3_ulysses) train.py --recipe $(RECIPE) $(ARGS)

resume: tiny ## resume RECIPE under STRATEGY from the newest complete checkpoint in its output.dir
	$(call LAUNCH,$(STRATEGY)) train.py --recipe $(RECIPE) output.resume=auto $(ARGS)

preflight: tiny ## dry-run RECIPE under STRATEGY on 2 CPU processes with a shrunk model (before renting GPUs)
	$(PY) -m disttrain.tools.preflight --recipe $(RECIPE) --strategy $(STRATEGY) $(ARGS)

BENCH_STRATEGIES ?= ddp,fsdp,zero1,zero2,zero3,zero3_offload
STEPS       ?= 30
# make bench-rollouts: the online-RL recipe, its runs (strategy, or strategy:per_layer for the per-layer gathers
# of a model too large to gather whole) and steps
RL_RECIPE   ?= recipes/tiny/grpo.yaml
RUNS        ?= ddp,fsdp,zero3
ROLLOUT_STEPS ?= 40

bench: tiny ## RECIPE under each of BENCH_STRATEGIES for STEPS steps -> bench/results.{json,md,png}
	$(PY) -m disttrain.bench.strategies --recipe $(RECIPE) --strategies $(BENCH_STRATEGIES) --steps $(STEPS) --nproc $(GPUS) $(ARGS)

bench-overhead: tiny ## train.py vs a raw PyTorch DDP loop vs HF Trainer, same data and batch -> bench/overhead/
	$(PY) -m disttrain.bench.overhead --recipe $(RECIPE) --nproc $(GPUS) $(ARGS)

bench-memory: setup ## loss memory and step time per strategy: plain (full logits), chunked, TRL's fused head; 152k vocabulary -> bench/memory/
	$(PY) -m disttrain.bench.memory --nproc $(GPUS) $(ARGS)

bench-distill: setup ## the distillation loss's peak memory beside the SFT chunked loss's, 152k vocabulary, 4 x 1024 tokens -> bench/distill/
	$(PY) -m disttrain.bench.distill $(ARGS)

bench-experts: setup ## expert parallelism vs FSDP2 alone on a mixture of experts: states per process (vs make cost), step time, peak memory -> bench/experts/
	$(PY) -m disttrain.bench.experts --nproc $(GPUS) --ep $(EP) $(ARGS)

bench-rollouts: tiny ## online RL's sampling per run of RUNS (strategy[:per_layer]) on RL_RECIPE: rollout s vs the first run, sampling share, rewards equal -> bench/rollouts/
	$(PY) -m disttrain.bench.rollouts --recipe $(RL_RECIPE) --runs $(RUNS) --steps $(ROLLOUT_STEPS) --nproc $(GPUS) $(ARGS)

bench-pairs: tiny ## preference tuning padded vs padding-free (data.packing) on long-tailed pair lengths: real tokens/s, losses equal -> bench/pairs/
	$(PY) -m disttrain.bench.pairs $(ARGS)

bench-long: setup ## peak memory per rank at one long sequence, ZeRO-3 vs ZeRO-3 + Ulysses (sp 1, 2) -> bench/long/
	$(PY) -m disttrain.bench.long --nproc $(GPUS) $(ARGS)

export: setup ## a checkpoint of any strategy (CHECKPOINT=<run>/checkpoints/step-N) as a HF model dir -> OUT (default <run>/exported/step-N)
	@test -n "$(CHECKPOINT)" || { echo "error: give CHECKPOINT=<run>/checkpoints/step-N" >&2; exit 2; }
	$(PY) -m disttrain.model.from_checkpoint $(CHECKPOINT) $(OUT)

report: setup ## summary table of RUN (one or several output dirs), with their plots and model cards
	$(PY) -m disttrain.report $(RUN)

eval: tiny ## score RUN (a run dir, checkpoint, model dir or LoRA adapter) on TASKS with lm-evaluation-harness; BASE=1 adds its base model -> RUN/eval/results.json
	@test -n "$(RUN)" || { echo "error: give RUN=<a run's output dir, a checkpoint, a model dir or an adapter dir>" >&2; exit 2; }
	$(PY) -m disttrain.evaluation --run $(RUN) --tasks $(TASKS) $(if $(filter 1,$(BASE)),--base) \
	$(if $(LIMIT),--limit $(LIMIT)) $(if $(INCLUDE),--include $(INCLUDE))

bench-data: tiny ## data preparation: ours vs one batched tokenizer pass, memory vs size, DDP time to first step -> bench/data/
	$(PY) -m disttrain.bench.data $(ARGS)

gpu-kit: setup ## the wheels the lent GPU machine lacks -> gpu_kit/ (< 64 MiB), and the command to run there
	$(PY) scripts/gpu/kit.py --out gpu_kit $(ARGS)

gpu-acceptance: tiny ## on a GPU machine: check every GPU-only claim -> gpu_acceptance/acceptance.{json,md} (ARGS='--wheels gpu_kit')
	$(PY) scripts/gpu/acceptance.py --out gpu_acceptance $(ARGS)

doctor: setup ## RECIPE's machine: GPUs, CUDA/NCCL, libraries, disk, /dev/shm, limits, network + all_reduce/all_gather bandwidth
	$(PY) -m disttrain.tools.doctor --nproc $(GPUS) --nodes $(NODES) --node-rank $(NODE_RANK) --master-addr $(MASTER_ADDR) \
		$(if $(filter-out 1,$(NODES)),--master-port $(MASTER_PORT)) --recipe $(RECIPE) $(ARGS)

diagnose: setup ## name the failure in a log file or output dir: make diagnose LOG=path
	@test -n "$(LOG)" || { echo "error: give LOG=path (a log file, a directory of rank logs, or a run's output dir)" >&2; exit 2; }
	$(PY) -m disttrain.tools.diagnose $(LOG) $(ARGS)

cost: setup ## time, cost and memory fit per strategy, e.g. ARGS='--recipe R --tokens 1e9 --gpu H100 --gpus 8'
	$(PY) -m disttrain.tools.cost $(or $(ARGS),--params 7e9 --tokens 100e9 --gpu "RTX 4090" --gpus 4 --strategy fsdp)

# Two test processes (pytest-xdist): a launch is mostly start-up on one core at a time, so two overlap well on
# 2 cores; an idle one takes tests queued for the other (worksteal). A run several tests read is made once by
# whichever process asks first (tests/conftest.py, SharedRuns). TEST_JOBS=0: one process.
TEST_JOBS   ?= 2

mesh-flags: ## print the parallelism flags `accelerate launch` needs for STRATEGY (a config name) on GPUS x NODES
	@echo $(call MESH_FLAGS,$(STRATEGY))

matrix: setup ## regenerate docs/compatibility.md from the feature x config declaration (disttrain/recipe/matrix.py)
	$(PY) -m disttrain.recipe.matrix

lint: setup ## ruff: pycodestyle and pyflakes at the code's line length (pyproject.toml), on everything Python here
	$(PY) -m ruff check disttrain train.py tests scripts

docs: setup ## regenerate the generated docs: recipe fields (from the schema), the matrix, the GPU acceptance items
	$(PY) -m disttrain.recipe.reference
	$(PY) -m disttrain.recipe.matrix
	$(PY) scripts/gpu/acceptance.py --write-docs docs/gpu.md

test: tiny ## the whole suite, what CI runs: unit tests + multi-process launches on CPU, workers forked warm (TEST_JOBS processes)
	$(PY) -m pytest -n $(TEST_JOBS) --dist worksteal $(PYTEST_ARGS)

test-fast: tiny ## the unit tests only, no launches, no downloads (~30 s): the inner loop while developing
	$(PY) -m pytest -m "not launch and not network and not heavy" $(PYTEST_ARGS)

clean: ## remove outputs and the tiny model (keeps .venv)
	rm -rf outputs artifacts bench gpu_acceptance gpu_kit
