"""U-Nets: configs and their refusals, stage partitioning, tp=2 and pp=2 against one process, DDPM pieces.

The parallel runs compare with references computed here in one process: a forward/backward at tp=2 (outputs and
every parameter's full gradient), and three training steps through DeepSpeed's engine at tp=2 and at pp=2
(PipelineModule, 1F1B, two micro-batches) against a plain AdamW loop on the same batches.
"""

import itertools

import pytest
import torch

from tests.parallel.helpers import grid_for
from zoo.data.shapes import ShapesImages, ShapesSegmentation, stack
from zoo.models.gpt import ParallelOptions
from zoo.models.specs import SpecSequential
from zoo.models.unet import (
    DDPMSchedule,
    DiffusionLoss,
    DiffusionUNetConfig,
    FlowMatchSchedule,
    SegmentationLoss,
    SegUNetConfig,
    ddpm_sample,
    dice_score,
    flatten_activations,
    flow_sample,
    iou_score,
    layer_flops,
    layer_specs,
    loss_for,
    num_parameters,
    partition_balanced,
    pipeline_parts,
    schedule_for,
    schedule_from_config,
    unflatten_activations,
    units,
)
from zoo.training.engine import destroy_engine

SEED, LR, STEPS, MICRO, ACC = 11, 2e-3, 3, 2, 2


def config(variant):
    return SegUNetConfig.from_preset("tiny") if variant == "seg" else DiffusionUNetConfig.from_preset("tiny")


def micro_batch(variant, step, micro):
    """(inputs, labels) of micro-batch ``micro`` of optimizer step ``step``: a pure function of the two."""
    first = (step * ACC + micro) * MICRO
    if variant == "seg":
        images, masks = stack(ShapesSegmentation(32, seed=1), range(first, first + MICRO))
        return images, masks
    images = stack(ShapesImages(16, seed=1), range(first, first + MICRO))
    return DDPMSchedule().training_batch(images, torch.Generator().manual_seed(1000 + first))


# ---- configs --------------------------------------------------------------------------------------------------

def test_presets_round_trip_and_sizes():
    for cls, name in [(SegUNetConfig, "tiny"), (SegUNetConfig, "base"), (DiffusionUNetConfig, "tiny"),
                      (DiffusionUNetConfig, "ddpm-32")]:
        cfg = cls.from_preset(name)
        assert cls.from_dict(cfg.to_dict()) == cfg
        assert len(layer_flops(cfg)) == len(units(cfg)) and all(f > 0 for f in layer_flops(cfg))
    # A model of the tiny presets has exactly the parameters num_parameters counts (specs built for real).
    for variant in ("seg", "diffusion"):
        cfg = config(variant)
        model = SpecSequential(layer_specs(cfg), base_seed=SEED)
        assert sum(p.numel() for p in model.parameters()) == num_parameters(cfg)


def _message(build) -> str:
    with pytest.raises(ValueError) as info:
        build()
    return str(info.value)


