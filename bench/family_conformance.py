"""Each registered model family against transformers: loading, logits at 1-4 stages, KV cache.

The table issue #34 asks for, measured on the tiny models of the conformance tests (each family
test module's CASES, tests/unit/model/families/cases.py; the measurements are those tests'
functions, conformance.py): a random model built by transformers' own config class for the
family, 4 layers, hidden 32, every norm weight and bias random, weights drawn with std 0.2, and
the family's features turned on (biases, sliding windows, q/k norms, multipliers, RoPE scaling).
Per case, in fp32 on the CPU, the max relative difference (largest absolute difference over the
largest reference value) of:
  - stages 1-4: our logits of the model cut into 1, 2, 3, 4 stages vs transformers' forward, on a
    left-padded batch of rows of 14, 9 and 3 tokens (real positions only);
  - KV cache: two stages prefilling 5 columns, then decoding one at a time, vs transformers;
  - sessions: two sessions of different lengths decoding 3 tokens together through the peers'
    batched path, vs transformers' logits of the whole sequences (the larger of that and the
    difference from each session decoding alone);
  - LoRA: adapters (rank 2, random B) on all seven projections of every layer, merged into the
    weights vs applied as adapters;
  - export: stages whose every weight moved, exported as a Hugging Face folder and loaded by
    transformers (no missing or unexpected tensor, else the row says so), vs our logits.
"loads" is whether decentrl read the folder at all (an error names what it refused). The
conformance tests assert every difference <= 1e-5; this prints them.

Run: python -m bench.family_conformance [--families llama,qwen3] [--threads 1] [--json PATH]
CPU, fp32; a few seconds per family."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import common
from decentrl.model.families import FAMILIES
from tests.unit.model.families.cases import all_cases
from tests.unit.model.families.conformance import (
    FamilyCase,
    batched_sessions_differences,
    build_family,
    export_difference,
    kv_cache_difference,
    lora_logits,
    relative_difference,
    stages_difference,
)

STAGES = (1, 2, 3, 4)
COLUMNS = ["case", "family", "loads", *(f"{n} stage{'s' if n > 1 else ''}" for n in STAGES),
           "KV cache", "sessions", "LoRA", "export"]
MEASURED = [*(f"stages{n}" for n in STAGES), "kv", "sessions", "lora", "export"]


def shown(value: Any) -> str:
    """A difference in two significant digits (exactly equal: 0), or what was measured instead."""
    if isinstance(value, float):
        return f"{value:.1e}" if value else "0"
    return str(value)


def measure(case: FamilyCase, folder: Path) -> dict[str, Any]:
    """Every difference of the table for `case`, its tiny model written under `folder`."""
    started = time.perf_counter()
    try:
        family = build_family(case, folder / "model")
    except Exception as error:  # noqa: BLE001 - the row says what was refused
        return {"loads": f"no: {error}", "s": time.perf_counter() - started}
    row: dict[str, Any] = {"loads": "yes"}
    for num_stages in STAGES:
        row[f"stages{num_stages}"] = stages_difference(family, num_stages)
    row["kv"] = kv_cache_difference(family)
    row["sessions"] = max(batched_sessions_differences(family))
    lora = lora_logits(family)
    row["lora"] = relative_difference(lora.merged[family.valid], lora.adapted[family.valid])
    info, difference = export_difference(family, folder / "export")
    problems = {kind: names for kind, names in info.items() if names}
    row["export"] = difference if not problems else f"{difference:.3g}, {problems}"
    row["s"] = time.perf_counter() - started
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench family-conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="model_types to measure (default: every registered family)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    families = args.families.split(",")
    unknown = [name for name in families if name not in FAMILIES]
    if unknown:
        parser.error(f"not registered families: {unknown} (registered: {', '.join(FAMILIES)})")
    torch.set_num_threads(args.threads)
    common.quiet_transformers()
    cases = all_cases()
    table: list[list[Any]] = []
    rows: dict[str, dict[str, Any]] = {}
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="decentrl-families-") as scratch:
        for model_type in families:
            if model_type not in cases:
                table.append(["-", model_type, "no conformance case", *[""] * len(MEASURED)])
                continue
            for case in cases[model_type]:
                row = measure(case, Path(scratch) / str(case))
                rows[str(case)] = row
                table.append([str(case), model_type, row["loads"],
                              *(shown(row.get(key, "")) for key in MEASURED)])
    common.print_table(
        "decentrl vs transformers, fp32, tiny models of each family (max relative difference)",
        COLUMNS, table,
        caption="difference: max |ours - reference| / max |reference| over real positions; "
                "LoRA: merged vs adapters; export: transformers' logits of our export vs ours.")
    measured = {f"{name}_{key}": row[key] for name, row in rows.items() for key in MEASURED
                if isinstance(row.get(key), float)}
    figures["cases"] = len(rows)
    figures["loaded"] = sum(row["loads"] == "yes" for row in rows.values())
    figures["max_difference"] = max(measured.values(), default=float("nan"))
    figures["seconds"] = sum(row["s"] for row in rows.values())
    figures.update(measured)
    common.print_figures("family_conformance", figures)
    common.write_json(args.json, {"figures": figures, "rows": rows})


if __name__ == "__main__":
    main()
