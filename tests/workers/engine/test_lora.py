"""LoRA on the FSDP2 engine (workers/engine/lora.py): only adapters train, the base model is the reference
for free, the merged weights equal peft's own merge, 2 FSDP ranks equal one process, and a LoRA checkpoint
holds the adapters and resumes bit-identically."""

from __future__ import annotations

import engine_testlib as T
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from workers.distributed import run_in_processes
from workers.engine import CheckpointError, FSDPEngine, LoRAConfig, load_checkpoint, save_checkpoint
from workers.engine.lora import target_module_errors

R = 10


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return T.make_model_dir(tmp_path_factory.mktemp("tiny_qwen2_lora"))


def _lora_engine(model_dir, **kw):
    return FSDPEngine(T.engine_config(model_dir, lora=T.lora_config(), **kw))


def test_only_adapters_train_and_hold_optimizer_state(model_dir):
    eng = _lora_engine(model_dir)
    trainable = [n for n, p in eng.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = [p for g in eng.optimizer.param_groups for p in g["params"]]
    assert len(optimized) == len(trainable)
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    eng.train_step(T.make_batch(8), T.pg_loss)
    after = dict(eng.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and changed <= set(trainable), sorted(changed - set(trainable))[:3]
    assert len(eng.optimizer.state) == len(trainable)


def test_merged_weights_are_the_base_at_start_and_equal_peft_merge_after_training(model_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    base_sd = base.state_dict()
    eng = _lora_engine(model_dir)
    start = dict(eng.full_state_dict_iter())
    assert set(start) == set(base_sd) - {"lm_head.weight"} or set(start) == set(base_sd)
    for name, t in start.items():  # B starts at zero: the adapted model is the base
        assert torch.equal(t, base_sd[name]), name
    for _ in range(2):
        eng.train_step(T.make_batch(8, seed=5), T.pg_loss)
    adapter = dict(eng.adapter_state_iter())
    assert all(".lora_" in n and ".default." not in n for n in adapter)
    # peft's own merge of the same adapter on a fresh base is the reference
    ref = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear"),
    )
    from peft import set_peft_model_state_dict

    assert not set_peft_model_state_dict(ref, adapter).unexpected_keys
    merged_ref = ref.merge_and_unload().state_dict()
    merged = dict(eng.full_state_dict_iter())
    moved = 0
    for name, t in merged.items():
        torch.testing.assert_close(t, merged_ref[name], rtol=1e-6, atol=1e-6, msg=name)
        moved += not torch.equal(t, base_sd[name])
    assert moved >= 2 * 7  # every linear of both layers moved


def test_reference_log_probs_are_the_base_models_exactly(model_dir):
    batch = T.make_batch(6, seed=9)
    eng = _lora_engine(model_dir)
    for _ in range(2):
        eng.train_step(T.make_batch(8, seed=5), T.pg_loss)
    with eng.base_model_mode():
        ref_lp = eng.compute_log_prob(batch)["log_probs"]
    base_eng = FSDPEngine(T.engine_config(model_dir, optim=None))
    base_lp = base_eng.compute_log_prob(batch)["log_probs"]
    assert torch.equal(ref_lp, base_lp)
    adapted = eng.compute_log_prob(batch)["log_probs"]
    assert (adapted - base_lp).abs().max() > 1e-4  # the adapters are back on after the context


def test_two_fsdp_ranks_equal_one_process_and_resume_bit_identically(model_dir, tmp_path):
    run_in_processes(T.lora_dist_body, 2, model_dir, str(tmp_path))
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert r0["use_fsdp"]
    single = _lora_engine(model_dir)
    loss, grads = T.accumulate_grads(single, T.make_batch(8, seed=300), T.pg_loss)
    assert r0["loss_g"] == pytest.approx(loss, rel=1e-5)
    assert set(r0["grads_g"]) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(r0["grads_g"][name], g, rtol=1e-4, atol=1e-7, msg=name)
    # the checkpoint holds the adapters (and their optimizer state), not the frozen base
    assert r0["resumed_loss"] == r0["losses"][1]
    for name, t in r0["adapter"].items():
        assert torch.equal(r0["resumed_adapter"][name], t), name


def test_a_lora_checkpoint_holds_only_adapters_and_is_refused_by_a_full_engine_and_vice_versa(
    model_dir, tmp_path
):
    lora = _lora_engine(model_dir)
    lora.train_step(T.make_batch(8), T.pg_loss)
    lora_ckpt = save_checkpoint(lora, str(tmp_path / "lora"))
    full = FSDPEngine(T.engine_config(model_dir))
    full_ckpt = save_checkpoint(full, str(tmp_path / "full"))
    saved = FileSystemReader(f"{lora_ckpt}/model_optim").read_metadata().state_dict_metadata
    tensors = [k for k, v in saved.items() if hasattr(v, "size") and k.startswith(("model.", "optim.state."))]
    adapters = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    # the adapters and their AdamW state: nothing of the frozen base (the tied output head included)
    assert all(".lora_" in k for k in tensors), [k for k in tensors if ".lora_" not in k]
    assert len([k for k in tensors if k.startswith("model.")]) == len(adapters)
    assert len([k for k in tensors if k.endswith(".exp_avg_sq")]) == len(adapters)
    with pytest.raises(CheckpointError, match="lora"):
        load_checkpoint(FSDPEngine(T.engine_config(model_dir)), lora_ckpt)
    with pytest.raises(CheckpointError, match="lora"):
        load_checkpoint(_lora_engine(model_dir), full_ckpt)


def test_bad_lora_settings_name_the_key_and_the_module(model_dir):
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        LoRAConfig(rank=-1)
    with pytest.raises(ValueError, match="dropout"):
        LoRAConfig(rank=4, dropout=1.5)
    errors = target_module_errors(model_dir, LoRAConfig(rank=4, target_modules=["q_proj", "qkv_fused"]))
    assert len(errors) == 1 and "actor.lora.target_modules" in errors[0] and "qkv_fused" in errors[0]
    assert "q_proj" in errors[0]  # the modules the model has are listed
    assert target_module_errors(model_dir, LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"])) == []


def test_export_writes_the_merged_model_and_a_peft_adapter_that_agree(model_dir, tmp_path):
    from peft import PeftModel

    from workers.engine import export_hf

    eng = _lora_engine(model_dir, lr=3e-2)
    for _ in range(3):
        eng.train_step(T.make_batch(8, seed=5), T.pg_loss)
    out = export_hf(eng, tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert merged.config.architectures == ["Qwen2ForCausalLM"]
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), f"{out}/adapter"
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    batch = T.make_batch(4, seed=11)
    with torch.no_grad():
        kw = dict(attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
        a = merged(batch["input_ids"], **kw).logits
        b = peft_model(input_ids=batch["input_ids"], **kw).logits
        c = base(batch["input_ids"], **kw).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert (a - c).abs().max() > 1e-3  # the export is the trained policy, not the base
    # and the engine's own log-probs are the exported model's
    lp = eng.compute_log_prob(batch)["log_probs"]
    ref = torch.log_softmax(a[:, -R - 1 : -1].float(), -1).gather(-1, batch["responses"][..., None])[..., 0]
    torch.testing.assert_close(lp, ref * batch["attention_mask"][:, -R:], rtol=1e-4, atol=1e-5)
