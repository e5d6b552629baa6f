"""Benchmarks (`make bench*`), results in files; speed targets live here, never in unit tests.

    strategies.py  `make bench`: the recipe under each strategy: tokens/s, MFU, memory, step time
    overhead.py    `make bench-overhead`: train.py vs a raw PyTorch DDP loop vs transformers' Trainer
    memory.py      `make bench-memory`: the loss's share of peak memory, full logits vs chunked
    long.py        `make bench-long`: peak memory per rank at one long sequence, ZeRO-3 vs + Ulysses
    experts.py     `make bench-experts`: expert parallelism vs FSDP2 alone: states per process vs the planner, speed
    distill.py     `make bench-distill`: the distillation loss's peak memory beside the SFT chunked loss's
    data.py        `make bench-data`: data preparation vs the tokenizer's floor, memory, time to first step
"""
