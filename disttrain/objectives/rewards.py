"""Rewards for training.objective: grpo: Python functions named in the recipe (rl.rewards), called as TRL calls
reward functions -- `f(prompts=, completions=, completion_ids=, **columns)` with one entry per completion and the
prompt's other dataset columns by name, returning one number (or None: not scored) per completion -- so TRL's own
(`trl.rewards:accuracy_reward`, `think_format_reward`) and any written for TRL work as they are. A conversational
prompt's completions are `[{"role": "assistant", "content": text}]`, a plain prompt's are the text.

Advantages as TRL computes them (sum_then_normalize): the weighted sum of the functions' rewards (None as NaN,
left out of the sums), minus its group's mean (the prompt's num_generations completions), divided by the
group's std (scale_rewards: group), by the std of every reward of the step on all ranks (batch) or not at all
(none), plus 1e-4. A completion no function scored gets advantage 0. rl.advantage picks another estimator:
rloo (the mean of the group's other completions as the baseline, optionally whitened over the step: TRL's
RLOOTrainer) or reinforce_pp (REINFORCE++-baseline: the group's mean as the baseline, then whitened over every
completion token of the step: verl's reinforce_plus_plus_baseline). The step's statistics come from every data
rank (step_statistics), so any split of the step equals one process.

What a reward function does wrong is one line naming it and the completion: an exception (the function is
called again on that completion alone to find it), a count other than one per completion, a value that is not
a number. A function that needs a dataset column the data lacks is named before any model loads.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from disttrain.errors import DisttrainError

PASSED = ("prompts", "completions", "completion_ids")  # what every reward function is given beside the columns
# what TRL also hands a reward function: the run's progress (trainer_state.global_step, .epoch, .max_steps) and
# two callbacks, log_metric(name, value) (a scalar averaged into the next log line) and log_extra(column, values)
# (one value per completion, shown beside the logged completions); given to the functions that take them
TRL_EXTRAS = ("trainer_state", "log_metric", "log_extra")


def load_function(spec: str, where: str) -> Callable:
    """`module:function` (a dotted module, or a .py file relative to the working directory) -> the function."""
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise DisttrainError(f"{where}: {spec!r} is not module:function (e.g. trl.rewards:think_format_reward or "
                             "recipes/tiny/rewards.py:exact_answer)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise DisttrainError(f"{where}: {module_name} is not a file (paths are relative to the directory "
                                     "the run starts in)")
            unique = f"disttrain_rewards_{abs(hash(str(path.resolve())))}"
            module = sys.modules.get(unique)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(unique, path)
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[unique] = module
                loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except DisttrainError:
        raise
    except Exception as exc:  # ImportError, or the module's own code failing as it is imported
        raise DisttrainError(f"{where}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise DisttrainError(f"{where}: {module_name} has no function {name!r}")
    return function


def needed_columns(function: Callable) -> list[str]:
    """The keyword arguments a reward function cannot do without, beyond what it is always given."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is inspect.Parameter.empty and p.name not in PASSED + TRL_EXTRAS
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def takes(function: Callable, name: str) -> bool:
    """Whether `function` accepts the keyword `name` (by name or through **kwargs)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind == p.VAR_KEYWORD for p in parameters)


def load_reward(spec, where: str) -> Callable:
    """rl.rewards[i].function, or the function a factory returns when the recipe gives its `args` (TRL's
    get_soft_overlong_punishment(max_completion_len=..., soft_punish_cache=...), say)."""
    function = load_function(spec.function, where)
    if spec.args is None:
        return function
    try:
        made = function(**spec.args)
    except Exception as exc:
        raise DisttrainError(f"{where}: {spec.function}(**args) raised {type(exc).__name__}: {str(exc)[:200]} "
                             "(args are passed by name)") from None
    if not callable(made):
        raise DisttrainError(f"{where}: {spec.function}(**args) returned {type(made).__name__}, not a reward "
                             "function (give args only to a factory that returns one)")
    return made


@dataclass
class Reward:
    name: str  # as the recipe names it (metrics: rewards/<function name>)
    function: Callable
    weight: float

    def __post_init__(self):
        self.extras = {k for k in TRL_EXTRAS if takes(self.function, k)}  # read once, not at every micro-batch


def reward_names(rl) -> list[str]:
    """Each reward's name in the metrics (rewards/<name>/mean): the function's (or the reward model's directory's),
    with its index where two share one."""
    names = [spec.label() for spec in rl.rewards]
    return [f"{name}_{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


class Rewards:
    """The recipe's reward functions, loaded and checked against the data's columns."""

    def __init__(self, rl, environment: str | None = None):
        """`environment`: the name of an rl.environment class with get_reward(), a reward of weight 1 (TRL's)."""
        self.items = [Reward(name, load_reward(spec, f"rl.rewards[{i}]") if spec.function else
                             RewardModel(spec.model, f"rl.rewards[{i}]"), spec.weight)
                      for i, (name, spec) in enumerate(zip(reward_names(rl), rl.rewards))]
        if environment is not None:
            self.items.append(Reward(environment, environment_reward, 1.0))
        self.weights = torch.tensor([r.weight for r in self.items], dtype=torch.float32)
        self.names = [r.name for r in self.items]

    def check_columns(self, columns: set[str], data: str) -> None:
        """Every column a function requires is in the data, else one line naming both."""
        for i, reward in enumerate(self.items):
            missing = [c for c in needed_columns(reward.function) if c not in columns]
            if missing:
                raise DisttrainError(f"rl.rewards[{i}] ({reward.name}) needs the column {missing[0]!r}, which {data} "
                                     f"does not have (its columns: {', '.join(sorted(columns))}); map it with the "
                                     "source's columns or use another function")

    def prepare(self, accelerator) -> None:
        """Reward models learn where the run's weights live (a ZeRO-3 run must not partition theirs)."""
        for reward in self.items:
            if isinstance(reward.function, RewardModel):
                reward.function.accelerator = accelerator

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
              where: Callable[[int], str], extras: dict | None = None) -> torch.Tensor:
        """[completions, functions] float32 rewards (NaN: not scored). `where(i)` names completion i; `extras`:
        TRL_EXTRAS by name, given to the functions that take them."""
        table = torch.full((len(completions), len(self.items)), float("nan"))
        for j, reward in enumerate(self.items):
            passed = {**columns, **{k: v for k, v in (extras or {}).items() if k in reward.extras}}
            values = self._call(reward, prompts, completions, completion_ids, passed, where, j)
            for i, value in enumerate(values):
                if value is None:
                    continue
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    value = value.item()
                if not isinstance(value, (int, float)):  # bool is an int; NaN stays "not scored", as TRL
                    raise DisttrainError(f"rl.rewards[{j}] ({reward.name}) returned {value!r:.60} for {where(i)}: "
                                         "a reward is a number (or None: not scored)")
                table[i, j] = float(value)
        return table

    @staticmethod
    def _call(reward: Reward, prompts, completions, completion_ids, columns, where, index: int) -> list:
        def call(rows):
            return reward.function(prompts=[prompts[i] for i in rows], completions=[completions[i] for i in rows],
                                   completion_ids=[completion_ids[i] for i in rows],
                                   **{k: values if k in TRL_EXTRAS else [values[i] for i in rows]
                                      for k, values in columns.items()})

        rows = list(range(len(completions)))
        try:
            values = call(rows)
        except Exception as exc:
            for i in rows:  # the first completion it fails on, by itself
                try:
                    call([i])
                except Exception as alone:
                    raise DisttrainError(f"rl.rewards[{index}] ({reward.name}) raised {type(alone).__name__}: "
                                         f"{str(alone)[:200]} on {where(i)}") from None
            raise DisttrainError(f"rl.rewards[{index}] ({reward.name}) raised {type(exc).__name__}: {str(exc)[:200]} "
                                 "on a batch of completions (each alone passes)") from None
        try:
            values = list(values)
        except TypeError:
            raise DisttrainError(f"rl.rewards[{index}] ({reward.name}) returned {type(values).__name__}, not a list "
                                 "of one reward per completion") from None
        if len(values) != len(completions):
            raise DisttrainError(f"rl.rewards[{index}] ({reward.name}) returned {len(values)} rewards for "
                                 f"{len(completions)} completions: one per completion")
        return values


