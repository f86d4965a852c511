"""LoRA fine-tuning end to end (``launch/finetune.py --init HF --set finetune.lora.r=4``) at tp=2: the exported zoo
folder holds the frozen base unchanged and the trained adapters beside it (the naming contract, whole tensors,
``"lora"`` in config.json), the HF folder is the merged model (transformers' logits equal zoo's model with its
adapters applied, one process), zoo-to-peft's unmerged adapter loads with ``PeftModel.from_pretrained`` on the HF
base and gives zoo's logits, ``--adapter`` of that PEFT folder goes on training from its weights, the run resumes
from its checkpoint with its adapters, and a resume, an init folder or an adapter whose adapters differ from the
run's is refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.mains import run_main
from tests.training.test_finetune import reverse_rows

STEPS = ["--set", "training.seq_length=32", "training.micro_batch_size=8", "training.global_batch_size=16",
         "training.lr=1e-2", "training.eval_interval=0", "training.log_interval=1", "finetune.lora.r=4",
         "finetune.lora.alpha=8", "finetune.lora.targets=[qkv, dense, fc1, fc2, lm_head]"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(HF Llama folder with GQA and an untied head, data file)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zoo.data.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("lora")
    rows = reverse_rows(32)
    data = root / "reverse.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = root / "hf-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)).save_pretrained(hf)
    train_bpe_tokenizer([r["prompt"] + r["response"] for r in rows], 300, hf)
    return hf, data


def test_lora_finetune_tp2_exports_adapters_merges_hf_and_resumes(task, tmp_path, dist_run, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from zoo.convert import io
    from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
    from zoo.models.lora import LoraConfig, apply_lora
    from zoo.models.specs import SpecSequential

    hf, data = task
    out = tmp_path / "lora"
    argv = ["--init", hf, "--data", data, "--tp", "2", "--out", out, "--valid-fraction", "0"]
    ranks = dist_run(2, run_main, "zoo.dispatch:finetune_main", [*argv, "--steps", "3", *STEPS])
    assert [code for code, _, _ in ranks] == [0, 0], [err[-3000:] for _, _, err in ranks]
    log = "".join(stdout for _, stdout, _ in ranks)
    assert "the adapters merged in" in log and "sample (greedy)" in log

    model_dir = out / "model"
    meta = json.loads((model_dir / "config.json").read_text())
    assert meta["lora"] == LoraConfig(r=4, alpha=8.0, targets=["qkv", "dense", "fc1", "fc2", "lm_head"]).to_dict()

    def tensors(folder):
        mapping = io.weight_map(folder)
        out = {}
        for key, fname in mapping.items():
            with safe_open(folder / fname, "pt") as f:
                out[key] = f.get_tensor(key)
        return out

    saved, base = tensors(model_dir), tensors(out / "init-model")
    assert saved["1.attention.qkv.lora_A"].shape == (4, 64)  # whole, not a TP shard
    assert saved["1.attention.qkv.lora_B"].shape == ((4 + 2 * 2) * 16, 4)
    assert saved["1.attention.dense.lora_A"].shape == (4, 64) and saved["1.mlp.fc1.lora_B"].shape == (192, 4)
    assert saved["4.linear.lora_B"].shape == (300, 4)  # the head's vocabulary unpadded, as its weight
    assert all(saved[k].abs().max() > 0 for k in saved if k.endswith("lora_B"))  # B left zero: it trained
    assert set(saved) - set(base) == {k for k in saved if "lora_" in k}
    assert all(torch.equal(saved[k], base[k]) for k in base), "the base weights must stay frozen"

    # hf/: the merged model; zoo's own model with its adapters applied computes the same logits
    model = SpecSequential(layer_specs(GPTConfig.from_dict(meta["config"]), ParallelOptions()))
    apply_lora(model, LoraConfig.from_dict(meta["lora"]))
    io.load_model(model_dir, model)
    merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(ids)[..., :300]
        torch.testing.assert_close(ours, merged(ids).logits, rtol=0, atol=1e-4)

    # zoo.load_model of the folder applies its adapters (generation computes the adapted model, not the base), and
    # save_pretrained keeps them
    import zoo

    loaded = zoo.load_model(model_dir)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), ours, rtol=0, atol=1e-5)
    again_dir = loaded.save_pretrained(tmp_path / "saved")
    assert json.loads((again_dir / "config.json").read_text())["lora"] == meta["lora"]
    with torch.no_grad():
        torch.testing.assert_close(zoo.load_model(again_dir)(ids), ours, rtol=0, atol=1e-5)

    # the unmerged adapter as peft loads it: zoo-to-peft (through the Llama key table: B de-interleaved per kv group
    # and TP-independent, one A for q/k/v and for gate/up) on the original HF base gives zoo's logits
    from peft import PeftModel

    from zoo.convert.cli import main as convert

    assert convert(["zoo-to-peft", "--src", str(model_dir), "--out", str(tmp_path / "adapter"), "--base", str(hf)]) == 0
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, ours, rtol=0, atol=1e-4)

    # --adapter: the PEFT folder goes on training on its base (its settings become finetune.lora); one step at lr
    # 1e-12 moves AdamW's weights by about 1e-12, so the exported adapter is the trained one (a fresh B would be 0)
    again = tmp_path / "again"
    one = ["--init", hf, "--data", data, "--out", again, "--valid-fraction", "0", "--adapter", tmp_path / "adapter"]
    ((rc, _, err),) = dist_run(1, run_main, "zoo.dispatch:finetune_main",
                               [*one, "--steps", "1", *STEPS[:5], "training.lr=1e-12", "--no-sample"])
    assert rc == 0, err[-3000:]
    assert json.loads((again / "model" / "config.json").read_text())["lora"] == meta["lora"]
    continued = tensors(again / "model")
    for key in (k for k in saved if "lora_" in k):
        torch.testing.assert_close(continued[key], saved[key], rtol=0, atol=1e-9)

    # the same command with more steps resumes from out/checkpoints (step 3), adapters included
    ranks = dist_run(2, run_main, "zoo.dispatch:finetune_main", [*argv, "--steps", "4", *STEPS])
    assert [code for code, _, _ in ranks] == [0, 0], [err[-3000:] for _, _, err in ranks]
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4], steps
    resumed = tensors(model_dir)
    assert not torch.equal(resumed["1.attention.qkv.lora_B"], saved["1.attention.qkv.lora_B"])

    # refused in one line, before anything runs: resuming with other adapters; an init folder holding adapters
    # without finetune.lora, or with others
    from zoo.finetune.gpt import main
    from zoo.training.config import ConfigError, load, validate

    other = [*STEPS[:-1], "finetune.lora.targets=[qkv]"]
    one = ["--init", hf, "--data", data, "--out", out, "--valid-fraction", "0"]  # this process alone
    assert main([str(a) for a in [*one, "--steps", "5", *other]]) == 2
    assert "trained adapters" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="holds LoRA adapters .* set finetune.lora to go on training them") as e:
        validate(load(None, [f"training.init_from={model_dir}", "data.source=synthetic"]), 1)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="holds adapters .* finetune.lora asks for"):
        validate(load(None, [f"training.init_from={model_dir}", "data.source=synthetic", "finetune.lora.r=8"]), 1)
    with pytest.raises(ConfigError, match=r"finetune.adapter .*adapter holds adapters .* finetune.lora asks for") as e:
        validate(load(None, [f"training.init_from={hf}", f"finetune.adapter={tmp_path / 'adapter'}",
                             "data.source=synthetic", "finetune.lora.r=8"]), 1)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="holds adapters already and finetune.adapter names"):
        validate(load(None, [f"training.init_from={model_dir}", f"finetune.adapter={tmp_path / 'adapter'}",
                             "data.source=synthetic"]), 1)


def test_adapters_that_differ_are_refused_in_one_line(task, tmp_path, capsys):
    from zoo.finetune.gpt import main
    from zoo.training.config import ConfigError, load, validate

    hf, data = task
    with pytest.raises(ConfigError, match=r"finetune.lora.targets \['q_proj'\] are not zoo module names") as e:
        validate(load(None, ["finetune.lora.targets=[q_proj]"]), 1)
    with pytest.raises(ConfigError, match="finetune.lora.targets 'experts' needs a mixture-of-experts model"):
        validate(load(None, ["finetune.lora.r=2", "finetune.lora.targets=experts"]), 1)
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        validate(load(None, ["finetune.lora.targets=[lm_head]"]), 1)  # the tiny GPT-2 ties its head
    with pytest.raises(ConfigError, match="finetune.lora.dropout 0.1 on the 'lm_head' target does not work with "
                                          "training.fused_cross_entropy"):
        validate(load(None, ["model.preset=tiny-llama", "finetune.lora.targets=[lm_head]", "finetune.lora.dropout=0.1",
                             "training.fused_cross_entropy=true"]), 1)
    with pytest.raises(ConfigError, match="finetune.lora is for the gpt family"):
        validate(load(None, ["model.family=bert", "finetune.lora.r=2"]), 1)
    assert "\n" not in str(e.value)
    out = tmp_path / "never"
    assert main([str(a) for a in ["--init", hf, "--data", data, "--out", out, *STEPS[:1],
                                  "training.seq_length=32", "finetune.lora.r=0"]]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["error: finetune.lora.r must be a positive integer (the adapters' rank, e.g. 16), got 0"]
    assert not out.exists()
