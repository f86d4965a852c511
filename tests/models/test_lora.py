"""zoo's LoRA / DoRA (zoo.models.lora) computes what ``peft`` computes on the transformers model, same adapter weights.

A tiny Llama (GQA, untied head) and GPT-2 (Conv1D, tied embeddings) get their base weights through the converters' key
tables (as tests/models/test_gpt_vs_transformers.py), zoo's adapters on every target, random A, B and magnitude
moved to peft's modules through the same tables' ``to_hf`` (B's and the magnitude's rows are W's rows: the fused QKV
de-interleaved per kv group, fc1 split into gate and up). zoo's one A of a fused weight is one parameter shared by
the HF projections it came from (q/k/v, gate/up), so training keeps them equal on both sides. Then the logits,
and the losses over 3 AdamW steps, agree to 1e-5 (one plain process, fp32).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.test_gpt_vs_transformers import gpt2_pair, llama_pair, load_from_hf, token_ids
from zoo.models.lora import LoraConfig, adapter_parameters, apply_lora, is_adapter, merged_tensors

peft = pytest.importorskip("peft")

TOL = 1e-5
HF_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
              "gpt2": ["c_attn", "c_proj", "c_fc"]}  # GPT-2's c_proj: the attention's and the MLP's


def adapted_pair(arch: str, cfg_lora: LoraConfig, seed: int = 0):
    """(zoo model with adapters, peft model, vocab size) with the same base and the same random adapters."""
    hf, model, cfg, table = llama_pair(False, 2, None, seed) if arch == "llama" else gpt2_pair(seed)
    load_from_hf(model, hf, table, cfg)
    adapted = apply_lora(model, cfg_lora, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in adapter_parameters(model).items():
            if name.endswith("lora_magnitude"):
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))  # away from the base's norms
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if name.endswith("lora_B") else 0.3))
    rows = [r.at(i) if "{}" in r.zoo else r for r in table for i in
            (range(cfg.num_hidden_layers) if "{}" in r.zoo else [None])]
    targets = [k.removesuffix(".weight") for r in rows if r.zoo.removesuffix(".weight") in adapted for k in r.hf]
    assert {t.rsplit(".", 1)[-1] for t in targets} <= set(HF_TARGETS[arch])
    hf_cfg = peft.LoraConfig(r=cfg_lora.r, lora_alpha=cfg_lora.alpha, lora_dropout=cfg_lora.dropout,
                             use_dora=cfg_lora.dora, use_rslora=cfg_lora.rslora, target_modules=targets,
                             fan_in_fan_out=arch == "gpt2")
    peft_model = peft.get_peft_model(hf, hf_cfg)
    zoo_params = dict(model.named_parameters())
    moved = set()
    for r in rows:
        prefix = r.zoo.removesuffix(".weight")
        if prefix not in adapted:
            continue
        shared_A = torch.nn.Parameter(zoo_params[f"{prefix}.lora_A"].detach().clone())
        B = zoo_params[f"{prefix}.lora_B"].detach()[: table_rows(r, cfg)]
        Bs = r.hf_tensors(B)  # GPT-2: [r, out], Conv1D's orientation
        mags = None
        if cfg_lora.dora:
            m = zoo_params[f"{prefix}.lora_magnitude"].detach()[: table_rows(r, cfg)]
            mags = r.hf_tensors(m)
        for j, key in enumerate(r.hf):
            mod = peft_model.get_submodule("base_model.model." + key.removesuffix(".weight"))
            mod.lora_A["default"].weight = shared_A  # one A for every projection of a fused zoo weight
            b = Bs[j].t() if arch == "gpt2" else Bs[j]
            mod.lora_B["default"].weight.data.copy_(b)
            if mags is not None:
                mod.lora_magnitude_vector["default"].weight.data.copy_(mags[j])
            moved.add(key)
        moved.add(prefix)
    assert set(adapted) <= moved, sorted(set(adapted) - moved)
    return model, peft_model, cfg.vocab_size


def table_rows(r, cfg) -> int:
    """The rows of the HF side of a zoo weight (the LM head's: the unpadded vocabulary)."""
    return cfg.vocab_size if r.zoo.endswith("linear.weight") else 10**9


def loss_of(logits, ids, vocab):
    return F.cross_entropy(logits[:, :-1, :vocab].flatten(0, 1), ids[:, 1:].flatten())


CASES = {"lora": LoraConfig(r=4, alpha=8.0, targets=["qkv", "dense", "fc1", "fc2", "lm_head"]),
         "rslora": LoraConfig(r=4, alpha=8.0, rslora=True),
         "dora": LoraConfig(r=4, alpha=8.0, dora=True, targets=["qkv", "dense", "fc1", "fc2", "lm_head"])}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lora_trains_as_peft(arch, case):
    if arch == "gpt2" and "lm_head" in CASES[case].targets:
        cfg_lora = LoraConfig(**{**CASES[case].to_dict(), "targets": ["qkv", "dense", "fc1", "fc2"]})
    else:
        cfg_lora = CASES[case]
    model, peft_model, vocab = adapted_pair(arch, cfg_lora)
    ids = token_ids()
    with torch.no_grad():
        ours, theirs = model(ids)[..., :vocab], peft_model(ids).logits
        plain = peft_model.get_base_model()
        with peft_model.disable_adapter():
            base = plain(ids).logits
    assert (ours - base).abs().max() > 1e-2, "the adapters must change the logits"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOL * 10)  # logits O(1): 1e-4 absolute, as the converters'

    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and len(trainable) == len(adapter_parameters(model))
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    peft_trainable = [p for p in peft_model.parameters() if p.requires_grad]
    opt_peft = torch.optim.AdamW(peft_trainable, lr=1e-2)
    losses = []
    for _ in range(3):
        batch = token_ids(seed=1)  # one batch: the loss must fall
        pair = []
        for m, o in ((model, opt), (peft_model, opt_peft)):
            o.zero_grad()
            out = m(batch)
            loss = loss_of(out if isinstance(out, torch.Tensor) else out.logits, batch, vocab)
            loss.backward()
            o.step()
            pair.append(loss.item())
        losses.append(pair)
    ours, theirs = torch.tensor(losses).unbind(1)
    torch.testing.assert_close(ours, theirs, rtol=TOL, atol=0)
    assert ours[-1] < ours[0], f"training must lower the loss: {ours}"
    # the base stayed frozen: no gradient on any base weight
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))

    # merged (zoo.models.lora.merged, what the LoRA run's HF export holds) as peft's merge_and_unload
    state = {n: t.detach() for n, t in model.state_dict().items()}
    plain = (llama_pair(False, 2, None) if arch == "llama" else gpt2_pair())[1]
    plain.load_state_dict(dict(merged_tensors(state, state.__getitem__, cfg_lora)))
    ids = token_ids(seed=9)
    with torch.no_grad():
        adapted, ours = model(ids)[..., :vocab], plain(ids)[..., :vocab]
        theirs = peft_model.merge_and_unload()(ids).logits
    torch.testing.assert_close(ours, adapted, rtol=0, atol=TOL * 10)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOL * 100)  # both trained 3 steps: their drift (1e-5) too


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_dropout_on_the_adapter_input_as_peft(monkeypatch, dora):
    """With lora dropout, in training: the adapter term (and DoRA's W x') sees the dropped input, the base term the
    whole one, as in peft. The mask is made a function of the input (x -> 2 x [x > 0]), so that zoo's one draw for a
    fused weight and peft's one per projection agree; eval mode drops nothing."""
    real = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        return x if p == 0 or not training else x * 2 * (x > 0)

    cfg_lora = LoraConfig(r=4, alpha=8.0, dropout=0.5, dora=dora)
    model, peft_model, vocab = adapted_pair("llama", cfg_lora)
    ids = token_ids()
    with torch.no_grad():
        evaluated = model.eval()(ids)[..., :vocab]
        torch.testing.assert_close(evaluated, peft_model.eval()(ids).logits, rtol=0, atol=TOL * 10)
        monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
        ours, theirs = model.train()(ids)[..., :vocab], peft_model.train()(ids).logits
    monkeypatch.setattr(torch.nn.functional, "dropout", real)
    assert (ours - evaluated).abs().max() > 1e-2, "the dropout must change the adapter term"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOL * 10)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_merged_head_weight_computes_the_adapted_head(dora):
    """``merged_weight()`` (what the fused LM head + loss reads): the same outputs and adapter gradients as the
    adapted layer's own forward."""
    model, _, _ = adapted_pair("llama", LoraConfig(r=4, alpha=8.0, dora=dora, targets=["lm_head"]))
    head = model.get_submodule("4.linear")
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    grads = []
    for y in (lambda: head(x), lambda: F.linear(x, head.merged_weight())):
        head.zero_grad()
        out = y()
        out.square().sum().backward()
        grads.append([out.detach()] + [p.grad.clone() for p in adapter_parameters(head).values()])
    assert len(grads[0]) == (4 if dora else 3)
    for a, b in zip(*grads):  # (W + s B A) x against W x + s B (A x): fp32 sums in another order
        assert float((a - b).norm() / b.norm()) < 1e-5