def test_bad_configs_are_refused_with_one_line():
    D, S = DiffusionUNetConfig.from_preset, SegUNetConfig.from_preset
    cases = [
        (lambda: D("tiny", norm_num_groups=12),
         "DiffusionUNetConfig: norm_num_groups 12 does not divide the 32 channels of down_blocks.0.resnets.0; use one "
         "of 1, 2, 4, 8, 16, 32"),
        (lambda: D("tiny", sample_size=15),
         "DiffusionUNetConfig: sample_size 15 cannot be halved 1 time(s) (depth 2); use a multiple of 2"),
        (lambda: S("tiny", block_out_channels=(16, 32, 64), image_size=34),
         "SegUNetConfig: image_size 34 cannot be halved 2 time(s) (depth 3); use a multiple of 4"),
        (lambda: D("tiny", time_embedding_type="fourier"),
         "DiffusionUNetConfig: time_embedding_type='fourier' is not supported (zoo implements the sinusoidal "
         "(positional) embedding only); use 'positional'"),
        (lambda: D("tiny", resnet_time_scale_shift="scale_shift"),
         "DiffusionUNetConfig: resnet_time_scale_shift='scale_shift' is not supported (zoo adds the time embedding "
         "to the ResNet features (default)); use 'default'"),
        (lambda: D("tiny", num_class_embeds=10),
         "DiffusionUNetConfig: num_class_embeds=10 is not supported (class conditioning is not implemented); use None"),
        (lambda: D("tiny", down_block_types=("DownBlock2D", "CrossAttnDownBlock2D")),
         "DiffusionUNetConfig: down_block_types ['CrossAttnDownBlock2D'] not supported; use DownBlock2D or "
         "AttnDownBlock2D"),
        (lambda: D("tiny", up_block_types=("UpBlock2D",)),
         "DiffusionUNetConfig: down_block_types (2), up_block_types (1) and block_out_channels (2) must have the "
         "same length"),
        (lambda: D("tiny", attention_head_dim=24),
         "DiffusionUNetConfig: attention_head_dim 24 does not divide the 64 channels of down_blocks.1.attentions.0; "
         "use one of 1, 2, 4, 8, 16, 32, 64"),
        (lambda: D("tiny", downsample_padding=2),
         "DiffusionUNetConfig: downsample_padding=2 is not supported; use 1 or 0 (pad right/bottom by one)"),
        (lambda: SegUNetConfig.from_dict({"classes": 3, "depth": 2}),
         "SegUNetConfig: unknown field(s) ['depth']; known fields: ['block_out_channels', 'classes', 'dropout', "
         "'image_size', 'in_channels', 'layers_per_block', 'norm_eps', 'norm_num_groups']"),
        (lambda: D("tiny").check_layout(3),
         "down_blocks.0.resnets.0: 32 channels are not divisible by tp 3 (its conv1, norm2 and conv2 are split over "
         "channels); use a tp in 1, 2, 4, 8, 16, 32"),
        (lambda: D("tiny", attention_head_dim=32).check_layout(4),
         "down_blocks.1.attentions.0: 2 attention head(s) (64 channels / attention_head_dim 32) cannot be split over "
         "tp 4; use a tp in 1, 2 or a smaller attention_head_dim"),
        (lambda: S("tiny").check_layout(1, 20),
         "the U-Net has 7 layers, fewer than pp 20; every pipeline stage needs one"),
        (lambda: layer_specs(config("seg"), ParallelOptions(sequence_parallel=True)),
         "sequence_parallel is not implemented for U-Nets (activations are [b, C, H, W]); set "
         "parallel.sequence_parallel=false"),
    ]
    for build, expected in cases:
        msg = _message(build)
        assert msg == expected and "\n" not in msg


# ---- one process ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["seg", "diffusion"])
def test_forward_backward_and_checkpointing(variant):
    """Shapes of the output, every parameter trained, and activation checkpointing (skips passed through
    checkpointed layers) giving the same gradients."""
    cfg = config(variant)
    inputs, labels = micro_batch(variant, 0, 0)
    grads = []
    for recompute in (False, True):
        model = SpecSequential(layer_specs(cfg), base_seed=SEED, activation_checkpointing=recompute,
                               checkpointable_layers=("UNetResBlock", "UNetAttnBlock"))
        out = model(inputs)
        expected = (MICRO, 4, 32, 32) if variant == "seg" else (MICRO, 3, 16, 16)
        assert out.shape == expected
        loss_for(cfg)(out, labels).backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
        assert all(g is not None and g.abs().sum() > 0 for g in grads[-1].values())
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-5, atol=1e-7, msg=k)


