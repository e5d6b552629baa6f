"""Online RL's metrics (training.objective: grpo): what the rollouts and the policy loss add up between two log
lines, reduced over every rank when a line is written (the names TRL logs: reward, reward_std, rewards/<f>/mean,
frac_reward_zero_std, completions/*, kl, entropy, clip_ratio/*), plus the reward functions' log_metric values."""

from __future__ import annotations

import torch

from disttrain.objectives.policy_loss import STATS
from disttrain.objectives.rewards import nanstd

SAMPLES_LOGGED = 2  # completions of a step's first prompt kept for the metrics line (with their rewards)

ROLLOUT_SUMS = ("completions", "reward", "reward_sq", "length", "truncated", "groups", "groups_zero_std",
                "groups_resampled", "logged_metrics", "tool_calls", "tool_failures", "turns", "tool_tokens")


class RolloutWindow:
    """What the rollouts and the policy loss add up between two log lines; one all-reduce of the sums and one of
    the maxima (lengths, times) when a line is written."""

    def __init__(self, names: list[str], clips_per: str = "tokens", agentic: bool = False):
        self.names, self.functions, self.clips_per, self.agentic = names, len(names), clips_per, agentic
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(len(ROLLOUT_SUMS) + 3 * self.functions, dtype=torch.float64)  # host: the rollouts'
        self.policy: torch.Tensor | None = None  # the loss's STATS + entropy sum, left on the device until a line
        # the longest completion, minus the shortest, and this rank's rollout and scoring seconds (the slowest
        # rank's are reported)
        self.maxima = torch.tensor([float("-inf"), float("-inf"), 0.0, 0.0], dtype=torch.float64)
        self.steps = 0
        self.samples: list[dict] = []
        self.logged: dict[str, list[float]] = {}  # the reward functions' log_metric values

    def add_rollout(self, table: torch.Tensor, summed: torch.Tensor, completions: list[tuple], group: int,
                    played: list | None = None) -> None:
        """`played`: with tools, the completions' trajectories -- a completion's length is its policy's tokens (as
        TRL counts it), and the tools' counts are added up."""
        lengths = torch.tensor([len(ids) if played is None else sum(played[i].policy)
                                for i, (ids, _) in enumerate(completions)], dtype=torch.float64)
        if played is not None:
            tools = [sum(t.calls for t in played), sum(t.failures for t in played), sum(t.turns for t in played),
                     sum(len(t.policy) - sum(t.policy) for t in played)]
            self.sums[ROLLOUT_SUMS.index("tool_calls"):ROLLOUT_SUMS.index("tool_tokens") + 1] += torch.tensor(
                tools, dtype=torch.float64)
        grouped = summed.double().view(-1, group)  # a group's std over its scored completions, as TRL's
        zero_std = torch.isclose(nanstd(grouped, dim=1), torch.zeros((), dtype=torch.float64)).sum()
        values = [len(completions), summed.double().nansum(), (summed.double() ** 2).nansum(), lengths.sum(),
                  sum(t for _, t in completions), grouped.shape[0], zero_std, 0, 0, 0, 0, 0, 0]
        scored = ~torch.isnan(table)
        per_function = torch.cat([table.double().nan_to_num(0.0).sum(0), (table.double().nan_to_num(0.0) ** 2).sum(0),
                                  scored.sum(0).double()])
        self.sums += torch.cat([torch.tensor(values, dtype=torch.float64), per_function])
        self.maxima[:2] = torch.maximum(self.maxima[:2], torch.stack([lengths.max(), -lengths.min()]))

    def add_times(self, rollout_s: float, score_s: float, resampled: int) -> None:
        self.maxima[2:] += torch.tensor([rollout_s, score_s], dtype=torch.float64)
        self.sums[ROLLOUT_SUMS.index("groups_resampled")] += resampled
        self.steps += 1

    def log_metric(self, name: str, value: float) -> None:
        """TRL's log_metric for reward functions: averaged over the calls of every rank until the next line."""
        self.logged.setdefault(str(name), []).append(float(value))
        self.sums[ROLLOUT_SUMS.index("logged_metrics")] += 1  # in the line's all-reduce: gather only if any

    def add_policy(self, stats: torch.Tensor, entropy_sum: torch.Tensor) -> None:
        """Every micro-batch: summed on its device (a copy to the host would wait for the step's kernels)."""
        values = torch.cat([stats.detach(), entropy_sum.detach().double().reshape(1)])
        self.policy = values if self.policy is None else self.policy + values

    def keep_samples(self, tokenizer, prompts: dict, completions: list[list[tuple]], summed: torch.Tensor,
                     extra: dict[str, list]) -> None:
        """The first prompt's first completions, their rewards and the reward functions' log_extra values."""
        prompt = tokenizer.decode(prompts["prompt_ids"][0])
        self.samples = [{"prompt": prompt, "completion": tokenizer.decode(ids), "reward": float(summed[i]),
                         **{column: values[i] for column, values in extra.items() if i < len(values)}}
                        for i, (ids, _) in enumerate(completions[0][:SAMPLES_LOGGED])]

    def metrics(self, accelerator) -> dict:
        """Means over every rank's completions (and tokens) since the last log line."""
        device = accelerator.device
        policy = self.policy if self.policy is not None else torch.zeros(len(STATS) + 1, dtype=torch.float64)
        sums = accelerator.reduce(torch.cat([self.sums.to(device), policy.to(device)]), reduction="sum").cpu()
        maxima = accelerator.reduce(self.maxima.to(device), reduction="max").cpu() if accelerator.num_processes > 1 \
            else self.maxima
        f = self.functions
        base = len(ROLLOUT_SUMS)
        policy = sums[base + 3 * f:]
        tokens = max(float(policy[0]), 1.0)
        clipped_of = tokens if self.clips_per == "tokens" else max(float(policy[1]), 1.0)
        record = {"entropy": float(policy[-1]) / tokens, "kl": float(policy[2]) / tokens,
                  "clip_ratio/low_mean": float(policy[3]) / clipped_of,
                  "clip_ratio/high_mean": float(policy[4]) / clipped_of,
                  "clip_ratio/region_mean": float(policy[5]) / clipped_of}
        if float(sums[0]) > 0:  # completions sampled in this window (rl.num_iterations > 1: not at every step)
            record.update(self._rollout_metrics(sums, maxima))
        if float(sums[ROLLOUT_SUMS.index("logged_metrics")]) > 0:  # some function called log_metric on some rank
            record.update(self._logged_metrics(accelerator))
        if accelerator.is_main_process and self.samples:
            record["completions"] = self.samples
        self.reset()
        return record

    def _logged_metrics(self, accelerator) -> dict:
        """The reward functions' log_metric values, averaged over every rank's calls (an object gather: the names
        may differ between ranks)."""
        local = [self.logged]
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            local = gather_object(local)
        values: dict[str, list[float]] = {}
        for logged in local:
            for name, v in logged.items():
                values.setdefault(name, []).extend(v)
        return {name: sum(v) / len(v) for name, v in sorted(values.items())}

    def _rollout_metrics(self, sums: torch.Tensor, maxima: torch.Tensor) -> dict:
        f, base = self.functions, len(ROLLOUT_SUMS)
        n = float(sums[0])
        mean = float(sums[1]) / n
        record = {"reward": mean, "reward_std": max(float(sums[2]) / n - mean * mean, 0.0) ** 0.5,
                  "completions/mean_length": float(sums[3]) / n, "completions/max_length": float(maxima[0]),
                  "completions/min_length": -float(maxima[1]), "completions/clipped_ratio": float(sums[4]) / n,
                  "frac_reward_zero_std": float(sums[6]) / max(float(sums[5]), 1.0),
                  "dynamic_sampling/resampled_groups": float(sums[7]) / max(float(sums[5]), 1.0),
                  "rollout_s": float(maxima[2]) / max(self.steps, 1), "reward_s": float(maxima[3]) / max(self.steps, 1)}
        for j in range(f):  # each function over the completions it scored
            count = max(float(sums[base + 2 * f + j]), 1.0)
            mean_j = float(sums[base + j]) / count
            record[f"rewards/{self.names[j]}/mean"] = mean_j
            variance = float(sums[base + f + j]) / count - mean_j * mean_j
            record[f"rewards/{self.names[j]}/std"] = max(variance, 0.0) ** 0.5
        if self.agentic:  # TRL's tools/call_frequency (calls per completion) and failure_frequency (per call)
            calls = float(sums[ROLLOUT_SUMS.index("tool_calls")])
            record.update({"tools/call_frequency": calls / n,
                           "tools/failure_frequency": float(sums[ROLLOUT_SUMS.index("tool_failures")]) / max(calls, 1),
                           "tools/turns": float(sums[ROLLOUT_SUMS.index("turns")]) / n,
                           "tools/tool_tokens": float(sums[ROLLOUT_SUMS.index("tool_tokens")]) / n})
        if self.steps:  # completion tokens of all ranks over the slowest rank's sampling time
            record["rollout_tokens_per_s"] = float(sums[3]) / max(float(maxima[2]), 1e-9)
        return record
