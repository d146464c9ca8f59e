"""The evaluation harness: well-formed results on tiny random models, an oracle model scores 1.0,
cache bytes match the config's accounting, cache policies are honoured, bad input names the fix."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from kvstate.errors import KVStateError
from kvstate.lab.harness import (
    SCORED_TASKS,
    LengthTooShortError,
    MissingTokenizerError,
    UnknownTaskError,
    load_reference,
    perplexity,
    run_tasks,
)
from kvstate.lab.training.cli import eval_command
from kvstate.lab.workloads import build_tokenizer, oracle_answer
from kvstate.lab.workloads.tasks import Example, min_length
from kvstate.models import cache_nbytes, kv_bytes_per_token, tiny_model


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def qwen3(tok):
    return tiny_model("qwen3", seed=0, vocab_size=len(tok))


class OracleModel(torch.nn.Module):
    """A "model" that reads the prompt by rule (``oracle_answer``) and emits the answer then ``<eos>``.

    It writes a 1-dim key/value per prompt token into the cache, so cache bytes are checkable.
    """

    def __init__(self, task: str, tokenizer) -> None:
        super().__init__()
        self.task, self.tok = task, tokenizer
        self.config = tf.Qwen3Config(num_hidden_layers=1, hidden_size=8, num_attention_heads=1,
                                     num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer))
        self.queue: list[int] = []

    def _logits(self, token: int) -> torch.Tensor:
        out = torch.full((1, 1, len(self.tok)), -1e4)
        out[0, 0, token] = 0.0
        return out

    def forward(self, input_ids, position_ids, cache, use_cache=True):
        t = input_ids.shape[1]
        cache.update(torch.zeros(1, 1, t, 8), torch.zeros(1, 1, t, 8), 0)
        if t > 1:  # prefill: the question follows the context's last "."
            words = self.tok.decode(input_ids[0], skip_special_tokens=True).split()
            cut = len(words) - words[::-1].index(".")
            ex = Example(self.task, " ".join(words[:cut]), " ".join(words[cut:]), (), 0, 0, None, "exact")
            self.queue = [*self.tok(oracle_answer(ex), add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
        return tf.modeling_outputs.CausalLMOutputWithPast(logits=self._logits(self.queue.pop(0)))


def test_tiny_model_results_are_well_formed(qwen3, tok):
    res = run_tasks(qwen3, tok, ["niah_single", "qa"], [96, 160], n=2, seed=0)
    assert [(r.task, r.length, r.n) for r in res.scores()] == [
        ("niah_single", 96, 2), ("niah_single", 160, 2), ("qa", 96, 2), ("qa", 160, 2)]
    per_token = kv_bytes_per_token(qwen3.config, torch.float32)
    for ex in res.examples:
        assert 0.0 <= ex.score <= 1.0
        assert ex.n_tokens == ex.length + 1  # the fit is exact with the synthetic tokenizer, plus <bos>
        assert ex.cache_bytes == per_token * ex.n_tokens
        assert ex.prefill_s > 0 and ex.decode_s >= 0 and ex.new_tokens >= 0
        assert ex.depth is not None
    data = res.as_json("tiny")
    assert data["model"] == "tiny" and set(data["results"][0]) == {"task", "length", "n", "score"}
    json.dumps(res.as_json("tiny", detail=True))


def test_deterministic_by_seed(qwen3, tok):
    a = run_tasks(qwen3, tok, ["niah_multikey"], [128], n=2, seed=3)
    b = run_tasks(qwen3, tok, ["niah_multikey"], [128], n=2, seed=3)
    assert [e.prediction for e in a.examples] == [e.prediction for e in b.examples]


def test_hybrid_cache_holds_recurrent_state(tok):
    model = tiny_model("qwen3_5", seed=0, vocab_size=len(tok))
    res = run_tasks(model, tok, ["niah_single"], [64], n=1, seed=0, max_new_tokens=3)
    ex = res.examples[0]
    # 1 attention layer of 4 holds KV; 3 Gated DeltaNet layers hold a fixed conv + recurrent state
    assert ex.cache_bytes > kv_bytes_per_token(model.config, torch.float32) * ex.n_tokens
    assert ex.new_tokens <= 3


@pytest.mark.parametrize("task", SCORED_TASKS)
def test_oracle_model_scores_one(tok, task):
    length = max(160, min_length(task) + 20)
    res = run_tasks(OracleModel(task, tok), tok, [task], [length], n=3, seed=1)
    assert res.score(task, length) == 1.0
    assert all(e.cache_bytes == 2 * 8 * 4 * e.n_tokens for e in res.examples)


def test_depth_grid_covers_every_depth(tok):
    res = run_tasks(OracleModel("niah_single", tok), tok, ["niah_single"], [100, 200], n=5, seed=0)
    grid = res.depth_grid(bins=5)
    assert grid.lengths == [100, 200]
    assert all(c == 1 for row in grid.counts for c in row)  # default depths 0, 0.25, ..., 1 spread over 5 examples
    assert all(s == 1.0 for row in grid.scores for s in row)


def test_cache_factory_called_per_example(qwen3, tok):
    made = []

    def factory(model):
        made.append(tf.DynamicCache(config=model.config))
        return made[-1]

    res = run_tasks(qwen3, tok, ["vt"], [128], n=3, seed=0, cache_factory=factory, max_new_tokens=2)
    assert len(made) == 3 and len({id(c) for c in made}) == 3
    assert res.examples[0].cache_bytes == cache_nbytes(made[0]) - kv_bytes_per_token(qwen3.config, torch.float32)


def test_perplexity_is_finite(qwen3, tok):
    ppl = perplexity(qwen3, tok, 64, 1, 0)
    assert 1.0 < ppl < 10 * len(tok)


def test_bad_task_names_valid_choices(qwen3, tok):
    with pytest.raises(UnknownTaskError, match="niah_single"):
        run_tasks(qwen3, tok, ["needle"], [128], n=1, seed=0)
    with pytest.raises(UnknownTaskError, match="perplexity"):
        run_tasks(qwen3, tok, ["text"], [128], n=1, seed=0)


def test_length_too_short_names_minimum(qwen3, tok):
    with pytest.raises(LengthTooShortError, match=f">= {min_length('cwe')}"):
        run_tasks(qwen3, tok, ["cwe"], [64], n=1, seed=0)
    with pytest.raises(KVStateError, match="n=0"):
        run_tasks(qwen3, tok, ["qa"], [128], n=0, seed=0)


def test_model_dir_without_tokenizer(tmp_path, qwen3):
    qwen3.save_pretrained(tmp_path / "m")
    with pytest.raises(MissingTokenizerError, match="save_pretrained"):
        load_reference(tmp_path / "m")
    assert issubclass(MissingTokenizerError, KVStateError)


def test_eval_command_json(tmp_path, qwen3, tok, capsys):
    qwen3.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    eval_command(model=tmp_path / "m", task="niah_single,vt", length="128", n=1, seed=0, as_json=True)
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["model"] == str(tmp_path / "m")
    assert [(r["task"], r["length"], r["n"]) for r in data["results"]] == [("niah_single", 128, 1), ("vt", 128, 1)]
    assert all(0.0 <= r["score"] <= 1.0 for r in data["results"])


def test_eval_command_bad_input(tmp_path):
    with pytest.raises(UnknownTaskError, match="niah_multikey"):
        eval_command(model=tmp_path, task="niah", length="128")
    with pytest.raises(KVStateError, match="not a whole number"):
        eval_command(model=tmp_path, task="qa", length="1k5")
    with pytest.raises(LengthTooShortError):
        eval_command(model=tmp_path, task="qa", length="16")
