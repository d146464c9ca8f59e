"""RULER-shaped task generators: determinism, length fit, the oracle reader, errors, the training stream."""

import dataclasses

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvstate.lab.scoring import score
from kvstate.lab.workloads import language as lang
from kvstate.lab.workloads.oracle import oracle_answer
from kvstate.lab.workloads.tasks import (
    LENGTH_TOLERANCE,
    METRICS,
    TASKS,
    TaskConfig,
    generate,
    min_length,
    training_batch,
)
from kvstate.lab.workloads.tokenizer import build_tokenizer, count_tokens


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    """A subword tokenizer (BPE trained here on the language) to check the fit for non-word tokenizers."""
    corpus = [lang.join(lang.prose(np.random.default_rng(i), 300)) for i in range(20)]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=list(lang.SPECIAL_TOKENS)))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


@pytest.mark.parametrize("length", [256, 1024, 4096])
@pytest.mark.parametrize("task", TASKS)
def test_oracle_reader_scores_one_and_length_is_exact(tok, task, length):
    for ex in generate(task, length, 2, seed=11, tokenizer=tok):
        assert ex.task == task and ex.metric == METRICS[task] and ex.length == length
        assert ex.n_tokens == length == count_tokens(tok, ex.prompt)  # exact with the word-level tokenizer
        assert tok.unk_token_id not in tok(ex.prompt + " " + ex.target)["input_ids"]
        if task == "text":
            assert ex.answers == () and ex.question == "" and ex.target == "" and oracle_answer(ex) == ""
            continue
        assert ex.question.endswith("? answer :") and ex.target.endswith(" .")
        assert oracle_answer(ex) == ex.target
        assert score(ex, oracle_answer(ex) + " the river flowed .") == 1.0
        assert score(ex, "1 .") < 1.0


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_examples_other_seed_different(tok, task):
    a = generate(task, 512, 3, seed=5, tokenizer=tok)
    assert a == generate(task, 512, 3, seed=5, tokenizer=tok)
    assert a[:2] == generate(task, 512, 2, seed=5, tokenizer=tok)  # example i does not depend on n
    b = generate(task, 512, 3, seed=6, tokenizer=tok)
    assert all(x.context != y.context for x, y in zip(a, b, strict=True))
    assert len({x.context for x in a}) == 3


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "vt", "fwe", "cwe", "qa", "text"])
def test_subword_tokenizer_fits_within_tolerance(bpe, task):
    for ex in generate(task, 768, 2, seed=1, tokenizer=bpe):
        assert 768 - LENGTH_TOLERANCE <= ex.n_tokens <= 768
        assert ex.n_tokens == count_tokens(bpe, ex.prompt)


def test_needle_depth_places_the_needle(tok):
    intro = len(lang.split_words("some secret codes are hidden in the following text . remember them ."))
    first, last = generate("niah_single", 600, 2, seed=3, tokenizer=tok, depths=[0.0, 1.0])
    assert (first.depth, last.depth) == (0.0, 1.0)
    assert first.context.split()[intro:intro + 3] == ["the", "secret", "code"]
    assert last.context.split()[-(7 + TaskConfig().code_digits):][:3] == ["the", "secret", "code"]
    mid = generate("niah_single", 2000, 1, seed=3, tokenizer=tok, depths=[0.5])[0]
    at = mid.context.index("the secret code") / len(mid.context)
    assert 0.4 < at < 0.6


def test_task_shapes(tok):
    cfg = TaskConfig()
    multikey = generate("niah_multikey", 1024, 1, 0, tok)[0]
    assert multikey.context.count("secret code of") == cfg.n_keys and len(multikey.answers) == 1
    multivalue = generate("niah_multivalue", 1024, 1, 0, tok)[0]
    assert len(set(multivalue.answers)) == cfg.n_values and multivalue.metric == "all"
    multiquery = generate("niah_multiquery", 1024, 1, 0, tok)[0]
    assert len(multiquery.answers) == cfg.n_queries and multiquery.question.count(",") == cfg.n_queries - 1
    vt = generate("vt", 1024, 1, 0, tok)[0]
    assert len(vt.answers) == cfg.vt_hops + 1 and vt.context.count(" = ") == (cfg.vt_hops + 1) * cfg.vt_chains
    assert len(generate("fwe", 1024, 1, 0, tok)[0].answers) == cfg.fwe_top
    assert len(generate("cwe", 1024, 1, 0, tok)[0].answers) == cfg.cwe_common
    qa = generate("qa", 2048, 1, 0, tok)[0]
    assert qa.metric == "f1" and 1 <= len(qa.answers[0].split()) <= 2