def test_adapters_start_as_the_base_model():
    """B = 0 and (DoRA) m = ||W||: an adapted model computes the base model; A is nn.Linear's init (kaiming-uniform)."""
    for dora in (False, True):
        _, model, cfg, _ = llama_pair(False, 2, None)
        ids = token_ids()
        with torch.no_grad():
            before = model(ids)
        apply_lora(model, LoraConfig(r=4, dora=dora, targets=["qkv", "dense", "fc1", "fc2", "lm_head"]), seed=3)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), before, rtol=0, atol=1e-6)
        A = dict(model.named_parameters())["1.attention.qkv.lora_A"]
        bound = 1 / cfg.hidden_size ** 0.5
        assert A.abs().max() <= bound and A.abs().max() > 0.9 * bound


@pytest.mark.parametrize("bad,match", [
    (dict(r=0), "lora.r must be a positive integer"),
    (dict(alpha=-1), "lora.alpha must be a positive number"),
    (dict(dropout=1.0), r"lora.dropout must be a number in \[0, 1\)"),
    (dict(targets=["q_proj"]), r"lora.targets \['q_proj'\] are not zoo module names"),
    (dict(targets=[]), "lora.targets must be a non-empty list"),
    (dict(dora="yes"), "lora.dora must be true or false"),
    (dict(dora=True, targets=["experts"]), "dora is not supported on MoE experts"),
])
def test_bad_lora_config_is_refused_in_one_line(bad, match):
    with pytest.raises(ValueError, match=match) as e:
        LoraConfig(**bad)
    assert "\n" not in str(e.value)


def test_unknown_keys_and_double_application_are_refused():
    with pytest.raises(ValueError, match=r"lora: unknown key\(s\) \['rank'\]"):
        LoraConfig.from_dict({"rank": 4})
    _, model, _, _ = llama_pair(False, 2, None)
    apply_lora(model, LoraConfig())
    with pytest.raises(ValueError, match="already has adapters"):
        apply_lora(model, LoraConfig())
