"""Answer scoring: exact match and token F1 (HotpotQA / SQuAD normalisation), LoCoMo's F1 rules,
and an LLM judge behind an OpenAI-compatible endpoint.

    normalize_answer(s)   lower-case, drop punctuation, drop articles (a, an, the), collapse spaces
    exact_match(p, golds) 1.0 when the normalised prediction equals any normalised gold answer
    f1(p, golds)          token F1 on normalised tokens, best over gold answers
    locomo_f1(p, gold, category)
                          LoCoMo's official rules: Porter-stemmed token F1; category 1 (multi-hop)
                          splits the gold on commas and averages the best F1 of each sub-answer;
                          category 3 keeps the gold before ";"; category 5 (adversarial) is 1.0 when
                          the output says "no information available" or "not mentioned"
    bleu1(p, golds)       BLEU-1: clipped unigram precision times the brevity penalty, on the
                          normalised tokens, best over gold answers (no smoothing: no shared token is 0)
    relation_scores(pairs) accuracy and macro-F1 of (predicted, gold) relation labels
    LLMJudge(base_url, model)  asks an OpenAI-compatible chat endpoint for CORRECT / WRONG
                          (the prompt is pinned: ``JUDGE_PROMPT``, temperature 0)
    custom_reward(spec, ...) a user's ``package.module:function`` (load_reward_function imports and
                          checks it once), the environment's ``reward`` setting beside the built-in ones

Every scorer takes untrusted text (a policy's answer): non-strings score 0, never raise.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache

import Stemmer

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: object) -> str:
    """HotpotQA/SQuAD normalisation."""
    if not isinstance(s, str):
        s = "" if s is None else str(s)
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(gold: str | Sequence[str]) -> list[str]:
    if isinstance(gold, str):
        return [gold]
    return [str(g) for g in gold] or [""]


def exact_match(prediction: object, gold: str | Sequence[str]) -> float:
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in _golds(gold)))


def _token_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens and not gold_tokens:
        return 1.0
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: object, gold: str | Sequence[str]) -> float:
    """Token F1 (HotpotQA rules: yes/no/noanswer must match exactly)."""
    p = normalize_answer(prediction)
    best = 0.0
    for g in _golds(gold):
        n = normalize_answer(g)
        if (p in ("yes", "no", "noanswer") or n in ("yes", "no", "noanswer")) and p != n:
            continue
        best = max(best, _token_f1(p.split(), n.split()))
    return best


# ---------------------------------------------------------------------------------------- LoCoMo
_porter = Stemmer.Stemmer("porter")


@lru_cache(maxsize=100_000)
def _pstem(w: str) -> str:
    return _porter.stemWord(w)


def _locomo_tokens(s: object) -> list[str]:
    text = normalize_answer(str(s).replace(",", "") if s is not None else "")
    return [_pstem(w) for w in text.split()]


def _locomo_f1_single(prediction: object, gold: object) -> float:
    return _token_f1(_locomo_tokens(prediction), _locomo_tokens(gold))


_NO_INFO = ("no information available", "not mentioned")


def locomo_f1(prediction: object, gold: object, category: int | None = None) -> float:
    """LoCoMo's official QA F1 for one question."""
    pred = prediction if isinstance(prediction, str) else ("" if prediction is None else str(prediction))
    if category == 5:
        low = pred.lower()
        return float(any(s in low for s in _NO_INFO))
    gold_s = str(gold)
    if category == 3:
        gold_s = gold_s.split(";")[0].strip()
    if category == 1:
        preds = [p.strip() for p in pred.split(",")]
        parts = [g.strip() for g in gold_s.split(",")]
        return sum(max(_locomo_f1_single(p, g) for p in preds) for g in parts) / len(parts)
    return _locomo_f1_single(pred, gold_s)