def test_partition_balanced_is_optimal():
    g = torch.Generator().manual_seed(0)
    for n, p in [(7, 3), (9, 2), (8, 4), (5, 5)]:
        costs = torch.randint(1, 50, (n,), generator=g).tolist()
        parts = partition_balanced(costs, p)
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                   for cuts in itertools.combinations(range(1, n), p - 1))
        assert max(sum(costs[a:b]) for a, b in zip(parts, parts[1:])) == best
        assert parts[0] == 0 and parts[-1] == n and all(a < b for a, b in zip(parts, parts[1:]))
    # The diffusion U-Net's costs: attention at 8x8 and the wide up blocks weigh more than conv_in and the head.
    cfg = config("diffusion")
    flops = layer_flops(cfg)
    parts = pipeline_parts(cfg, 2)
    assert parts == partition_balanced(flops, 2) and parts != [0, len(flops) // 2, len(flops)]
    with pytest.raises(ValueError, match="cannot split 16 layers into 17 pipeline stages; use pp <= 16"):
        pipeline_parts(cfg, 17)


def test_stage_boundary_packing_round_trips_values_and_gradients():
    parts = (torch.randn(2, 8, 4, 4), torch.randn(2, 16), torch.randn(2, 4, 8, 8))
    leaves = tuple(t.clone().requires_grad_() for t in parts)
    flat, shapes = flatten_activations(leaves)
    assert flat.dim() == 1 and shapes.dtype == torch.int64
    received = flat.detach().requires_grad_()  # as DeepSpeed's receiving stage holds it
    back = unflatten_activations(received, shapes)
    assert all(torch.equal(a, b) for a, b in zip(back, parts))
    sum((k + 1) * t.sum() for k, t in enumerate(back)).backward()
    flat.backward(received.grad)
    for k, leaf in enumerate(leaves):
        assert torch.equal(leaf.grad, torch.full_like(leaf, k + 1.0))


def test_losses_and_metrics():
    logits = torch.randn(2, 3, 4, 5)
    labels = torch.randint(0, 3, (2, 4, 5))
    expected = -torch.log_softmax(logits, 1).gather(1, labels[:, None]).mean()
    torch.testing.assert_close(SegmentationLoss()(logits, labels), expected)
    torch.testing.assert_close(DiffusionLoss()(logits, logits * 2), (logits ** 2).mean())
    pred = torch.tensor([[0, 1, 1, 2]])
    target = torch.tensor([[0, 1, 2, 2]])
    # class 0: 1 & 1 -> dice 1; class 1: pred 2, actual 1, inter 1 -> 2/3, IoU 1/2; class 2: pred 1, actual 2, inter 1
    torch.testing.assert_close(dice_score(pred, target, 4)[:3], torch.tensor([1.0, 2 / 3, 2 / 3], dtype=torch.float64))
    torch.testing.assert_close(iou_score(pred, target, 4)[:3], torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64))
    assert torch.isnan(dice_score(pred, target, 4)[3]), "a class absent everywhere has no score"
    onehot = torch.nn.functional.one_hot(target, 4).permute(0, 2, 1).float()  # logits [1, 4, 4] -> argmax = target
    assert torch.equal(iou_score(onehot, target, 4)[:3], torch.ones(3, dtype=torch.float64))


def test_ddpm_schedule_and_sampler_match_diffusers():
    diffusers = pytest.importorskip("diffusers")
    ours = DDPMSchedule()
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000)  # linear 1e-4..0.02, fixed_small, clip_sample
    torch.testing.assert_close(ours.alphas_cumprod, ref.alphas_cumprod, rtol=0, atol=0)
    x0 = torch.rand(3, 2, 4, 4) * 2 - 1
    (xt, t), noise = ours.training_batch(x0, torch.Generator().manual_seed(0))
    assert t.dtype == torch.int64 and xt.shape == noise.shape == x0.shape
    torch.testing.assert_close(xt, ref.add_noise(x0, noise, t))
    # Per-sample seeds: a sample's (t, noise) does not depend on how the batch is cut.
    (whole, tw), nw = ours.training_batch(x0, seeds=[10, 11, 12])
    (half, th), nh = ours.training_batch(x0[1:], seeds=[11, 12])
    assert torch.equal(whole[1:], half) and torch.equal(tw[1:], th) and torch.equal(nw[1:], nh)
    assert not torch.equal(nw[0], nw[1])

    def eps(x, t):  # a stand-in for the U-Net: any function of (x, t)
        return 0.3 * x + 1e-4 * t.float().view(-1, 1, 1, 1)

    for steps in (1000, 20):
        got = ddpm_sample(eps, (2, 3, 4, 4), seed=7, schedule=DDPMSchedule(), num_inference_steps=steps)
        g = torch.Generator().manual_seed(7)
        sched = diffusers.DDPMScheduler(num_train_timesteps=1000)
        sched.set_timesteps(steps)
        x = torch.randn((2, 3, 4, 4), generator=g)
        for step_t in sched.timesteps:
            x = sched.step(eps(x, step_t.expand(2)), step_t, x, generator=g).prev_sample
        torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-5)
    again = ddpm_sample(eps, (2, 3, 4, 4), seed=7, num_inference_steps=20)
    torch.testing.assert_close(again, got, rtol=0, atol=0)


