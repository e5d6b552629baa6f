"""Do packed examples stay isolated under an attention implementation, collated exactly as train.py collates?

    python3 scripts/gpu/packing_isolation.py --model DIR --attn flash_attention_2 --device cuda --dtype bfloat16 \
        --json out.json

Packs four short examples into a micro-batch of two rows, collates it with disttrain's Collator (flattened with
example boundaries for flash-attention, rows side by side for sdpa/eager), and compares every example's logits
with its logits alone. As a control it also runs the plain side-by-side collation, which leaks across examples
under flash-attention (transformers' flash path treats position ids as packed only at batch size 1). Writes
{"isolated", "max_abs_diff", "tolerance", "control_max_abs_diff", ...}; exit 0 when isolated, 1 when not.
The CPU variant of this check, through transformers' flash code with reference kernels, is in tests/test_data.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from disttrain.data import BOOKKEEPING_KEYS, Collator, flattens_packed_rows, pack_rows  # noqa: E402

TEXTS = ["apple river stone cloud green", "quick light", "stone apple river", "cloud river green quick stone light"]
# logits of the same tokens computed by different kernels (varlen vs dense) differ by rounding only
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _logits(model, batch: dict) -> torch.Tensor:
    inputs = {k: v.to(model.device) if torch.is_tensor(v) else v for k, v in batch.items()
              if k not in BOOKKEEPING_KEYS and k != "labels"}
    return model(**inputs, use_cache=False).logits.float()


def _per_example(logits: torch.Tensor, batch: dict, examples: list[list[int]], flattened: bool) -> torch.Tensor:
    """Logits of the real tokens in example order (drops the padding of side-by-side rows)."""
    if flattened:
        return logits.reshape(-1, logits.shape[-1])
    return torch.cat([logits[i, :n] for i, n in enumerate(batch["num_tokens"].tolist())])


@torch.no_grad()
def isolation_report(model, tokenizer, implementation: str) -> dict:
    examples = [tokenizer(t)["input_ids"] for t in TEXTS]
    rows = [{k: v[0] for k, v in pack_rows(pair, pair, max_len=4096).items()} for pair in (examples[:2], examples[2:])]
    alone = torch.cat([_logits(model, {"input_ids": torch.tensor([e])})[0] for e in examples])
    flatten = flattens_packed_rows(implementation)
    batch = Collator(tokenizer.pad_token_id, flatten_packed=flatten)(rows)
    diff = (_per_example(_logits(model, batch), batch, examples, flatten) - alone).abs().max().item()
    control = Collator(tokenizer.pad_token_id)(rows)
    control_diff = (_per_example(_logits(model, control), control, examples, False) - alone).abs().max().item()
    tolerance = TOLERANCE[next(model.parameters()).dtype]
    return {"implementation": implementation, "flattened": flatten, "max_abs_diff": diff, "tolerance": tolerance,
            "isolated": diff <= tolerance, "control_max_abs_diff": control_diff,
            "control_leaks": control_diff > tolerance}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local model dir with its tokenizer")
    parser.add_argument("--attn", default="sdpa", choices=["eager", "sdpa", "flash_attention_2", "flash_attention_3"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype),
                                                 attn_implementation=args.attn).to(args.device).eval()
    report = isolation_report(model, tokenizer, args.attn)
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if report["isolated"] else 1


if __name__ == "__main__":
    sys.exit(main())
