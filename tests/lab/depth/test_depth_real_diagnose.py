"""The real model's per-layer K/V ablation: one shared layer per pattern, the answer span of the model's own reply,
the teacher-forced score against a written-out argmax, and dev seeds only."""

from __future__ import annotations

import torch

from kvstate.depth.patterns import LayerSpec
from kvstate.lab.depth import real_diagnose as rd
from kvstate.models.tiny import tiny_model
from tests.lab.models.test_real_model import MODEL, needs_model


def test_each_ablation_shares_exactly_one_layer_with_the_one_below():
    layers = [LayerSpec("full_attention", 3, 64)] * 5
    got = rd.ablations(layers)
    assert list(got) == ["share1", "share2", "share3", "share4"]
    assert got["share3"].sources == (0, 1, 2, 2, 4)


@torch.inference_mode()
def test_teacher_forcing_scores_the_answer_span_by_argmax():
    model = tiny_model("llama", seed=1, num_hidden_layers=2)
    ids = torch.randint(3, 100, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    forced = list(ids)
    for t in (12, 13, 14):  # tokens 12..14 become what the model predicts, one at a time (greedy)
        forced[t] = int(model(torch.tensor([forced[:t]])).logits[0, -1].argmax())
    assert rd.teacher_forced(model, forced, 12, 15)[0] == 1.0
    forced[13] = (forced[13] + 1) % 100  # one wrong answer token
    exact, nll = rd.teacher_forced(model, forced, 12, 15)
    assert exact == 0.0 and nll > 0


@needs_model
def test_the_answer_span_is_the_answers_tokens_and_a_test_seed_is_refused(capsys):
    from kvstate.lab.workloads import realtext as rt
    from kvstate.models.loading import load_tokenizer

    tok = load_tokenizer(MODEL)
    x = rt.make_item(tok, "niah_multikey", 512, 3, 0)
    ids, start, end = rd.answer_span(tok, list(x.prompt_ids), x.answers)
    assert tok.decode(ids[start:end]) == x.answers[0] and ids[: len(x.prompt_ids)] == list(x.prompt_ids)
    assert rd.main(["--seed", "1070", "--n", "1"]) == 2
    assert "dev seeds" in capsys.readouterr().err