def test_flow_matching_schedule_and_sampler_against_diffusers_and_the_math():
    diffusers = pytest.importorskip("diffusers")
    ours = FlowMatchSchedule()
    x0 = torch.rand(3, 2, 4, 4) * 2 - 1
    (xs, t), target = ours.training_batch(x0, torch.Generator().manual_seed(0))
    assert t.dtype == torch.float32 and ((t > 0) & (t < 1000)).all() and xs.shape == target.shape == x0.shape
    sigma = (t / 1000).view(-1, 1, 1, 1)
    noise = target + x0  # the target is the velocity noise - x0 of the straight path
    torch.testing.assert_close(xs, (1 - sigma) * x0 + sigma * noise)
    ref = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    ref.set_timesteps(10)
    levels = ref.timesteps[[0, 3, 7]]  # diffusers' path at the levels it knows: the same as ours
    torch.testing.assert_close(ours.add_noise(x0, noise, levels / 1000), ref.scale_noise(x0, levels, noise))
    (whole, tw), vw = ours.training_batch(x0, seeds=[10, 11, 12])
    (half, th), vh = ours.training_batch(x0[1:], seeds=[11, 12])
    assert torch.equal(whole[1:], half) and torch.equal(tw[1:], th) and torch.equal(vw[1:], vh)
    levels = torch.sigmoid(torch.randn(20000, generator=torch.Generator().manual_seed(1)))
    drawn = torch.cat([ours.training_batch(x0[:1], seeds=[s])[0][1] for s in range(400)]) / 1000
    assert abs(drawn.mean() - 0.5) < 0.05 and abs(drawn.std() - levels.std()) < 0.03, "logit-normal levels"

    def velocity(x, t):  # a stand-in for the U-Net: any function of (x, t)
        return 0.3 * x + 1e-4 * t.view(-1, 1, 1, 1)

    for steps in (50, 7, 1):
        got = flow_sample(velocity, (2, 3, 4, 4), seed=7, num_inference_steps=steps)
        sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
        sched.set_timesteps(steps)
        torch.testing.assert_close(ours.sigmas(steps), sched.sigmas, rtol=1e-6, atol=1e-7)
        x = torch.randn((2, 3, 4, 4), generator=torch.Generator().manual_seed(7))
        for step_t in sched.timesteps:
            x = sched.step(velocity(x, step_t.expand(2)), step_t, x).prev_sample
        torch.testing.assert_close(got, x.clamp(-1, 1), rtol=1e-5, atol=1e-5)
    # The exact velocity of data that is one image c carries any noise to c, in any number of Euler steps (the
    # paths are straight): v(x, s) = (x - c) / s.
    c = torch.rand(1, 3, 4, 4) * 1.6 - 0.8
    exact = lambda x, t: (x - c) / (t / 1000).view(-1, 1, 1, 1)  # noqa: E731
    for steps in (1, 3, 50):
        torch.testing.assert_close(flow_sample(exact, (2, 3, 4, 4), seed=3, num_inference_steps=steps),
                                   c.expand(2, -1, -1, -1), rtol=0, atol=1e-5)


def test_scheduler_configs_name_the_sampler_or_are_refused():
    assert isinstance(schedule_from_config(None), DDPMSchedule)
    for schedule in (DDPMSchedule(), FlowMatchSchedule()):
        again = schedule_from_config(schedule.to_diffusers())
        assert type(again) is type(schedule) and again.to_diffusers() == schedule.to_diffusers()
    assert isinstance(schedule_for("flow"), FlowMatchSchedule) and isinstance(schedule_for(None), DDPMSchedule)
    for bad, words in (({"_class_name": "DDIMScheduler"}, "zoo samples DDPMScheduler and"),
                       ({"_class_name": "DDPMScheduler", "prediction_type": "v_prediction"}, "prediction_type"),
                       ({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}, "shift")):
        with pytest.raises(ValueError, match=words):
            schedule_from_config(bad)


# ---- tensor parallel: forward and backward against one process ------------------------------------------------

def _reference(variant):
    cfg = config(variant)
    model = SpecSequential(layer_specs(cfg), base_seed=SEED)
    inputs, labels = micro_batch(variant, 0, 0)
    out = model(inputs)
    loss_for(cfg)(out, labels).backward()
    return dict(weights={k: v.detach() for k, v in model.state_dict().items()}, out=out.detach(),
                grads={k: p.grad for k, p in model.named_parameters()})


def tp_case(variant, ref):
    from zoo.parallel.shards import full_tensor

    grid = grid_for(2)
    cfg = config(variant)
    model = SpecSequential(layer_specs(cfg), base_seed=SEED)
    inputs, labels = micro_batch(variant, 0, 0)
    out = model(inputs)
    loss_for(cfg)(out, labels).backward()
    torch.testing.assert_close(out, ref["out"], rtol=1e-5, atol=1e-5)
    sharded = 0
    for name, p in model.named_parameters():
        weight, grad = p.detach(), p.grad
        if getattr(p, "tensor_model_parallel", False):
            sharded += 1
            weight = full_tensor(weight, p.partition_dim, p.partition_stride, grid.tp_group)
            grad = full_tensor(grad, p.partition_dim, p.partition_stride, grid.tp_group)
        assert torch.equal(weight, ref["weights"][name]), f"{name}: tp=2 initialization is not the tp=1 one sliced"
        torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
    assert sharded > 0
    return True


