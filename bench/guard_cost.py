"""The loop guard's cost per output token in vLLM's engine core: vLLM's check_sequence_repetition against
batchjson's replacement (engine/vllm/scheduler.py, `repeats`), on the token lists the scheduler passes (ConstantList).

    python -m bench guard-cost [--guard 64,8,3]

JSON-like sequences of 1 to 300 tokens (60% distinct ids, 40% a few punctuation ids), each length once, as the
check sees a row grow token by token; prints microseconds per call for each.
"""

from __future__ import annotations

import argparse
import random
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench guard-cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--guard", default="64,8,3", help="max_pattern_size,min_pattern_size,min_count")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched import utils
    from vllm.v1.utils import ConstantList

    from batchjson.engine.vllm import scheduler

    vllms = utils.check_sequence_repetition
    params = RepetitionDetectionParams(*map(int, args.guard.split(",")))
    rng = random.Random(0)
    tokens = [rng.randrange(2000) if rng.random() < 0.6 else rng.choice((1, 2, 3, 4)) for _ in range(300)]
    seqs = [ConstantList(tokens[:n]) for n in range(1, 301)]
    for name, check in (("vLLM check_sequence_repetition", vllms), ("batchjson repeats", scheduler.repeats)):
        t = time.perf_counter()
        for _ in range(args.repeat):
            for s in seqs:
                check(s, params)
        print(f"{name}: {(time.perf_counter() - t) / (args.repeat * len(seqs)) * 1e6:.2f} us per output token")
    return 0