# ---------------------------------------------------------------------------------------- BLEU-1
def _bleu1_single(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        return float(not pred_tokens and not gold_tokens)
    clipped = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    precision = clipped / len(pred_tokens)
    c, r = len(pred_tokens), len(gold_tokens)
    bp = 1.0 if c >= r else math.exp(1.0 - r / c)
    return bp * precision


def bleu1(prediction: object, gold: str | Sequence[str]) -> float:
    """Sentence BLEU-1 (weights (1, 0, 0, 0)): clipped unigram precision x brevity penalty
    ``exp(1 - r/c)`` when the prediction (c tokens) is shorter than the reference (r tokens); tokens
    are HotpotQA-normalised; the best over gold answers."""
    p = normalize_answer(prediction).split()
    return max(_bleu1_single(p, normalize_answer(g).split()) for g in _golds(gold))


# ---------------------------------------------------------------------------------------- relations
def relation_scores(pairs: Sequence[tuple[str, str]]) -> dict:
    """Accuracy and macro-F1 of (predicted, gold) relation labels; the macro average runs over the
    labels that occur as gold or as prediction. Empty input gives None values."""
    pairs = [(str(p), str(g)) for p, g in pairs]
    if not pairs:
        return {"pairs": 0, "accuracy": None, "macro_f1": None, "per_label": {}}
    labels = sorted({g for _, g in pairs} | {p for p, _ in pairs})
    per = {}
    for lab in labels:
        tp = sum(1 for p, g in pairs if p == lab and g == lab)
        fp = sum(1 for p, g in pairs if p == lab and g != lab)
        fn = sum(1 for p, g in pairs if p != lab and g == lab)
        prec = tp / (tp + fp) if tp + fp else 0.0
        rec = tp / (tp + fn) if tp + fn else 0.0
        per[lab] = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    acc = sum(1 for p, g in pairs if p == g) / len(pairs)
    return {"pairs": len(pairs), "accuracy": acc, "macro_f1": sum(per.values()) / len(per), "per_label": per}


# ---------------------------------------------------------------------------------------- judge
JUDGE_PROMPT = (
    "You grade answers. Question: {question}\nGold answer: {gold}\nModel answer: {answer}\n"
    "Is the model answer correct (same meaning as the gold answer; extra detail is fine, "
    "a different or missing fact is wrong)? Reply with exactly one word: CORRECT or WRONG."
)


class LLMJudge:
    """An LLM judge on an OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, OpenAI...).

    Scores are 1.0 for CORRECT, 0.0 otherwise; verdicts are cached per (question, gold, answer).
    A failing endpoint raises ConnectionError (the caller decides; the environment reports it in
    ``info`` and scores 0 rather than crashing).
    """

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self.timeout = timeout
        self._cache: dict[tuple[str, str, str], float] = {}

    def __call__(self, question: str, answer: object, gold: str | Sequence[str]) -> float:
        from atommem_rl.inference.endpoints import chat

        gold_s = " | ".join(_golds(gold))
        ans = answer if isinstance(answer, str) else ("" if answer is None else str(answer))
        key = (question, gold_s, ans)
        if key in self._cache:
            return self._cache[key]
        messages = [{"role": "user", "content": JUDGE_PROMPT.format(question=question, gold=gold_s, answer=ans[:2000])}]
        verdict = chat(self.base_url, self.model, messages, max_tokens=4, temperature=0.0, timeout=self.timeout,
                       api_key_env=self.api_key_env, what="LLM judge").text  # a ConnectionError naming the URL
        score = float("CORRECT" in verdict.upper() and "WRONG" not in verdict.upper())
        self._cache[key] = score
        return score


def score_answer(metric: str, prediction: object, gold: str | Sequence[str], *, category: int | None = None,
                 question: str = "", judge: LLMJudge | None = None) -> float:
    """One question's score under ``metric`` (em | f1 | locomo_f1 | bleu1 | judge)."""
    if metric == "bleu1":
        return bleu1(prediction, gold)
    if metric == "em":
        return exact_match(prediction, gold)
    if metric == "f1":
        return f1(prediction, gold)
    if metric == "locomo_f1":
        golds = _golds(gold)
        return max(locomo_f1(prediction, g, category) for g in golds)
    if metric == "judge":
        if judge is None:
            raise ValueError("metric 'judge' needs an LLMJudge (judge_url and judge_model)")
        return judge(question, prediction, gold)
    raise ValueError(f"unknown metric {metric!r}; expected em, f1, locomo_f1, bleu1 or judge")


# ------------------------------------------------------------------ a user's own reward (reward: package.module:function)
BUILTIN_REWARDS = ("em", "f1", "locomo_f1", "judge")
REWARD_ARGS = ("questions", "answers", "predictions", "episode")
_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def is_custom_reward(spec: object) -> bool:
    return isinstance(spec, str) and ":" in spec


@lru_cache(maxsize=None)
def load_reward_function(spec: str):
    """The callable ``package.module:function``, imported and checked to take the keyword arguments
    ``questions`` (texts), ``answers`` (gold answer lists), ``predictions`` (texts or None) and ``episode``
    (a dict: task_id, steps, ops, tool_errors, scratchpad, memory, ...). A ValueError names what is wrong,
    raised when the environment configuration is built, before any model loads."""
    import importlib
    import inspect

    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise ValueError(f"reward must be one of {', '.join(BUILTIN_REWARDS)} or package.module:function, got {spec!r}")
    module, _, name = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module: any import failure is their error, one line
        raise ValueError(f"reward {spec}: cannot import {module} ({type(exc).__name__}: {exc})") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec}: {module} has no function {name}")
    try:
        inspect.signature(fn).bind(**{a: None for a in REWARD_ARGS})
    except TypeError:
        raise ValueError(f"reward {spec}: the function must take the keyword arguments {', '.join(REWARD_ARGS)} "
                         "(or **kwargs)") from None
    except ValueError:  # a builtin without a signature: called as documented, checked on its first result
        pass
    return fn


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def custom_reward(spec: str, questions: list[str], answers: list[list[str]], predictions: list[str | None],
                  episode: dict) -> tuple[float, list[float] | None]:
    """(episode score, per-question scores or None) from the user's function: it returns one finite
    number for the episode, or one per question (their mean is the score). Anything else is a ValueError
    naming the function, never a NaN reward in training."""
    out = load_reward_function(spec)(questions=questions, answers=answers, predictions=predictions, episode=episode)
    if _finite(out):
        return float(out), None
    if isinstance(out, (list, tuple)) and len(out) == len(questions) and out and all(_finite(x) for x in out):
        return sum(out) / len(out), [float(x) for x in out]
    raise ValueError(f"reward {spec} returned {out!r:.80}; expected a finite number, or one per question "
                     f"({len(questions)})")
