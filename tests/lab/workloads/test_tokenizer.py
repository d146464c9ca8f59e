"""The synthetic language and its word-level tokenizer: fixed ids, exact round trips, offline save/load."""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kvstate.lab.workloads import language as lang
from kvstate.lab.workloads.tokenizer import build_tokenizer, count_tokens


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# Changing the vocabulary changes token ids and invalidates every trained reference checkpoint:
# update this pin only on purpose, together with the checkpoints.
VOCAB_DIGEST = "295267a8a9304eb0"


def _vocab_digest() -> str:
    return hashlib.sha256("\n".join(lang.vocabulary()).encode()).hexdigest()[:16]


def test_vocabulary_layout(tok):
    vocab = lang.vocabulary()
    assert 1300 <= len(vocab) <= 1700
    assert len(set(vocab)) == len(vocab)
    assert _vocab_digest() == VOCAB_DIGEST
    assert vocab[:4] == ("<pad>", "<bos>", "<eos>", "<unk>")
    assert vocab[4:14] == tuple("0123456789")
    assert all(w and not any(c.isspace() for c in w) for w in vocab)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(list(vocab)) == list(range(len(vocab)))


def test_vocabulary_is_the_same_in_a_fresh_interpreter_with_another_hash_seed():
    code = ("import hashlib; from kvstate.lab.workloads import language as l; "
            "print(hashlib.sha256('\\n'.join(l.vocabulary()).encode()).hexdigest()[:16])")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _vocab_digest()


def test_topics_own_their_words():
    seen: dict[str, str] = {}
    for topic, (nouns, adjectives, verbs) in lang.TOPICS.items():
        assert len(nouns) >= 15 and len(adjectives) >= 5 and len(verbs) >= 5, topic
        for w in nouns + adjectives + verbs:
            assert w not in seen, f"{w!r} is in topics {seen.get(w)} and {topic}"
            seen[w] = topic
    pseudo = set(lang.NAMES) | set(lang.CITIES) | set(lang.VARIABLES)
    assert len(pseudo) == len(lang.NAMES) + len(lang.CITIES) + len(lang.VARIABLES)
    assert not pseudo & set(seen)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_words=st.integers(0, 300))
def test_prose_has_exact_length_and_round_trips(tok, seed, n_words):
    sentences = lang.prose(np.random.default_rng(seed), n_words)
    text = lang.join(sentences)
    assert sum(map(len, sentences)) == n_words == count_tokens(tok, text)
    assert all(s[-1] == "." for s in sentences)
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_prose_is_deterministic_by_seed_and_avoids_names():
    a = lang.prose(np.random.default_rng(7), 2000)
    assert a == lang.prose(np.random.default_rng(7), 2000)
    assert a != lang.prose(np.random.default_rng(8), 2000)
    words = {w for s in a for w in s}
    used = words & set(lang.NAMES)
    assert used, "2000 words of prose should introduce some entity"
    again = {w for s in lang.prose(np.random.default_rng(7), 2000, avoid=used) for w in s}
    assert not again & used


def test_prose_changes_topic():
    sentences = lang.prose(np.random.default_rng(3), 1500)
    owner = {w: t for t, parts in lang.TOPICS.items() for part in parts for w in part}
    topics = {owner[w] for s in sentences for w in s if w in owner}
    assert len(topics) >= 4


def test_save_pretrained_then_auto_tokenizer_loads_offline(tok, tmp_path):
    text = lang.join(lang.prose(np.random.default_rng(0), 500)) + " what is the secret code of " + \
        lang.NAMES[0] + " ? answer : 4 0 7 ."
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = tok(text)["input_ids"]
    assert loaded(text)["input_ids"] == ids
    assert loaded.decode(ids, skip_special_tokens=True) == text
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token, loaded.unk_token) == \
        ("<pad>", "<bos>", "<eos>", "<unk>")
    assert len(loaded) == len(lang.vocabulary())


def test_unknown_words_map_to_unk_and_bare_encoding_has_no_bos(tok):
    assert tok("the zebra", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids("the"), 3]


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="n_words=-1"):
        lang.prose(np.random.default_rng(0), -1)
    with pytest.raises(ValueError, match="n=0"):
        lang.digits(np.random.default_rng(0), 0)
    with pytest.raises(ValueError, match="max_sentence"):
        lang.ProseConfig(min_sentence=10, max_sentence=5)
    with pytest.raises(ValueError, match="sum to"):
        lang.ProseConfig(p_entity_intro=0.5, p_entity_mention=0.5, p_number=0.5)
