"""Reference-model training: config validation, deterministic batches, the exact-match statistic
against a hand oracle, and a few steps of a tiny run that saves a loadable, resumable directory."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from kvstate.errors import KVStateError
from kvstate.lab.training.cli import parse_overrides, train_command
from kvstate.lab.training.io import partial_dir
from kvstate.lab.training.train import (
    PartStopped,
    TrainConfig,
    TrainError,
    answer_stats,
    load_state,
    make_batch,
    model_config,
    stage_tasks,
    train,
)
from kvstate.lab.workloads import build_tokenizer

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_kv_heads": 1, "log_every": 1,
        "tokens_per_step": 256, "max_batch": 4}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("bad, match", [
    ({"arch": "mamba"}, "attn, hybrid"),
    ({"minutes": 0}, "minutes"),
    ({"arch": "hybrid", "num_layers": 6}, "multiple of 4"),
    ({"start_length": 128, "max_length": 64}, "start_length"),
    ({"answer_weight": 1.0}, "answer_weight"),
    ({"hidden_size": 100, "num_heads": 3}, "num_heads"),
    ({"task_mix": {"niah_single": 1.0, "poems": 1.0}}, "unknown: \\['poems'\\]"),
    ({"task_mix": {"qa": 1.0}}, "gate task"),
    ({"task_mix": {"niah_single": -1.0}}, "shares >= 0"),
    ({"resume_length": 32}, "resume_length"),
])
def test_config_errors_name_the_field(bad, match):
    with pytest.raises(TrainError, match=match):
        TrainConfig(**bad)
    assert issubclass(TrainError, KVStateError)


def test_model_configs_have_the_reference_shapes(tok):
    attn = model_config(TrainConfig(arch="attn"), len(tok), tok)
    hybrid = model_config(TrainConfig(arch="hybrid"), len(tok), tok)
    assert attn.model_type == "qwen3" and attn.num_hidden_layers == 4 and attn.vocab_size == len(tok)
    assert hybrid.model_type == "qwen3_5_text"
    assert hybrid.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


def test_batches_deterministic_and_mix_multi_needle_from_the_start(tok):
    cfg = TrainConfig()
    ids, w, tasks = make_batch(cfg, 64, 5, tok)
    ids2, w2, tasks2 = make_batch(cfg, 64, 5, tok)
    assert torch.equal(ids, ids2) and torch.equal(w, w2) and tasks == tasks2
    assert ids.shape == (32, 64) and not torch.equal(ids, make_batch(cfg, 64, 6, tok)[0])
    assert {"niah_single", "niah_multikey"} <= set(stage_tasks(64, tok))
    assert set(stage_tasks(128, tok)) >= {"niah_multivalue", "qa", "cwe"}


def test_drill_rows_follow_the_mix(tok):
    cfg = TrainConfig(task_mix={"niah_multikey": 1.0, "niah_drill": 3.0})
    ids, w, tasks = make_batch(cfg, 512, 2, tok)
    assert set(tasks) == {"niah_multikey", "niah_drill"} and ids.shape == (8, 512)
    per_row = (w[:, 1:] >= 10).sum(-1)  # a drill row answers every needle: more answer tokens than a 1-needle row
    drill = torch.tensor([t == "niah_drill" for t in tasks])
    assert per_row[drill].max() > per_row[~drill].max()
    assert "niah_drill" in stage_tasks(64, tok) and "niah_drill" not in stage_tasks(64, tok, {"niah_single": 1.0})


def test_train_command_set_overrides(tmp_path):
    assert parse_overrides(["max_length=2048", "advance_metric=exact", 'task_mix={"niah_single": 1}']) == {
        "max_length": 2048, "advance_metric": "exact", "task_mix": {"niah_single": 1}}
    with pytest.raises(KVStateError, match=r"FIELD=VALUE.*max_length"):
        parse_overrides(["max_len=4"])
    with pytest.raises(KVStateError, match="FIELD=VALUE"):
        parse_overrides(["threads"])
    with pytest.raises(KVStateError, match="start_length"):
        train_command(arch="attn", out=tmp_path, overrides=["start_length=8"])
    tiny = [f"{k}={v}" for k, v in TINY.items()] + ["num_layers=1", "max_steps=2", 'task_mix={"niah_single": 1, "niah_drill": 1}']
    train_command(arch="attn", out=tmp_path / "cli", minutes=5.0, overrides=tiny)
    state = load_state(tmp_path / "cli")
    assert state["step"] == 2 and state["config"]["task_mix"] == {"niah_single": 1, "niah_drill": 1}
    assert set(state["curve"][-1]["exact"]) <= {"niah_single", "niah_drill"}


def test_a_part_stopped_at_a_step_leaves_its_periodic_save_there_and_no_output(tmp_path):
    tiny = [f"{k}={v}" for k, v in TINY.items()] + ["num_layers=1", "max_steps=4"]
    out = tmp_path / "run"
    train_command(arch="attn", out=out, minutes=5.0, overrides=tiny, stop_at_step=2)  # returns: the CLI exits 0
    assert not out.exists() and load_state(partial_dir(out))["step"] == 2
    cfg = TrainConfig(arch="attn", num_layers=1, max_steps=4, **TINY)
    with pytest.raises(PartStopped, match="stopped at step 3"):  # a resumed part stops there too
        train(cfg, out, resume=partial_dir(out), progress=False, log=lambda s: None, stop_at_step=3)
    state = train(cfg, out, resume=partial_dir(out), progress=False, log=lambda s: None)  # then runs to its end
    assert state["step"] == 7 and not partial_dir(out).exists()
    assert [c["from_step"] for c in load_state(out)["commands"]] == [0, 2, 3]


def test_answer_stats_is_greedy_exact_match(tok):
    ids, w, _ = make_batch(TrainConfig(), 64, 0, tok)
    logits = torch.nn.functional.one_hot(ids[:, 1:], len(tok)).float()  # a perfect next-token oracle
    logits = torch.cat([logits, torch.zeros(ids.shape[0], 1, len(tok))], 1)  # (B, T, V)
    has, exact, first = answer_stats(logits, ids, w, 10.0)
    assert has.all() == bool((w >= 10).any(-1).all()) and exact[has].all() and first[has].all()
    # break the last answer token of row 0: exact match fails, the first answer token still counts
    last = int((w[0, 1:] >= 10).nonzero()[-1])
    logits[0, last] = torch.roll(logits[0, last], 1)
    has, exact, first = answer_stats(logits, ids, w, 10.0)
    assert not exact[0] and first[0]


def test_tiny_training_saves_a_loadable_resumable_model(tmp_path, tok):
    cfg = TrainConfig(arch="attn", num_layers=1, max_steps=3, **TINY)
    state = train(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    assert state["step"] == 3 and len(state["curve"]) == 3 and state["params"] > 0
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "run", local_files_only=True)
    loaded = tf.AutoTokenizer.from_pretrained(tmp_path / "run", local_files_only=True)
    assert loaded("the secret code")["input_ids"] == tok("the secret code")["input_ids"]
    assert model.config.vocab_size == len(tok)
    state2 = train(cfg, tmp_path / "run2", resume=tmp_path / "run", progress=False, log=lambda s: None)
    assert state2["step"] == 6 and load_state(tmp_path / "run2")["tokens"] == 2 * state["tokens"]
    parts = load_state(tmp_path / "run2")["commands"]  # every part recorded, for kvstate lab retrain
    assert [(c["out"], c["resume"], c["from_step"]) for c in parts] == [
        (str(tmp_path / "run"), None, 0), (str(tmp_path / "run2"), str(tmp_path / "run"), 3)]
    assert (tmp_path / "run" / "optimizer.safetensors").is_file() and not list(tmp_path.rglob("*.pt"))  # no pickle
    restart = TrainConfig(arch="attn", num_layers=1, max_steps=1, resume_length=128, **TINY)
    state3 = train(restart, tmp_path / "run3", resume=tmp_path / "run2", progress=False, log=lambda s: None)
    assert state3["length"] == 128 and state3["curve"][-1]["length"] == 128 and state2["length"] == 64
    with pytest.raises(TrainError, match="--arch attn"):
        train(TrainConfig(arch="hybrid", max_steps=1), tmp_path / "x", resume=tmp_path / "run", progress=False)


def test_same_seed_same_weights(tmp_path):
    cfg = TrainConfig(arch="attn", num_layers=1, max_steps=2, **TINY)
    for name in ("a", "b"):
        train(cfg, tmp_path / name, progress=False, log=lambda s: None)
    a, b = (tf.AutoModelForCausalLM.from_pretrained(tmp_path / n).state_dict() for n in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_hybrid_starts_from_attention_model(tmp_path):
    attn = TrainConfig(arch="attn", num_layers=1, max_steps=1, **TINY)
    train(attn, tmp_path / "attn", progress=False, log=lambda s: None)
    hybrid = TrainConfig(arch="hybrid", num_layers=4, max_steps=1, **TINY)
    state = train(hybrid, tmp_path / "hybrid", init_from=tmp_path / "attn", progress=False, log=lambda s: None)
    assert state["init_from"]["tensors"] >= 3  # embeddings, final norm, MLPs, norms
    src = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "attn").state_dict()
    dst = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hybrid").config
    assert dst.model_type == "qwen3_5_text" and "model.embed_tokens.weight" in src


def test_train_command_rejects_resume_with_init(tmp_path):
    with pytest.raises(KVStateError, match="exclude"):
        train_command(arch="hybrid", out=tmp_path, resume=tmp_path, init_from=tmp_path)
    with pytest.raises(TrainError, match="attn, hybrid"):
        train_command(arch="transformer", out=tmp_path)


def test_optimizer_state_round_trips_through_safetensors(tmp_path):
    import torch

    from kvstate.lab.training.optim_io import load_optimizer as _load_optimizer
    from kvstate.lab.training.optim_io import save_optimizer as _save_optimizer

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum(p.square().sum() for p in params).backward()
    opt.step()
    _save_optimizer(opt, tmp_path / "o.safetensors")
    loaded = _load_optimizer(tmp_path / "o.safetensors")
    ref = opt.state_dict()
    assert loaded["param_groups"] == ref["param_groups"]
    for i, st in ref["state"].items():
        for k, v in st.items():
            assert torch.equal(loaded["state"][i][k], v)
    opt2 = torch.optim.AdamW(params, lr=1e-3)
    opt2.load_state_dict(loaded)  # accepted by torch


def test_init_from_the_same_family_copies_verbatim(tmp_path):
    from kvstate.lab.training.init_from import init_from_model

    for arch, layers in (("attn", 1), ("hybrid", 4)):
        cfg = TrainConfig(arch=arch, num_layers=layers, max_steps=1, **TINY)
        train(cfg, tmp_path / arch, progress=False, log=lambda s: None)
        src = tf.AutoModelForCausalLM.from_pretrained(tmp_path / arch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            dst = tf.AutoModelForCausalLM.from_config(src.config)
        assert init_from_model(dst, tmp_path / arch) == len(src.state_dict())
        a, b = src.state_dict(), dst.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), arch  # no gate doubling, no norm shift
