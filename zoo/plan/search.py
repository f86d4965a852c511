"""Every layout of a job that zoo can run, priced by ``zoo.plan.estimate`` and ranked by predicted throughput.

The axes and zoo's rules for them (the same as ``zoo.training.config.validate``): tp divides the query and
key-value heads and the MLP width (and is at most the GPUs of a node unless ``allow_cross_node_tp``); pp divides
the GPUs left and is at most the number of blocks; dp = GPUs / (tp pp); ep (mixture-of-experts models) divides
dp (or, with EP groups spanning TP, is tp x a divisor of dp) and the experts; ZeRO 0-3 at pp 1, ZeRO 0-1 with a
pipeline (DeepSpeed's rule); sequence parallelism needs tp > 1 and a sequence divisible by tp; the micro batch times dp
divides the global batch; recomputation none or full ("selective" only where the attention kernel stores the s x s
scores, which zoo's SDPA does not).
"""

from __future__ import annotations

from dataclasses import fields

from zoo.plan.estimate import ATTENTION, DTYPE_BYTES, OPTIMIZER_STATE_BYTES, RECOMPUTE, Estimate, Job, Layout, estimate
from zoo.plan.hardware import GPU


class PlanError(ValueError):
    """Bad planner input, or a job no layout can run; the message is one line naming the problem and the fix."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_job(job: Job) -> None:
    c = job.config
    if job.gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {job.gpus}")
    if job.dtype not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {job.dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    if job.optimizer not in OPTIMIZER_STATE_BYTES:
        raise PlanError(f"unknown optimizer {job.optimizer!r}; use one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    if job.attention not in ATTENTION:
        raise PlanError(f"unknown attention kernel {job.attention!r}; use one of {', '.join(ATTENTION)}")
    if job.seq_length < 1 or job.global_batch < 1:
        raise PlanError(f"--seq-length and --global-batch must be >= 1, got {job.seq_length} and {job.global_batch}")
    if job.seq_length > c.max_position_embeddings:
        raise PlanError(f"--seq-length {job.seq_length} exceeds the model's max_position_embeddings "
                        f"{c.max_position_embeddings}; lower it or --set max_position_embeddings={job.seq_length}")


def _tp_ok(c, tp: int) -> bool:
    nkv = c.num_key_value_heads  # tp divides the kv heads, or replicates each over tp / nkv ranks
    kv = nkv % tp == 0 or (tp % nkv == 0 and getattr(c, "qk_norm", None) != "full")
    heads = c.num_attention_heads % tp == 0 and kv
    return heads and (not c.has_dense_mlp() or c.intermediate_size % tp == 0)


def candidates(job: Job, gpu: GPU, fixed: dict | None = None, allow_cross_node_tp: bool = False):
    """Every layout zoo's rules allow for ``job``, restricted to the ``fixed`` field values (``--only``)."""
    fixed = fixed or {}
    c = job.config
    moe = getattr(c, "num_experts", 0) > 0
    for tp in divisors(job.gpus):
        if not _tp_ok(c, tp) or (tp > gpu.gpus_per_node and not allow_cross_node_tp and "tp" not in fixed):
            continue
        for pp in divisors(job.gpus // tp):
            if pp > c.num_hidden_layers:
                continue
            for cp in divisors(job.gpus // (tp * pp)):
                if cp > 1 and not _cp_ok(c, job, tp, cp):
                    continue
                dp = job.gpus // (tp * pp * cp)
                # ep inside dp, and (tp > 1) EP groups spanning TP: ep = tp x a divisor of dp
                eps = [(ep, False) for ep in divisors(dp)] if moe else [(1, False)]
                eps += [(tp * d, True) for d in divisors(dp)] if moe and tp > 1 else []
                for ep, spans in eps:
                    if moe and c.num_experts % ep:
                        continue
                    for mb in divisors(job.global_batch // dp) if job.global_batch % dp == 0 else []:
                        yield from _variants(job, fixed, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, micro_batch=mb,
                                             ep_spans_tp=spans)


def _cp_ok(c, job: Job, tp: int, cp: int) -> bool:
    """Ulysses (zoo's default): cp divides each TP rank's query heads and the sequence."""
    return (c.num_attention_heads // tp) % cp == 0 and job.seq_length % cp == 0


def _variants(job: Job, fixed: dict, **axes):
    tp, pp, s_local = axes["tp"], axes["pp"], job.seq_length // axes["cp"]
    # ZeRO-2/3 do not work with a pipeline; ZeRO-3 not with expert parallelism (DeepSpeed refuses both).
    for zero in ((0, 1) if pp > 1 else (0, 1, 2) if axes["ep"] > 1 else (0, 1, 2, 3)):
        for sp in ((False, True) if tp > 1 and s_local % tp == 0 else (False,)):
            for rc in RECOMPUTE:
                if rc == "selective" and job.attention != "unfused":
                    continue
                lay = Layout(**axes, zero=zero, sp=sp, recompute=rc, fused_ce=job.fused_cross_entropy)
                if all(getattr(lay, k) == v for k, v in fixed.items()):
                    yield lay


def plan(job: Job, gpu: GPU, fixed: dict | None = None, allow_cross_node_tp: bool = False) -> list[Estimate]:
    """All candidate layouts priced, the ones that fit first, by predicted tokens/s (then by less memory)."""
    check_job(job)
    cache: dict = {}
    rows = [estimate(job, lay, gpu, cache) for lay in candidates(job, gpu, fixed, allow_cross_node_tp)]
    if not rows:
        raise PlanError(_no_layout(job, gpu, fixed))
    rows.sort(key=lambda e: (not e.fits, -e.tokens_per_s, e.memory_per_gpu_gb))
    return rows


def _no_layout(job: Job, gpu: GPU, fixed: dict | None) -> str:
    """Why no layout exists at all (before memory): the batch, the heads, or the --only values."""
    if fixed:
        try:
            free = plan(job, gpu)
        except PlanError:
            free = []
        if free:
            given = ",".join(f"{k}={v}" for k, v in fixed.items())
            return (f"--only {given}: zoo cannot run this layout for {job.gpus} GPUs (tp divides the heads, "
                    f"tp x pp divides the GPUs, pp <= {job.config.num_hidden_layers} blocks, ZeRO <= 1 with pp > 1, "
                    f"sp needs tp > 1, micro_batch x dp divides the global batch {job.global_batch}); "
                    f"drop or change a field")
    dps = {job.gpus // (tp * pp) for tp in divisors(job.gpus) for pp in divisors(job.gpus // tp)
           if _tp_ok(job.config, tp) and pp <= job.config.num_hidden_layers}
    if dps and all(job.global_batch % dp for dp in dps):
        return (f"global batch {job.global_batch} is not divisible by the data-parallel size of any layout of "
                f"{job.gpus} GPUs (dp can be {', '.join(map(str, sorted(dps)))}; micro_batch x dp must divide "
                f"the batch); use a global batch that is a multiple of {min(dps)}, e.g. "
                f"{-(-job.global_batch // min(dps)) * min(dps)}")
    return (f"no tensor-parallel size divides num_attention_heads {job.config.num_attention_heads}, the MLP width "
            f"and the {job.gpus} GPUs while dividing or being a multiple of num_key_value_heads "
            f"{job.config.num_key_value_heads}; "
            f"use a GPU count with a common divisor")


def best(rows: list[Estimate], job: Job, gpu: GPU) -> Estimate:
    """The fastest layout that fits; if none fits, one line saying what is short and by how much."""
    if rows[0].fits:
        return rows[0]
    smallest = min(rows, key=lambda e: e.memory_per_gpu_gb)
    raise PlanError(f"no layout of {job.gpus} x {gpu.name} fits the model ({rows[0].params / 1e9:.2f}B parameters): "
                    f"the smallest, {smallest.layout.describe()}, {smallest.why_not}; use more GPUs, GPUs with more "
                    f"memory, a shorter sequence or a smaller global batch")


ONLY_FIELDS = {f.name: f.type for f in fields(Layout)}


def parse_only(text: str) -> dict:
    """``tp=8,pp=35,micro_batch=1,recompute=full,sp=true,zero=1`` -> field values (checked, one line each)."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key == "micro_batch_size":
            key = "micro_batch"
        if not sep or key not in ONLY_FIELDS:
            raise PlanError(f"--only: {item!r} is not FIELD=VALUE with FIELD one of {', '.join(ONLY_FIELDS)}")
        value = value.strip().lower()
        if key == "recompute":
            value = {"true": "full", "false": "none"}.get(value, value)
            if value not in RECOMPUTE:
                raise PlanError(f"--only: recompute must be one of {', '.join(RECOMPUTE)}, got {value!r}")
        elif key in ("sp", "fused_ce", "ep_spans_tp"):
            if value not in ("true", "false", "1", "0"):
                raise PlanError(f"--only: {key} must be true or false, got {value!r}")
            value = value in ("true", "1")
        else:
            try:
                value = int(value)
            except ValueError:
                raise PlanError(f"--only: {key} must be an integer, got {value!r}") from None
        out[key] = value
    return out


def explain_selective(job: Job, fixed: dict) -> None:
    if fixed.get("recompute") == "selective" and job.attention != "unfused":
        raise PlanError("--only recompute=selective recomputes the attention core's s x s scores (Korthikanti et "
                        "al.), which zoo's SDPA attention never stores: it equals recompute=none here (use "
                        "--attention unfused to price a kernel that stores them)")