@pytest.mark.parametrize("variant", ["seg", "diffusion"])
def test_tp2_matches_one_process(dist_run, variant):
    assert all(dist_run(2, tp_case, variant, _reference(variant)))


# ---- training through DeepSpeed: tp=2 and pp=2 against a plain loop ---------------------------------------------

def reference_losses(variant):
    cfg = config(variant)
    model = SpecSequential(layer_specs(cfg), base_seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACC):
            inputs, labels = micro_batch(variant, step, micro)
            loss = loss_for(cfg)(model(inputs), labels) / ACC
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def train_case(variant, tp, pp, recompute=False, pipe_partitioned=False, partition_method="compute"):
    import deepspeed

    from zoo.models.unet import CHECKPOINTABLE_LAYERS, build_unet_pipeline
    from zoo.parallel.random import configure_activation_checkpointing

    grid = grid_for(tp, pp)
    configure_activation_checkpointing(grid)
    cfg = config(variant)
    specs = layer_specs(cfg)
    if pp > 1:
        module = build_unet_pipeline(cfg, specs, grid, loss_fn=loss_for(cfg), base_seed=SEED,
                                     partition_method=partition_method, activation_checkpointing=recompute)
    else:
        module = SpecSequential(specs, base_seed=SEED, activation_checkpointing=recompute,
                                checkpointable_layers=CHECKPOINTABLE_LAYERS)
    ds_config = {
        "train_batch_size": MICRO * ACC, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACC,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
    }
    if not pipe_partitioned:  # DeepSpeed's default (True) splits the (flat) activation over TP between stages
        ds_config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=ds_config,
                                      mpu=None if pp > 1 else grid)
    losses = []
    for step in range(STEPS):
        if pp > 1:
            loss = engine.train_batch(data_iter=iter([micro_batch(variant, step, m) for m in range(ACC)]))
            losses.append(float(loss))
        else:
            total = 0.0
            for m in range(ACC):
                inputs, labels = micro_batch(variant, step, m)
                loss = loss_for(cfg)(engine(inputs), labels)
                engine.backward(loss)
                engine.step()
                total += loss.item() / ACC
            losses.append(total)
    destroy_engine(engine)
    keys = sorted(module.state_dict())
    return losses, keys, getattr(module, "parts", None)


_REFERENCE = {}
LAYOUTS = {  # name: (world size, tp, pp, activation checkpointing, DeepSpeed's pipe_partitioned, partition method)
    "tp2": (2, 2, 1, False, False, None),
    "pp2": (2, 1, 2, False, False, "compute"),
    "pp2-recompute-by-type": (2, 1, 2, True, False, "type:UNetResBlock"),  # DeepSpeed's own partitioning
    "tp2-pp2-partitioned": (4, 2, 2, False, True, "compute"),  # DeepSpeed's default pipeline settings
}


@pytest.mark.parametrize("variant", ["seg", "diffusion"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_matches_one_process(dist_run, variant, layout):
    if variant not in _REFERENCE:
        _REFERENCE[variant] = reference_losses(variant)
    expected = _REFERENCE[variant]
    world, tp, pp, recompute, pipe_partitioned, method = LAYOUTS[layout]
    results = dist_run(world, train_case, variant, tp, pp, recompute, pipe_partitioned, method)
    for losses, _, _ in results:  # DeepSpeed reports the pipeline's loss on every stage
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"
    if pp > 1:
        plain = sorted(SpecSequential(layer_specs(config(variant)), base_seed=SEED).state_dict())
        stages = {tuple(keys) for _, keys, _ in results}  # TP ranks of a stage hold the same keys
        assert sorted(k for keys in stages for k in keys) == plain, "plain and pipelined keys differ"
        if method == "compute":
            assert results[0][2] == pipeline_parts(config(variant), 2)
        else:  # DeepSpeed's type: method: ResNet blocks spread evenly (to within one)
            kinds = [u.kind for u in units(config(variant))]
            parts = results[0][2]
            assert abs(kinds[:parts[1]].count("res") - kinds[parts[1]:].count("res")) <= 1, (kinds, parts)
