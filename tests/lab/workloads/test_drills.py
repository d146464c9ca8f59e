"""Retrieval drills: every answer in a drill row is the code its question's needle holds (read back by
rule from the row's own tokens), the layout and weights match training_batch's, and rows are deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from kvstate.lab.workloads import build_tokenizer
from kvstate.lab.workloads.drills import COPY_OPEN, COPY_REPEAT, QUESTION, copy_batch, drill_batch, drill_keys
from kvstate.lab.workloads.tasks import _find


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _read_row(tok, ids, w):
    """(question name, answer words, code in the document for that name) for every answer span of a row."""
    words = [tok.convert_ids_to_tokens(int(i)) for i in ids]
    out, t = [], 0
    while t < len(words):
        if w[t] >= 10 and words[t] != "<eos>":
            end = words.index(".", t)
            name = words[t - 4]  # "... of <name> ? answer :" then the answer
            assert words[t - 3:t] == ["?", "answer", ":"]
            doc_end = _find(words, QUESTION)[0] - len(QUESTION)
            needle = _find(words[:doc_end], ["secret", "code", "of", name, "is"])
            assert len(needle) == 1, f"name {name} has {len(needle)} needles"
            code = words[needle[0]:words.index(".", needle[0])]
            out.append((name, words[t:end], code))
            t = end + 1
        else:
            t += 1
    return out


@pytest.mark.parametrize("length", [64, 128, 512, 1024])
def test_every_answer_is_its_needles_code(tok, length):
    ids, w = drill_batch(length, 6, 3, tok)
    assert ids.shape == w.shape == (6, length)
    for r in range(6):
        n_tokens = int((ids[r] != tok.pad_token_id).sum())
        assert ids[r, 0] == tok.bos_token_id and ids[r, n_tokens - 1] == tok.eos_token_id and w[r, 0] == 0
        assert (w[r, n_tokens:] == 0).all() and (w[r, 1:n_tokens] > 0).all()
        spans = _read_row(tok, ids[r], w[r])
        names = [s[0] for s in spans]
        assert 1 <= len(spans) <= drill_keys(length) and len(set(names)) == len(names)
        for name, answer, code in spans:
            assert answer == code and len(code) == 6, (name, answer, code)
        # every needle of the document is asked exactly once
        words = [tok.convert_ids_to_tokens(int(i)) for i in ids[r, :n_tokens]]
        doc = words[:_find(words, QUESTION)[0] - len(QUESTION)]
        assert sorted(doc[i] for i in _find(doc, ["secret", "code", "of"])) == sorted(names)
        # answer tokens: k codes of 6 digits + their "." + the final <eos>
        assert int((w[r] >= 10).sum()) == 7 * len(spans) + 1


def test_drills_deterministic_and_several_keys_at_length(tok):
    a, wa = drill_batch(512, 8, 11, tok)
    b, wb = drill_batch(512, 8, 11, tok)
    assert np.array_equal(a, b) and np.array_equal(wa, wb)
    assert not np.array_equal(a, drill_batch(512, 8, 12, tok)[0])
    ks = [len(_read_row(tok, a[r], wa[r])) for r in range(8)]
    assert max(ks) > 2  # multi-key rows, not only single needles
    assert [drill_keys(n) for n in (64, 128, 256, 1024)] == [1, 3, 7, 8]


@pytest.mark.parametrize("bad", [{"length": 20}, {"batch": 0}, {"seed": -1}, {"answer_weight": 0.0}])
def test_bad_arguments_name_the_argument(tok, bad):
    args = {"length": 128, "batch": 2, "seed": 0} | {k: v for k, v in bad.items() if k != "answer_weight"}
    kwargs = {"answer_weight": bad["answer_weight"]} if "answer_weight" in bad else {}
    with pytest.raises(ValueError, match=next(iter(bad))):
        drill_batch(args["length"], args["batch"], args["seed"], tok, **kwargs)


@pytest.mark.parametrize("length", [64, 256])
def test_copy_rows_repeat_each_list_exactly(tok, length):
    ids, w = copy_batch(length, 4, 2, tok)
    assert ids.shape == (4, length) and tok.unk_token_id not in ids
    for r in range(4):
        words = [tok.convert_ids_to_tokens(int(i)) for i in ids[r]]
        n = words.index("<pad>") if "<pad>" in words else length
        starts = _find(words[:n], COPY_OPEN)
        assert starts and words[0] == "<bos>" and w[r, 0] == 0 and (w[r, n:] == 0).all()
        for s in starts:
            items = words[s:words.index(".", s)]
            again = s + len(items) + 1 + len(COPY_REPEAT)
            assert words[again - len(COPY_REPEAT):again] == COPY_REPEAT
            assert words[again:again + len(items) + 1] == [*items, "."] and 4 <= len(items) <= 24
            assert (w[r, again:again + len(items) + 1] == 10).all() and (w[r, s:again] == 1).all()
        assert int((w[r] == 10).sum()) == sum(words[s:].index(".") + 1 for s in starts)
    assert np.array_equal(ids, copy_batch(length, 4, 2, tok)[0])
    with pytest.raises(ValueError, match="length"):
        copy_batch(20, 1, 0, tok)
