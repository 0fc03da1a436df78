"""The benchmarks' one entry point: `python -m bench <subcommand> [arguments]`; `python -m bench` lists them.

Each subcommand is one module's `main(argv)`; `make bench-smoke` (`python -m bench smoke`) runs every one of them
in a tiny configuration on the fake engine, so a product change that breaks a benchmark fails CI.
"""

from __future__ import annotations

import importlib
import os
import sys

from bench.common import ROOT

# subcommand -> (module, what it measures). throughput.py's subcommands share its parser (the first argument).
COMMANDS = {
    "compare": ("throughput", "batchjson against bare vLLM on the same rows and engine settings"),
    "sweep": ("throughput", "speculation methods x in-flight sizes on one engine each"),
    "scale": ("throughput", "the sweep on a random-weight model of a real shape (default Llama-2-7B)"),
    "gpu": ("throughput", "the whole GPU plan: compare, sweep, scale, within a budget"),
    "overhead": ("throughput", "batchjson's CPU cost per row outside the engine (fake engine)"),
    "report": ("throughput", "print the tables of saved throughput result files"),
    "_worker": ("throughput", None),  # one engine scenario, in its own process (scenarios.py)
    "auto-runs": ("auto_runs", 'speculative method "auto" in its own runs, per task and in-flight size'),
    "cpu-sample": ("cpu_sample", "the sample job against bare vLLM, each as a user runs it (CPU)"),
    "guard-cost": ("guard_cost", "the loop guard's cost per output token: vLLM's check against batchjson's"),
    "repetition-scan": ("repetition_scan", "which loop guards would have stopped a finished run's loops"),
    "sample-guard": ("sample_guard", "the sample job under each loop guard, against ground truth"),
    "replicas": ("replicas", "one job on 1 or N engine replicas, or N static shards, on one host"),
    "schemas": ("schemas", "the SchemaStore corpus through the spec loader, grammar backends and Validator"),
    "extract-schemastore": ("extract_schemastore", "build bench/corpus/schemastore.jsonl.gz from SchemaStore"),
    "grammar": ("grammar", "what the JSON constraint costs a step: no grammar, vLLM's mask fills, batchjson's"),
    "ahead": ("ahead", "the grammars' work beside the forward's launch, on vLLM 0.26's own scheduler, no GPU"),
    "drafts": ("drafts", "the schema drafter's proposals on ground-truth answers, offline: tokens per step, acceptance"),
    "schema-drafter": ("schema_drafter", "the schema drafter as vLLM 0.34's registered method: speed, acceptance, "
                                         "outputs equal to none's (--fake: no engine)"),
    "spec-profile": ("spec_profile", "where a speculative step's time goes, per in-flight size (vLLM plugin)"),
    "validators": ("validators", "validation's cost per row: Validator.check against other validators"),
    "openai-batch": ("openai_batch", "import-openai and export-openai: peak memory and time per requests file size"),
    "serve": ("serve", "one requests file through `batchjson serve` against import-openai, run and export-openai"),
    "scale-out": ("scale_out", "one job on a local Ray cluster of N CPU workers: the driver's peak memory by rows"),
    "whole-runs": ("whole_runs", "whole runs of a new user's minimal job next to bare vLLM, one call"),
    "start-trace": ("start_trace", "where a run's time goes before its engine decodes (sampled stacks)"),
    "smoke": ("smoke", "every subcommand above, tiny, on the fake engine (make bench-smoke)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {what}" for name, (_, what) in COMMANDS.items() if what]
    return "usage: python -m bench SUBCOMMAND [arguments]   (SUBCOMMAND --help for its own)\n\n" + "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    # The processes a benchmark starts (workers, `batchjson run`) import bench and batchjson from this tree too.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *paths]))
    module = importlib.import_module(f"bench.{COMMANDS[name][0]}")
    if COMMANDS[name][0] == "throughput":
        return module.main([name, *rest])
    if name == "whole-runs":  # its parser reads sys.argv
        sys.argv = ["python -m bench whole-runs", *rest]
        return module.main()
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
