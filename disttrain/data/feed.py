"""The data feed: how training batches reach the loop. A feed owns its loader, its step count and its resume
state, so that train.py and the loop never ask which kind it is.

    MapFeed     the tokenised dataset (cached by `datasets`): accelerate shards its batches across the data
                ranks, reshuffled every epoch from the seed; on resume its position follows from the step.
                Under sequence parallelism the processes of a group read the same batches and each keeps its
                slice of every sequence (collation.SequenceShard); under context parallelism they read the same
                whole sequences, cut by the loop's context (collation.ContextShard)
    StreamFeed  data.streaming: each data rank reads and tokenises its own shards lazily; its position is
                saved per rank in every checkpoint and loaded back, never replayed
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterator

from disttrain.data.collation import ContextShard, SequenceShard, make_loader
from disttrain.data.streaming import StreamLoader, shards_note, stream_rows
from disttrain.errors import DataError


def steps_per_epoch(num_rows: int, micro_batch_size: int, num_processes: int, grad_accum: int) -> int:
    """Optimizer steps per epoch: accelerate shards full batches across ranks (drop_last), and a trailing
    window shorter than grad_accum is dropped so every step sees the same number of micro-batches."""
    return (num_rows // micro_batch_size) // num_processes // grad_accum


class LoaderSteps:
    """A prepared loader as the loop's step source (training/loop.StepSource): grad_accum micro-batches per
    optimizer step, epoch after epoch (each epoch's permutation set on the loader, the same on every rank), and on
    resume the consumed micro-batches of the current epoch skipped (a stream that loaded its own position is
    not skipped)."""

    def __init__(self, loader, per_epoch: int, total_steps: int):
        self.loader, self.per_epoch, self.total_steps = loader, per_epoch, total_steps

    def windows(self, run, state) -> Iterator[list[dict]]:
        accelerator = run.accelerator
        accumulation = accelerator.gradient_accumulation_steps
        while state.step < self.total_steps:
            state.epoch = state.step // self.per_epoch
            self.loader.set_epoch(state.epoch)
            consumed = (state.step % self.per_epoch) * accumulation  # non-zero only right after a mid-epoch resume
            if consumed and not getattr(self.loader, "resumes_itself", False):
                batches = iter(accelerator.skip_first_batches(self.loader, consumed))
            else:
                batches = iter(self.loader)
            for _ in range(state.step % self.per_epoch, self.per_epoch):
                yield list(islice(batches, accumulation))


class _Feed:
    """What both feeds give the loop once prepared: their loader as the step source."""

    loader = None
    per_epoch = total_steps = 0

    def windows(self, run, state) -> Iterator[list[dict]]:
        return LoaderSteps(self.loader, self.per_epoch, self.total_steps).windows(run, state)


class MapFeed(_Feed):
    rank_state = None  # nothing per rank to save: the position follows from the step

    def __init__(self, recipe, train_set, data_rank: int, data_ranks: int, sequence_slice: tuple[int, int] | None,
                 context_slice: tuple[int, int] | None = None):
        cfg = recipe.training
        self.recipe, self.train_set, self.loader = recipe, train_set, None
        self.data_rank, self.data_ranks, self.sequence_slice = data_rank, data_ranks, sequence_slice
        self.context_slice = context_slice
        self.per_epoch = steps_per_epoch(len(train_set), cfg.micro_batch_size, data_ranks, cfg.grad_accum)
        if self.per_epoch == 0:
            raise DataError(f"{recipe.data.path or 'data.sources'}: {len(train_set)} training rows cannot fill one "
                            f"optimizer step of micro_batch_size x grad_accum x processes = "
                            f"{cfg.micro_batch_size * cfg.grad_accum * data_ranks} rows")
        self.total_steps = cfg.max_steps or self.per_epoch * cfg.epochs
        self.notes: list[str] = []

    def prepare(self, accelerator, collator, model, optimizer, scheduler):
        """accelerator.prepare the model, optimizer and schedule together with this feed's loader."""
        cfg = self.recipe.training
        if self.sequence_slice is not None:
            collator = SequenceShard(collator, *self.sequence_slice)
        if self.context_slice is not None:
            collator = ContextShard(collator, *self.context_slice)
        loader = make_loader(self.train_set, cfg.micro_batch_size, collator, self.recipe.data.shuffle, True, cfg.seed)
        if self.data_ranks == accelerator.num_processes:
            model, optimizer, self.loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        else:  # the processes of a sequence group share rows: sharded by data rank (under Ulysses accelerate
            # would use the process rank, and wrap it in DeepSpeed's adapter, which can neither reshuffle nor skip)
            from disttrain.runtime.backends import set_deepspeed_micro_batch, shard_loader

            set_deepspeed_micro_batch(accelerator, cfg.micro_batch_size)
            model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
            self.loader = shard_loader(accelerator, loader, self.data_rank, self.data_ranks)
        assert len(self.loader) // cfg.grad_accum == self.per_epoch, "steps_per_epoch disagrees with accelerate"
        return model, optimizer, scheduler

    def restore(self, rank_state: dict) -> None:
        """Nothing is saved (rank_state is None): the step says where the epoch's permutation stood."""


class StreamFeed(_Feed):
    def __init__(self, recipe, tokenizer, data_rank: int, data_ranks: int):
        self.recipe, self.tokenizer, self.loader = recipe, tokenizer, None
        self.data_rank, self.data_ranks = data_rank, data_ranks
        self.per_epoch = self.total_steps = recipe.training.max_steps  # a stream has no length to count
        self.notes = shards_note(recipe.data, data_ranks)

    def prepare(self, accelerator, collator, model, optimizer, scheduler):
        """This rank's shards, on its device; the loader is not handed to accelerate (it would split it again)."""
        from disttrain.runtime.backends import set_deepspeed_micro_batch

        cfg = self.recipe.training
        rows = stream_rows(self.recipe.data, self.tokenizer, cfg.seed, self.data_rank, self.data_ranks)
        self.loader = StreamLoader(rows, cfg.micro_batch_size, collator, accelerator.device)
        set_deepspeed_micro_batch(accelerator, cfg.micro_batch_size)
        return accelerator.prepare(model, optimizer, scheduler)

    @property
    def rank_state(self) -> Callable[[], dict]:
        return self.loader.state_dict

    def restore(self, rank_state: dict) -> None:
        """Continue where this rank's stream stopped, without replaying it."""
        self.loader.load_state_dict(rank_state)


def feed_for(recipe, train_set, tokenizer, plan, accelerator) -> MapFeed | StreamFeed:
    """The recipe's feed for this process; its notes (which shards go where) printed once."""
    if recipe.data.streaming:
        feed = StreamFeed(recipe, tokenizer, plan.data_rank(accelerator), plan.data_ranks(accelerator))
    else:
        feed = MapFeed(recipe, train_set, plan.data_rank(accelerator), plan.data_ranks(accelerator),
                       plan.sequence_slice(accelerator), plan.context_slice(accelerator))
    for note in feed.notes:
        accelerator.print(note)
    return feed