def environment_reward(environments: list, **_) -> list:
    """An rl.environment's own reward: each completion's instance's get_reward(), after its last turn."""
    return [e.get_reward() for e in environments]


def weighted_sum(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: the functions' rewards weighted and summed (NaN left out; NaN if none scored)."""
    summed = (rewards * weights.unsqueeze(0)).nansum(dim=1)
    summed[torch.isnan(rewards).all(dim=1)] = float("nan")
    return summed


class RewardModel:
    """rl.rewards[].model: a sequence-classification checkpoint with one label, called as a reward function. It
    scores what the policy saw and wrote -- a chat prompt with the completion as the assistant's turn, through the
    reward model's own chat template (as TRL does), or the plain prompt followed by the completion -- right-padded,
    the score read at each row's last token. Loaded on first use, whole on this rank's device, in eval mode."""

    def __init__(self, path: str, where: str):
        self.path, self.where = path, where
        self.model = self.tokenizer = None
        self.accelerator = None  # set by Rewards.prepare

    def _load(self):
        from disttrain.model.export import without_zero3_init

        with without_zero3_init(self.accelerator):  # a plain model: ZeRO-3's registered config would partition it
            self._load_whole()

    def _load_whole(self):
        from pathlib import Path

        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
            head = {"num_labels": 1, "pad_token_id": self.tokenizer.pad_token_id}
            if (Path(self.path) / "adapter_config.json").is_file():  # LoRA: the base with the adapter and score head
                from peft import AutoPeftModelForSequenceClassification

                self.model = AutoPeftModelForSequenceClassification.from_pretrained(self.path, **head)
            else:
                self.model = AutoModelForSequenceClassification.from_pretrained(self.path, use_safetensors=True)
        except Exception as exc:
            raise DisttrainError(f"{self.where}: {self.path} is not a loadable sequence-classification model: "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        if self.model.config.num_labels != 1:
            raise DisttrainError(f"{self.where}: {self.path} has {self.model.config.num_labels} labels; a reward model "
                                 "has one (a scalar score)")
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model.to(device).eval()

    def texts(self, prompts: list, completions: list) -> list[str]:
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):  # chat: the completion is the assistant's turn
                messages = prompt + (completion if isinstance(completion, list) else
                                     [{"role": "assistant", "content": completion}])
                out.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
            else:
                out.append(prompt + (completion[0]["content"] if isinstance(completion, list) else completion))
        return out

    @torch.no_grad()
    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        if self.model is None:
            self._load()
        self.tokenizer.padding_side = "right"
        inputs = self.tokenizer(self.texts(prompts, completions), return_tensors="pt", padding=True,
                                add_special_tokens=False).to(self.model.device)
        return self.model(**inputs).logits[:, 0].float().tolist()


def baselined(summed: torch.Tensor, group: int, estimator: str) -> torch.Tensor:
    """Each completion's summed reward minus its baseline, completions grouped by prompt in consecutive runs of
    `group`: the group's mean (grpo, reinforce_pp), or the mean of the group's other scored completions (rloo, as
    TRL's RLOOTrainer: NaN where it has none). NaN where the completion was not scored."""
    grouped = summed.view(-1, group)
    if estimator == "rloo":
        others = (~torch.isnan(grouped)).sum(dim=1, keepdim=True) - 1
        baseline = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / others  # 0/0: NaN, advantage 0
        return (grouped - baseline).view(-1)
    return summed - torch.nanmean(grouped, dim=1).repeat_interleave(group)


def step_statistics(estimator: str, scale: str, values: torch.Tensor,
                    tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What a `batch` scale needs from every data rank's completions of the step (`values`: their summed rewards
    for grpo, else their baselined rewards; `tokens`: each one's completion tokens trained on), as (shift, scale):
    grpo divides by the rewards' std (TRL's scale_rewards=batch); rloo whitens the advantages (TRL's
    normalize_advantages: nanmean, nanstd); reinforce_pp whitens them over tokens (verl's masked_whiten: the mean
    and unbiased variance of every completion token, each token carrying its completion's value). None: no
    batch scale."""
    if scale != "batch":
        return None
    if estimator == "grpo":
        return torch.zeros(()), nanstd(values) + 1e-4
    if estimator == "rloo":
        return torch.nanmean(values), nanstd(values) + 1e-4
    scored = ~torch.isnan(values)
    weight, value = tokens[scored].double(), values[scored].double()
    count = weight.sum()
    mean = (weight * value).sum() / count
    variance = (weight * (value - mean) ** 2).sum() / count * count / (count - 1)  # unbiased over tokens
    return mean.float(), torch.sqrt(variance + 1e-8).float()


def advantages(rewards: torch.Tensor, weights: torch.Tensor, group: int, estimator: str, scale: str,
               statistics: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, summed rewards) of [completions, functions] rewards, completions grouped by prompt in
    consecutive runs of `group`; `statistics`: step_statistics of the step on all ranks (scale: batch). A
    completion with no baseline or no score gets advantage 0."""
    summed = weighted_sum(rewards, weights)
    result = baselined(summed, group, estimator)
    if scale == "group":  # grpo's own
        result = result / (nanstd(summed.view(-1, group), dim=1).repeat_interleave(group) + 1e-4)
    elif scale == "batch":
        shift, spread = statistics
        result = (result - shift) / spread
    return torch.nan_to_num(result, nan=0.0), summed


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased std ignoring NaNs (TRL's nanstd)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True)
    variance = variance * count / (count - 1)
    std = torch.sqrt(variance)
    return std.squeeze(dim) if dim is not None else std.reshape(())