def test_long_cwe_repeats_uncommon_words_when_the_pool_runs_out(tok):
    ex = generate("cwe", 40_000, 1, 0, tok)[0]
    assert ex.n_tokens == 40_000 and oracle_answer(ex) == ex.target


def test_min_length_is_exact(tok):
    for task in TASKS:
        m = min_length(task)
        assert generate(task, m, 1, 0, tok)[0].n_tokens == m
        with pytest.raises(ValueError, match=f"pass length >= {m}"):
            generate(task, m - 1, 1, 0, tok)


def test_bad_inputs_raise_clear_errors(tok):
    with pytest.raises(ValueError, match=r"unknown task 'niah'.*niah_single, niah_multikey"):
        generate("niah", 256, 1, 0, tok)
    with pytest.raises(ValueError, match="too short for task 'cwe'"):
        generate("cwe", 50, 1, 0, tok)
    with pytest.raises(ValueError, match="no needle depth"):
        generate("vt", 256, 1, 0, tok, depths=[0.5])
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        generate("niah_single", 256, 1, 0, tok, depths=[1.5])
    with pytest.raises(ValueError, match="seed=-1"):
        generate("niah_single", 256, 1, -1, tok)
    with pytest.raises(ValueError, match="length=0"):
        generate("niah_single", 0, 1, 0, tok)
    with pytest.raises(ValueError, match=r"TaskConfig.code_digits=0 must be an int in \[1, 12\]"):
        TaskConfig(code_digits=0)
    with pytest.raises(ValueError, match="cwe_freq_common"):
        TaskConfig(cwe_freq_common=3, cwe_freq_uncommon=3)
    with pytest.raises(ValueError, match="unknown task"):
        oracle_answer(dataclasses.replace(generate("text", 64, 1, 0, tok)[0], task="nope"))


def test_training_batch_marks_answers(tok):
    ids, w = training_batch(TASKS, 512, 16, seed=3, tokenizer=tok)
    assert ids.shape == w.shape == (16, 512) and ids.dtype == np.int64 and w.dtype == np.float32
    assert (ids[:, 0] == tok.bos_token_id).all() and (w[:, 0] == 0).all()
    assert ((ids == tok.pad_token_id) == (w == 0))[:, 1:].all()
    assert tok.unk_token_id not in ids
    multi_needle = 0
    for row_ids, row_w in zip(ids, w, strict=True):
        text = tok.decode(row_ids[row_w == 1], skip_special_tokens=True)
        multi_needle += text.count("secret code of") > 1
        answer = row_ids[row_w == 10]
        if len(answer):  # a question row: the marked tokens are the target and its <eos>
            assert answer[-1] == tok.eos_token_id and tok.decode(answer[:-1]).endswith(" .")
            assert (np.flatnonzero(row_w == 10) > np.flatnonzero(row_w == 1).max()).all()
        else:  # a text row fills the whole sequence
            assert (row_w[1:] == 1).all()
    assert multi_needle > 0
    again = training_batch(TASKS, 512, 16, seed=3, tokenizer=tok)
    assert (again[0] == ids).all() and (again[1] == w).all()
    assert not (training_batch(TASKS, 512, 16, seed=4, tokenizer=tok)[0] == ids).all()


def test_training_rows_are_not_evaluation_examples(tok):
    # Names and codes do not depend on the length, so a shared seed stream would repeat them.
    ids, w = training_batch(["niah_single"], 512, 8, seed=0, tokenizer=tok)
    rows = " | ".join(tok.decode(r[wr > 0], skip_special_tokens=True) for r, wr in zip(ids, w, strict=True))
    held_out = generate("niah_single", 256, 8, seed=0, tokenizer=tok)
    assert not any(ex.answers[0] in rows for ex in held_out)


def test_training_batch_bad_inputs(tok):
    with pytest.raises(ValueError, match="unknown task"):
        training_batch(["bogus"], 256, 1, 0, tok)
    with pytest.raises(ValueError, match="tasks is empty"):
        training_batch([], 256, 1, 0, tok)
    with pytest.raises(ValueError, match="cannot hold task 'cwe'"):
        training_batch(["cwe"], 100, 1, 0, tok)
    with pytest.raises(ValueError, match="batch=0"):
        training_batch(["qa"], 256, 0, 0, tok)
