"""How the launch is split, in one place.

    plan.py     ParallelPlan: read once from what `accelerate launch` set (strategy, ZeRO stage, processes, the
                mesh); which data rank a process is, which slice of a sequence it keeps, what it counts, how eval
                sets are read, what a micro-batch runs inside, what model loading needs; it checks a recipe and
                a model config against itself
    modes.py    one object per mode (data parallel, Ulysses, the ring, tensor and expert parallelism) answering
                the same questions; the plan holds the launch's and asks it
    mesh.py     the launch's mesh sizes read and checked (HSDP, Ulysses, context, tensor, expert parallelism)
    checks.py   what each mesh refuses of a recipe and of a model's config, one line each
"""
