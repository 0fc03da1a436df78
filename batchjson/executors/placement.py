"""How engine replicas are laid over the GPUs: how many GPUs each replica takes, how many replicas share each GPU
(model.replicas_per_gpu and the rule behind its "auto"), each one's share of the GPU's memory, and the layouts on this
host and on a Ray cluster. The arithmetic every executor shares; no executor decides any of it on its own. The GPUs
themselves are asked in engine/devices.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

from batchjson.engine.devices import VLLM_GPU_MEMORY_UTILIZATION, gpu_memory, host_cores, visible_gpus
from batchjson.errors import SpecError
from batchjson.spec import JobSpec, ModelSpec

GIB = 1 << 30

# replicas_per_gpu = "auto": rows of (the model's weights at most this share of one GPU's memory, at least this many
# host cores per replica, at least this many rows to decode per replica, replicas per GPU), tried in order; the first
# row that holds gives the count. A row sharing a GPU belongs here only once it was measured to pay on whole runs
# against fewer engines per GPU, for models of that size, on hosts of that many cores per replica, on jobs of that many
# rows (BENCHMARKS.md, "Replicas per GPU"). Measured on an H200 (140 GiB, 16 cores), 30,000 rows, each model in one
# sitting: SmolLM2-135M (0.25 GiB, 0.18% of it) 1, 2, 3, 4 replicas 194.6, 153.3, 118.0, 121.0 s (bare vLLM's one
# engine 251.4 s); Qwen2.5-Coder-0.5B (1.17 GiB, 0.84%) 1, 2, 3 replicas 179.3, 122.5, 112.4 s; the Qwen2.5-Coder
# 1.5B (3.3 GiB, 2.4%), every run warm, 2 replicas 128.7 s against one's 152.7 s (the decode after the first request
# x1.35 one's rows/s; its two engines' steps cost what one's did, 55.5 against 54.1 ms); the same valid rows. Three
# hold wherever two did for the small ones (8 cores and 15,000 rows for each of two); four gained nothing on three.
# Two replicas of the 1.5B pay from about 17,500 rows (the second engine's start, ~40 s, is decoded through by one),
# so their row asks 15,000 rows each, where it was measured. On an H100 (80 GiB: the 1.5B is 4.2% of it, 16 cores),
# one sitting, 30,000 rows: 2 replicas 119.6 s with their engines started side by side (a KV cache size kept from an
# earlier start, engine/kv_sizes.py), 144.3 s one after another, bare vLLM's one engine 220.0 s; so the row reaches
# 4.5%, where between 2.5% and 4.5% only that was measured. Below a row's rows (a small job ends before another
# engine's start pays), above its share (a model larger than the 1.5B: not measured), or with fewer cores: one.
REPLICAS_PER_GPU_RULE: tuple[tuple[float, int, int, int], ...] = (
    (0.01, 5, 10_000, 3),
    (0.045, 5, 15_000, 2),
    (1.0, 0, 0, 1),
)


def gpus_per_replica(engine: dict) -> int:
    return int(engine.get("tensor_parallel_size", 1)) * int(engine.get("pipeline_parallel_size", 1))


@dataclass(frozen=True)
class Placement:
    """Where one replica runs: the GPUs it sees (its CUDA_VISIBLE_DEVICES; None: as its process finds them), how many
    replicas share those GPUs (itself included), and the [model.engine] keys its engine gets on top of the spec's
    (its share of the GPUs' memory)."""

    devices: str | None = None
    share: int = 1
    engine: dict = field(default_factory=dict)

    def applied(self, spec: JobSpec) -> JobSpec:
        """The spec this replica's engines start with. Only a replica's own copy changes: the run's hash is the
        driver's, and where decoding runs does not change what a run writes."""
        if not self.engine:
            return spec
        model = dataclasses.replace(spec.model, engine={**spec.model.engine, **self.engine})
        return dataclasses.replace(spec, model=model)


@dataclass(frozen=True)
class Layout:
    """Every replica's placement, the replicas per GPU (group) they were laid out at (0: no GPU), and why: the
    report's one line."""

    placements: tuple[Placement, ...]
    per_gpu: int = 0
    why: str = ""

    def summary(self) -> str:
        if not self.per_gpu:
            return ""
        gpus = {g for p in self.placements if p.devices is not None for g in p.devices.split(",")}
        on = f" on {len(gpus)} GPU(s)" if gpus else ""
        memory = self.placements[0].engine.get("gpu_memory_utilization")
        each = f"; each engine gpu_memory_utilization {memory}" if memory else ""
        return f"{len(self.placements)} replica(s){on}, {self.per_gpu} per GPU ({self.why}){each}"


def memory_share(engine: dict, share: int) -> dict:
    """The [model.engine] keys of one of `share` engines on the same GPUs: vLLM's default gpu_memory_utilization
    divided among them. A gpu_memory_utilization set in [model.engine] is vLLM's own, per engine, and kept as it is,
    as long as the engines of a GPU ask for no more than all of it."""
    given = engine.get("gpu_memory_utilization")
    if given is not None:
        if share > 1 and given * share > 1:
            raise SpecError(f"model.engine.gpu_memory_utilization = {given} with {share} replicas on each GPU "
                            f"(model.replicas_per_gpu): together they would ask for {given * share:.0%} of its memory. "
                            f"Set it to at most {math.floor(100 / share) / 100}, or leave it out (each replica then "
                            f"gets {VLLM_GPU_MEMORY_UTILIZATION}/{share}).")
        return {}
    if share == 1:
        return {}
    return {"gpu_memory_utilization": math.floor(VLLM_GPU_MEMORY_UTILIZATION / share * 1000) / 1000}


def auto_per_gpu(weights: int | None, memory: int | None, cores: int, groups: int,
                 rows: int | None = None) -> tuple[int, str]:
    """replicas_per_gpu = "auto": the first row of REPLICAS_PER_GPU_RULE that the model's weights (bytes on each
    GPU), the GPU's memory, the host's cores per replica and the rows to decode per replica (None: unknown, as many
    as it takes) allow; and why, in words."""
    if not weights or not memory:
        return 1, "auto: the model's weights or the GPU's memory are unknown"
    share = weights / memory
    size = f"weights {weights / GIB:.2f} GiB, {share:.1%} of a {memory / GIB:.0f} GiB GPU"
    for most, cores_each, rows_each, n in REPLICAS_PER_GPU_RULE:
        replicas = max(1, groups * n)
        if share <= most and cores // replicas >= cores_each and (rows is None or rows // replicas >= rows_each):
            if n == 1:
                job = f", {rows:,} rows" if rows is not None else ""
                return 1, f"auto: {size}, {cores} cores{job}: no measured rule shares a GPU for that"
            return n, f"auto: {size}, {cores // replicas} cores per replica: measured to pay"
    return 1, "auto: no rule applies"


def choose_per_gpu(model: ModelSpec, groups: int, per: int, cores: int, memory: int | None,
                   rows: int | None = None) -> tuple[int, str]:
    """Replicas per GPU (group of `per` GPUs) for `model` on `groups` groups, for a job of `rows` rows, and why."""
    if model.replicas_per_gpu != "auto":
        return int(model.replicas_per_gpu), f"model.replicas_per_gpu = {model.replicas_per_gpu}"
    from batchjson.engine.models import resolve_model, weight_bytes

    weights = weight_bytes(resolve_model(model.path))
    n, why = auto_per_gpu(weights // per if weights else None, memory, cores, groups, rows)
    given = model.engine.get("gpu_memory_utilization")  # the user's share for each engine: auto fits within it
    fit = max(1, math.floor(1 / given + 1e-9)) if given else n
    if n > fit:
        return fit, f"{why}; {fit} with model.engine.gpu_memory_utilization = {given}"
    return n, why


def replica_count(gpus: int, per: int, per_gpu: int, requested: int | None, where: str, hint: str) -> int:
    """How many replicas of `per` GPUs to run on `gpus` GPUs at `per_gpu` replicas per GPU (group): as many as fit,
    or as many as asked for if they fit."""
    fit = gpus // per * per_gpu
    n = requested or fit
    if fit == 0 or n > fit:
        raise SpecError(f"{where} has {gpus} GPU(s): room for {fit} replica(s) of {per} GPU(s) at {per_gpu} per GPU "
                        f"(model.replicas_per_gpu), not {n}. {hint}")
    return n


def lay_out(gpus: list[str], engine: dict, per_gpu: int, requested: int | None, where: str, hint: str,
            why: str = "") -> Layout:
    """The replicas over `gpus`, in groups of gpus_per_replica, `per_gpu` at most on each group. Replica i goes to
    group i % groups: fewer replicas than room spread over every GPU before any GPU takes two, and each engine's
    share of memory is that of the replicas actually on its GPUs."""
    per = gpus_per_replica(engine)
    groups = [",".join(gpus[i * per:(i + 1) * per]) for i in range(len(gpus) // per)]
    n = replica_count(len(gpus), per, per_gpu, requested, where, hint)
    on = Counter(i % len(groups) for i in range(n))
    placements = tuple(Placement(groups[g], on[g], memory_share(engine, on[g]))
                       for g in (i % len(groups) for i in range(n)))
    return Layout(placements, max(on.values()), why)


def refuse_without_gpus(model: ModelSpec, where: str) -> None:
    """replicas_per_gpu above 1 where there is no GPU to share: a mistake, not a request for CPU replicas (those are
    model.replicas)."""
    if model.replicas_per_gpu not in ("auto", 1):
        raise SpecError(f"model.replicas_per_gpu = {model.replicas_per_gpu}: {where} has no GPU to share. Engine "
                        "replicas on a CPU are model.replicas (--replicas); leave replicas_per_gpu out or set it to "
                        '"auto" to run the same spec on GPU and CPU hosts.')


def local_layout(requested: int | None, model: ModelSpec, rows: int | None = None) -> Layout:
    """Each local replica's placement: every GPU of the host in groups of gpus_per_replica, replicas_per_gpu on each
    group (auto: by the model's size, the cores and the job's `rows` to decode), or as many as asked for. Without
    GPUs (a CPU build) one replica, or as many CPU replicas as asked for."""
    gpus = visible_gpus()
    if not gpus:
        refuse_without_gpus(model, "this host")
        return Layout((Placement(),) * (requested or 1))
    per = gpus_per_replica(model.engine)
    n, why = choose_per_gpu(model, len(gpus) // per, per, host_cores(), gpu_memory(), rows)
    return lay_out(gpus, model.engine, n, requested, "this host", "Ask for fewer (--replicas, model.replicas), let "
                   "more share each GPU (model.replicas_per_gpu), or run on a Ray cluster (--ray).", why)


def ray_layout(gpus: int, model: ModelSpec, requested: int | None) -> tuple[Layout, float]:
    """The replicas on a cluster of `gpus` GPUs, and the GPUs each actor asks Ray for. Ray places the actors, so a
    GPU's replicas are known only by count: each gets 1/replicas_per_gpu of a GPU (Ray takes fractions below 1 only,
    to 4 decimals, and packs that many actors on each GPU) and the memory share of that many. "auto" is one per GPU
    here: the cluster's GPU memory is not known from the driver."""
    if not gpus:
        refuse_without_gpus(model, "the Ray cluster")
        return Layout((Placement(),) * (requested or 1)), 0
    per = gpus_per_replica(model.engine)
    k = 1 if model.replicas_per_gpu == "auto" else int(model.replicas_per_gpu)
    if k > 1 and per > 1:
        raise SpecError(f"model.replicas_per_gpu = {k} with {per} GPUs per replica (tensor_parallel_size x "
                        "pipeline_parallel_size): Ray gives an actor either whole GPUs or a fraction of one. Run such "
                        "replicas on one host (without --ray), or one per GPU group.")
    why = f"model.replicas_per_gpu = {k}" if model.replicas_per_gpu != "auto" else "auto: one per GPU on a Ray cluster"
    n = replica_count(gpus, per, k, requested, "the Ray cluster", "Ask for fewer replicas, or let more share each "
                      "GPU (model.replicas_per_gpu).")
    layout = Layout((Placement(None, k, memory_share(model.engine, k)),) * n, k, why)
    return layout, per if k == 1 else math.floor(10_000 / k) / 10_000
