"""The distributed world this launch runs in.

    backends.py  the Accelerator for the launched strategy, on GPUs or on CPU processes over gloo
    fsdp_cpu.py  the small adapters that let FSDP2 and TP run on CPU processes (tests, preflight)
    guards.py    hangs named by phase and step, replica checksums, loss spread, collective failures in one line
    launcher.py  `accelerate launch` command lines for tools and tests; killing a launch's process tree
    ports.py     the rendezvous port: free, or who holds it
    startup.py   what each process pays before its first step, cheaper: the garbage collector paused
"""
