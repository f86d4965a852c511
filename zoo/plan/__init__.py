"""Layout planner: the memory and step time of every (tp, pp, dp, cp, ep, ZeRO, micro batch, SP, recompute) layout
of a GPT model on a cluster, before anything is launched (``launch/plan.py``).

The model (``zoo.plan.estimate``; constants per GPU type in ``zoo.plan.hardware``, nowhere else):

Parameters, exactly, from the model config: per layer spec of ``zoo.models.gpt.layer_specs`` and per rank, as
zoo's layers hold them (QKV with GQA, SwiGLU's fused gate|up, biases by ``add_bias`` / ``qkv_bias``, norms and
row-parallel biases replicated over TP, four norms per block with Gemma 2's sandwich placement, the vocabulary
padded to a multiple of 128 x tp as Megatron pads it, a tied LM head stored again on the last stage as DeepSpeed's
TiedLayerSpec does, experts E/ep per rank). Stages are cut by DeepSpeed's own ``partition_method: parameters``
algorithm, so the planner's stage 0 is the run's.

Memory per GPU (the fullest stage's rank):
- parameters, gradients, optimizer state: the ZeRO rules (Rajbhandari et al., arXiv 1910.02054, Sec. 5: 2 + 2
  + 12 bytes per parameter in mixed precision with Adam, partitioned over the data-parallel ranks from stage 1,
  2, 3 on), as DeepSpeed implements them (its fp32 master copy also in fp32 runs, its fp32 gradient partition;
  ``estimate.state_bytes`` lists every case);
- activations: bytes saved for backward per layer, derived for zoo's blocks in the style of Korthikanti et al.
  (arXiv 2205.05198, Sec. 4, "34 s b h + 5 a s^2 b" for their block): norms, the QKV / fc1 inputs (gathered
  under sequence parallelism), q/k/v, RoPE, SDPA's output and logsumexp (no s x s matrix), the MLP's
  intermediates (``estimate.block_activation_bytes``); sequence parallelism divides the norm and residual
  parts by tp; full recomputation keeps each block's input plus one block while it is recomputed; under 1F1B
  stage k holds min(p - k, m) micro-batches in flight, so the first stage holds the most (Narayanan et al.,
  arXiv 2104.04473, Sec. 2.2); the last stage adds the vocab-parallel cross entropy's fp32 softmax;
- buffers: ZeRO's gradient bucket (as many elements as the stage's parameters per rank, at most 5e8: zoo's
  ``reduce_bucket_size``), gathered blocks (ZeRO-3), pipeline send/receive buffers, the
  logits and their gradient; plus a fixed reserve for the CUDA context, NCCL and fragmentation.
These are held against what zoo's own runs measure (metrics.jsonl's first step) by tests/plan.

Step time = (m + p - 1) x the slowest stage's micro-batch time (1F1B; the bubble (p - 1)/m of Narayanan et al.
Sec. 2.2.1) + data-parallel communication not hidden + the optimizer step:
- compute: the FLOPs of ``zoo.training.metrics`` (the counter the training metrics use; with full recomputation
  one more forward of every block), GEMMs at the GPU's sustained matmul efficiency, the attention core at its own
  efficiency (flash kernels skip the causal half; a sliding-window layer computes about s x W scores, not s^2 / 2:
  ``estimate.attended_keys``), and the elementwise work (norms, four per block with sandwich norms, residuals,
  activation, RoPE, the softmax of the loss) as HBM traffic at the HBM bandwidth;
- tensor parallel: per layer 2 all-reduces forward and 2 backward (with SP: all-gathers and reduce-scatters of
  the same volume), 2 more per recomputed forward, over NVLink inside a node; pipeline: activations and their
  gradients point to point per micro-batch, partitioned over TP; expert parallel: 2 all-to-alls per MoE layer
  and pass; ring algorithms move 2(n-1)/n (all-reduce) or (n-1)/n of the buffer through each GPU's link at
  ``bandwidth_efficiency`` of its nominal rate, plus a latency per collective;
- data parallel as DeepSpeed runs it (its calls counted by ``zoo.parallel.comm_count``): ZeRO-0/1 all-reduce
  the gradients once per step, ZeRO-2 every micro-batch, ZeRO-1/2 then all-gather the parameters, ZeRO-3
  reduce-scatters every micro-batch and gathers every block's parameters per pass; only ZeRO-3's is overlapped.

Throughput: tokens/s = global batch x s / step time; TFLOP/s per GPU counts FLOPs as Megatron's Eq. 3 does
(with the recomputed forward when recompute is full); MFU counts the model's FLOPs only, against the peak.

Checked (tests/plan): parameter counts of the ten rows of Table 1 of arXiv 2104.04473 and of the GPT-2, Llama
and Mistral presets; the predicted TFLOP/s of those ten runs within 15% with the A100 constants (``--attention
unfused``: the 2021 runs stored and streamed the s x s scores, which is most of why their small models ran at
44% of peak); GPT-3 175B on 1024 A100s picks tp=8 inside a node with a pipeline of >= 8 stages, as Megatron's
Sec. 5 did; memory against measured runs within 10%.

Context parallelism is priced as zoo runs it by default (Ulysses): each rank holds s/cp of every sequence, every
query attends over the whole sequence, four all-to-alls per layer and pass (q, k, v in, the output back), ZeRO
partitions over dp x cp. Not modelled: ring attention, the interleaved schedule (DeepSpeed runs plain 1F1B),
CPU offload, overlap of TP communication with compute, and imbalance of MoE routing (experts assumed evenly
loaded).
"""

from zoo.plan.estimate import Estimate, Job, Layout, estimate
from zoo.plan.hardware import GPU, GPUS, get_gpu, load_cluster
from zoo.plan.search import PlanError, best, plan

__all__ = ["Estimate", "GPU", "GPUS", "Job", "Layout", "PlanError", "best", "estimate", "get_gpu", "load_cluster",
           "plan"]
