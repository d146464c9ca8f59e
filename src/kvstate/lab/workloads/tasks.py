"""RULER-shaped synthetic tasks over the synthetic language, and the training stream.

The offline tasks of RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?") rebuilt on :mod:`kvstate.lab.workloads.language`, so the reference models
trained here can be evaluated on the same shapes: needle retrieval (``niah_single``, ``niah_multikey``,
``niah_multivalue``, ``niah_multiquery``), multi-hop tracing (``vt``), aggregation (``fwe``, ``cwe``),
question answering over entities (``qa``) and plain prose for perplexity (``text``).

A prompt is ``context + " " + question``; the question ends with the cue ``answer :`` and the model
greedily generates :attr:`Example.target`: the answers joined by `` , `` and closed by `` .``.

Length: ``generate`` fills filler so that ``n_tokens`` (context + question, no special tokens) satisfies
``length - LENGTH_TOLERANCE <= n_tokens <= length``. With :func:`~kvstate.lab.workloads.tokenizer.build_tokenizer`
a token is a word and the fit is exact (``n_tokens == length``); with another tokenizer the filler is
rescaled by the measured tokens per word (a few passes) and the closest fit not above ``length`` is kept.

Determinism: example ``i`` of ``(task, seed)`` depends on nothing else (not on ``n`` or other tasks);
evaluation (``generate``) and training (``training_batch``) draw from disjoint seed streams, so the
held-out examples are never trained on. :func:`min_length` gives the shortest length a task accepts.
Ignored from RULER: the essay haystack and the word / UUID key types of its ``niah`` variants (keys are
names, values digit codes); QA uses generated entity facts instead of SQuAD / HotpotQA.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from kvstate.lab.workloads import language as lang
from kvstate.lab.workloads.tokenizer import count_tokens

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "fwe", "cwe", "qa", "text")
METRICS = {"niah_single": "exact", "niah_multikey": "exact", "niah_multivalue": "all", "niah_multiquery": "all",
           "vt": "all", "fwe": "all", "cwe": "all", "qa": "f1", "text": "ppl"}
DEPTH_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "qa")
LENGTH_TOLERANCE = 8  # tokens; the fit is exact with the synthetic tokenizer
EVAL_STREAM, TRAIN_STREAM = 0, 1
CUE = ["answer", ":"]
_INTRO = {
    "niah": list(lang.split_words("some secret codes are hidden in the following text . remember them .")),
    "vt": list(lang.split_words("remember the chains of variables in the following text .")),
    "fwe": list(lang.split_words("read the coded text below and count each word .")),
    "cwe": list(lang.split_words("below is a list of words .")),
    "qa": list(lang.split_words("read the story about the people below .")),
}
# qa attribute -> (fact words between name and value, after value; question words before name, after name)
_QA = {
    "job": (["works", "as", "a"], [], ["what", "does"], ["work", "as"]),
    "city": (["lives", "in"], [], ["where", "does"], ["live"]),
    "pet": (["keeps", "a"], [], ["what", "does"], ["keep"]),
    "age": (["is"], ["years", "old"], ["how", "old", "is"], []),
    "food": (["likes", "to", "eat"], [], ["what", "does"], ["like", "to", "eat"]),
}
_LIST_POOL = tuple(w for group in lang.TOPICS.values() for part in group for w in part) + lang.NAMES
_FIT_STEPS = 12


@dataclass(frozen=True)
class TaskConfig:
    """Sizes of the task families (RULER defaults where they fit a small model)."""

    code_digits: int = 6  # digits of a niah secret code
    n_keys: int = 4  # needles in niah_multikey (one asked, the rest distractors)
    n_values: int = 4  # codes of the one key in niah_multivalue
    n_queries: int = 4  # keys asked at once in niah_multiquery
    vt_hops: int = 4  # assignments after the first in each vt chain
    vt_chains: int = 2  # chains in a vt document (one asked, the rest distractors)
    vt_digits: int = 5
    fwe_top: int = 3  # words asked in fwe
    fwe_alpha: float = 2.0  # Zipf exponent of fwe word counts
    cwe_common: int = 10  # common words asked in cwe
    cwe_freq_common: int = 30  # occurrences of a common word (fewer when the list is short)
    cwe_freq_uncommon: int = 3  # occurrences of an uncommon word (more when the pool runs out)
    qa_tokens_per_entity: int = 160  # one qa entity per this many tokens of length
    qa_max_entities: int = 12

    def __post_init__(self) -> None:
        bounds = {"code_digits": (1, 12), "n_keys": (2, 64), "n_values": (2, 64), "n_queries": (2, 64),
                  "vt_hops": (1, 20), "vt_chains": (1, 10), "vt_digits": (1, 12), "fwe_top": (1, 10),
                  "cwe_common": (1, 50), "cwe_freq_uncommon": (1, 100), "qa_tokens_per_entity": (16, 10**6),
                  "qa_max_entities": (2, len(lang.FOODS))}
        for name, (lo, hi) in bounds.items():
            value = getattr(self, name)
            if not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"TaskConfig.{name}={value!r} must be an int in [{lo}, {hi}]")
        if self.cwe_freq_common < self.cwe_freq_uncommon + 2:
            raise ValueError(f"TaskConfig.cwe_freq_common={self.cwe_freq_common} must exceed cwe_freq_uncommon "
                             f"({self.cwe_freq_uncommon}) by at least 2 so the common words are unambiguous")
        if (self.vt_hops + 1) * self.vt_chains > len(lang.VARIABLES):
            raise ValueError(f"TaskConfig: vt needs (vt_hops+1)*vt_chains <= {len(lang.VARIABLES)} variable names; "
                             "lower vt_hops or vt_chains")
        if not self.fwe_alpha > 1.0:
            raise ValueError(f"TaskConfig.fwe_alpha={self.fwe_alpha} must be > 1 (a Zipf exponent)")


@dataclass(frozen=True)
class Example:
    """One task instance; the model sees ``prompt`` and should generate ``target``."""

    task: str  # one of TASKS
    context: str  # the document: intro, filler and inserted facts, space-separated words
    question: str  # appended after the context; ends with the cue "answer :" ("" for text)
    answers: tuple[str, ...]  # gold answers (every one for metric "all"); () for text
    length: int  # requested tokens of context + question
    n_tokens: int  # actual tokens of context + question with the tokenizer, no special tokens
    depth: float | None  # where the asked needle / fact sits in the filler, in [0, 1]; None if no needle
    metric: str  # "exact" | "all" | "f1" | "ppl" (text: perplexity, no answer to score)

    @property
    def prompt(self) -> str:
        return f"{self.context} {self.question}" if self.question else self.context

    @property
    def target(self) -> str:
        """The completion a model is trained to generate: ``a1 , a2 .`` ('' for text)."""
        return " , ".join(self.answers) + " ." if self.answers else ""


# A built example before it is measured: (context words, question words, answers, depth).
_Draft = tuple[list[str], list[str], tuple[str, ...], float | None]


def _choose(rng: np.random.Generator, pool: Sequence[str], k: int) -> list[str]:
    return [pool[int(i)] for i in rng.choice(len(pool), size=k, replace=False)]


def _codes(rng: np.random.Generator, k: int, n_digits: int) -> list[str]:
    out: dict[str, None] = {}
    while len(out) < k:
        out[" ".join(lang.digits(rng, n_digits))] = None
    return list(out)


def _weave(rf: np.random.Generator, budget: int, inserts: list[tuple[float, list[str]]],
           avoid: Sequence[str]) -> list[str]:
    """``budget`` words of prose with each ``(depth, sentence)`` put at the sentence boundary nearest depth."""
    sentences = lang.prose(rf, budget, avoid)
    slots: list[list[str]] = [[] for _ in range(len(sentences) + 1)]
    for depth, sentence in inserts:
        slots[round(depth * len(sentences))] += sentence
    out: list[str] = []
    for slot, sentence in zip(slots, [*sentences, []], strict=True):
        out += slot + sentence
    return out


def _niah(task: str, rs: np.random.Generator, rf: np.random.Generator, budget: int, length: int,
          cfg: TaskConfig, depth: float | None) -> _Draft:
    n = {"niah_single": 1, "niah_multikey": cfg.n_keys, "niah_multivalue": cfg.n_values,
         "niah_multiquery": cfg.n_queries}[task]
    names = _choose(rs, lang.NAMES, 1 if task == "niah_multivalue" else n)
    keys = names * n if task == "niah_multivalue" else names
    codes = _codes(rs, n, cfg.code_digits)
    depth = float(rs.random()) if depth is None else depth
    depths = [depth, *(float(d) for d in rs.random(n - 1))]
    needles = [(d, ["the", "secret", "code", "of", k, "is", *c.split(), "."])
               for d, k, c in zip(depths, keys, codes, strict=True)]
    context = _INTRO["niah"] + _weave(rf, budget, needles, names)
    if task == "niah_multivalue":  # answers in reading order, as a reader would list them
        codes.sort(key=lambda c: _find(context, ["is", *c.split(), "."])[0])
        question, answers = ["what", "are", "all", "the", "secret", "codes", "of", names[0], "?"], codes
    elif task == "niah_multiquery":
        asked = [w for k in names for w in (",", k)][1:]
        question, answers = ["what", "are", "the", "secret", "codes", "of", *asked, "?"], codes
    else:
        question, answers = ["what", "is", "the", "secret", "code", "of", names[0], "?"], codes[:1]
    return context, question + CUE, tuple(answers), depth


def _vt(rs: np.random.Generator, rf: np.random.Generator, budget: int, length: int, cfg: TaskConfig,
        depth: float | None) -> _Draft:
    names = _choose(rs, lang.VARIABLES, (cfg.vt_hops + 1) * cfg.vt_chains)
    values = _codes(rs, cfg.vt_chains, cfg.vt_digits)
    chains = [names[c * (cfg.vt_hops + 1):(c + 1) * (cfg.vt_hops + 1)] for c in range(cfg.vt_chains)]
    inserts = []
    for chain, value in zip(chains, values, strict=True):
        rhs = [value.split(), *([v] for v in chain[:-1])]
        inserts += zip(sorted(float(d) for d in rs.random(len(chain))),
                       ([v, "=", *r, "."] for v, r in zip(chain, rhs, strict=True)), strict=True)
    context = _INTRO["vt"] + _weave(rf, budget, inserts, ())
    question = ["which", "variables", "have", "the", "value", *values[0].split(), "?", *CUE]
    return context, question, tuple(chains[0]), None


def _fwe(rs: np.random.Generator, rf: np.random.Generator, budget: int, length: int, cfg: TaskConfig,
         depth: float | None) -> _Draft:
    k = min(len(_LIST_POOL), budget)
    p = 1.0 / np.arange(1, k + 1) ** cfg.fwe_alpha
    counts = np.floor(budget * p / p.sum()).astype(np.int64)
    counts[k - (budget - int(counts.sum())):] += 1  # leftover words go to the rarest ranks
    if counts[cfg.fwe_top - 1] <= counts[cfg.fwe_top:].max(initial=0):
        raise ValueError(f"fwe: {budget} words cannot make the top {cfg.fwe_top} unambiguous; pass a longer length")
    ranked = _choose(rs, _LIST_POOL, len(_LIST_POOL))[:k]  # same ranking for every budget
    words = [w for w, c in zip(ranked, counts, strict=True) for _ in range(int(c))]
    words = [words[int(i)] for i in rf.permutation(len(words))]
    question = ["what", "are", "the", *lang.number_words(cfg.fwe_top), "most", "frequent", "words", "in", "the",
                "coded", "text", "?", *CUE]
    top = sorted(ranked[:cfg.fwe_top], key=lambda w: (-words.count(w), words.index(w)))  # as most_common
    return _INTRO["fwe"] + words + ["."], question, tuple(top), None


def _cwe(rs: np.random.Generator, rf: np.random.Generator, budget: int, length: int, cfg: TaskConfig,
         depth: float | None) -> _Draft:
    c = cfg.cwe_common
    f_common = min(cfg.cwe_freq_common, max(cfg.cwe_freq_uncommon + 2, 3 * budget // (10 * c)))
    while True:  # short lists get fewer common repeats; long lists repeat uncommon words more
        uncommon_slots = budget - c * f_common
        f_uncommon = max(cfg.cwe_freq_uncommon, -(-uncommon_slots // (len(_LIST_POOL) - c)))
        if f_common >= f_uncommon + 2:
            break
        f_common = f_uncommon + 2
    n_uncommon, extra = divmod(uncommon_slots, f_uncommon)
    if n_uncommon < max(c, extra):
        raise ValueError(f"cwe: {budget} words cannot hold {c} common words; pass a longer length")
    chosen = _choose(rs, _LIST_POOL, len(_LIST_POOL))[:c + n_uncommon]  # same order for every budget
    freq = [f_common] * c + [f_uncommon + (i < extra) for i in range(n_uncommon)]
    words = [w for w, n in zip(chosen, freq, strict=True) for _ in range(n)]
    words = [words[int(i)] for i in rf.permutation(len(words))]
    question = ["what", "are", "the", *lang.number_words(c), "most", "common", "words", "in", "the", "list", "?", *CUE]
    common = sorted(chosen[:c], key=words.index)  # in order of first appearance
    return _INTRO["cwe"] + words + ["."], question, tuple(common), None


def _qa(rs: np.random.Generator, rf: np.random.Generator, budget: int, length: int, cfg: TaskConfig,
        depth: float | None) -> _Draft:
    n = min(cfg.qa_max_entities, max(2, length // cfg.qa_tokens_per_entity))
    names = _choose(rs, lang.NAMES, n)
    values = {"job": _choose(rs, lang.JOBS, n), "city": _choose(rs, lang.CITIES, n),
              "pet": [f"{lang.COLORS[int(i) % 10]} {lang.ANIMALS[int(i) // 10]}" for i in rs.choice(100, n, replace=False)],
              "age": [" ".join(lang.number_words(int(a))) for a in rs.choice(np.arange(18, 90), n, replace=False)],
              "food": _choose(rs, lang.FOODS, n)}
    asked = list(_QA)[int(rs.integers(len(_QA)))]
    depth = float(rs.random()) if depth is None else depth
    inserts = []
    for i, name in enumerate(names):
        for attr, (pre, post, _, _) in _QA.items():
            d = depth if (i, attr) == (0, asked) else float(rs.random())
            inserts.append((d, [name, *pre, *values[attr][i].split(), *post, "."]))
    _, _, q_pre, q_post = _QA[asked]
    context = _INTRO["qa"] + _weave(rf, budget, inserts, names)
    return context, [*q_pre, names[0], *q_post, "?", *CUE], (values[asked][0],), depth


def _text(rs: np.random.Generator, rf: np.random.Generator, budget: int, length: int, cfg: TaskConfig,
          depth: float | None) -> _Draft:
    return [w for s in lang.prose(rf, budget) for w in s], [], (), None


_Builder = Callable[[np.random.Generator, np.random.Generator, int, int, TaskConfig, float | None], _Draft]
_BUILDERS: dict[str, tuple[_Builder, Callable[[TaskConfig], int]]] = {
    **{t: (lambda rs, rf, b, n, c, d, t=t: _niah(t, rs, rf, b, n, c, d), lambda c: 0) for t in TASKS[:4]},
    "vt": (_vt, lambda c: 0),
    "fwe": (_fwe, lambda c: 10 * c.fwe_top + 10),
    "cwe": (_cwe, lambda c: c.cwe_common * (2 * c.cwe_freq_uncommon + 2)),
    "qa": (_qa, lambda c: 0),
    "text": (_text, lambda c: 8),
}


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks are {', '.join(TASKS)}")


def _rngs(seed: int, stream: int, task: str, index: int) -> tuple[np.random.Generator, np.random.Generator]:
    """(structure, filler) generators of one example; the filler budget never shifts the structure."""
    key = [seed, stream, zlib.crc32(task.encode()), index]
    return np.random.default_rng([*key, 0]), np.random.default_rng([*key, 1])


def min_length(task: str, config: TaskConfig | None = None) -> int:
    """Fewest tokens (synthetic tokenizer) a ``task`` prompt can have: fixed parts plus the least filler."""
    _check_task(task)
    cfg = config or TaskConfig()
    build, least = _BUILDERS[task]
    context, question, _, _ = build(*_rngs(0, EVAL_STREAM, task, 0), least(cfg), 0, cfg, 0.5)
    return len(context) + len(question)


def _make(task: str, length: int, stream: int, seed: int, index: int, tokenizer: PreTrainedTokenizerBase,
          cfg: TaskConfig, depth: float | None) -> Example:
    build, least = _BUILDERS[task]
    lo = least(cfg)

    def draft(budget: int) -> tuple[_Draft, int]:
        d = build(*_rngs(seed, stream, task, index), budget, length, cfg, depth)
        return d, count_tokens(tokenizer, " ".join(d[0] + d[1]))

    best, n0 = draft(lo)
    if n0 > length:
        raise ValueError(f"length={length} is too short for task {task!r}: its fixed parts and least filler "
                         f"take {n0} tokens; pass length >= {n0}")
    # Bracketed secant search over the filler budget: (lo_b, best_n) fits, (hi_b, hi_n) overshoots.
    lo_b, best_n, hi_b, hi_n = lo, n0, None, None
    budget = lo + length - n0  # exact when a token is a word
    for _ in range(_FIT_STEPS):
        d, n = draft(budget)
        if n <= length and budget > lo_b:
            best, lo_b, best_n = d, budget, n
        elif n > length:
            hi_b, hi_n = budget, n
        if length - LENGTH_TOLERANCE <= best_n or (hi_b is not None and hi_b - lo_b <= 1):
            break
        if hi_b is None:  # extrapolate with the tokens per filler word measured so far
            per_word = (best_n - n0) / (lo_b - lo) if lo_b > lo else 1.0
            budget = lo_b + max(1, int((length - best_n) / max(per_word, 1e-3)))
        else:
            budget = lo_b + max(1, int((length - best_n) * (hi_b - lo_b) / max(hi_n - best_n, 1)))
            budget = min(budget, hi_b - 1)
    context, question, answers, used_depth = best
    return Example(task, " ".join(context), " ".join(question), answers, length, best_n, used_depth, METRICS[task])


def generate(task: str, length: int, n: int, seed: int, tokenizer: PreTrainedTokenizerBase,
             depths: Sequence[float] | None = None, config: TaskConfig | None = None) -> list[Example]:
    """``n`` held-out examples of ``task`` with ``length`` tokens of context + question.

    ``depths`` (needle tasks and qa only) are cycled over the examples; ``None`` draws a uniform depth
    per example. Deterministic in ``seed``.
    """
    _check_task(task)
    cfg = config or TaskConfig()
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"generate: length={length!r} must be a positive int (tokens of context + question)")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"generate: n={n!r} must be an int >= 0 (number of examples)")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"generate: seed={seed!r} must be an int >= 0")
    if tokenizer is None:
        raise ValueError("generate: tokenizer is None; pass kvstate.lab.workloads.tokenizer.build_tokenizer()")
    if depths is not None:
        if task not in DEPTH_TASKS:
            raise ValueError(f"generate: task {task!r} has no needle depth; pass depths=None "
                             f"(depths apply to {', '.join(DEPTH_TASKS)})")
        if len(depths) == 0 or not all(0.0 <= d <= 1.0 for d in depths):
            raise ValueError(f"generate: depths={list(depths)} must be a non-empty list of values in [0, 1]")
    return [_make(task, length, EVAL_STREAM, seed, i, tokenizer, cfg,
                  None if depths is None else float(depths[i % len(depths)])) for i in range(n)]


def _find(tokens: list[str], pattern: list[str]) -> list[int]:
    """Indices just past each occurrence of ``pattern`` in ``tokens``."""
    k = len(pattern)
    return [i + k for i, w in enumerate(tokens) if w == pattern[0] and tokens[i:i + k] == pattern]


def training_batch(tasks: Sequence[str], length: int, batch: int, seed: int, tokenizer: PreTrainedTokenizerBase,
                   *, answer_weight: float = 10.0,
                   config: TaskConfig | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A ``(batch, length)`` training batch mixing ``tasks``: ``<bos> prompt target <eos>``, right-padded.

    Returns ``input_ids`` (int64, padded with ``<pad>``) and ``loss_weights`` (float32, same shape):
    the weight of the loss for predicting token ``t`` from the tokens before it — 0 for ``<bos>`` and
    padding, 1 for prompt tokens, ``answer_weight`` for the target and its ``<eos>``. Each row draws its
    task uniformly from ``tasks``, so multi-needle documents appear from the first batch of training;
    ``text`` rows are ``<bos>`` + prose filling the row. Rows come from the training seed stream, never
    from the one :func:`generate` evaluates on.
    """
    for task in tasks:
        _check_task(task)
    if len(tasks) == 0:
        raise ValueError(f"training_batch: tasks is empty; pass some of {', '.join(TASKS)}")
    for name, value, lo in (("length", length, 2), ("batch", batch, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or value < lo:
            raise ValueError(f"training_batch: {name}={value!r} must be an int >= {lo}")
    if not answer_weight > 0:
        raise ValueError(f"training_batch: answer_weight={answer_weight} must be > 0")
    cfg = config or TaskConfig()
    pick = np.random.default_rng([seed, TRAIN_STREAM])
    input_ids = np.full((batch, length), tokenizer.pad_token_id, dtype=np.int64)
    weights = np.zeros((batch, length), dtype=np.float32)
    for row in range(batch):
        task = tasks[int(pick.integers(len(tasks)))]
        budget = length - 1 if task == "text" else length - 2
        while True:  # shrink the prompt until <bos> + prompt + target + <eos> fits the row
            try:
                ex = _make(task, budget, TRAIN_STREAM, seed, row, tokenizer, cfg, None)
            except ValueError as err:
                raise ValueError(f"training_batch: length={length} cannot hold task {task!r} with its answer "
                                 f"and special tokens ({err})") from None
            prompt = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
            target = tokenizer(ex.target, add_special_tokens=False)["input_ids"] if ex.answers else []
            target += [tokenizer.eos_token_id] if ex.answers else []
            overflow = 1 + len(prompt) + len(target) - length
            if overflow <= 0:
                break
            budget -= overflow
        seq = [tokenizer.bos_token_id, *prompt, *target]
        input_ids[row, :len(seq)] = seq
        weights[row, 1:1 + len(prompt)] = 1.0
        weights[row, 1 + len(prompt):len(seq)] = answer_weight
    return input_ids, weights
