"""Lexical processing shared by keyword extraction, the BM25 index and the memory graph.

One tokenizer serves all three so that a keyword stored on an atom is exactly a term the BM25 index
and the graph's entity edges see. Stemming uses PyStemmer (Snowball English, C) rather than a
hand-written suffix stripper.
"""

from __future__ import annotations

import re
from functools import lru_cache

import Stemmer

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")

# A standard English stop list (function words, pronouns, auxiliaries, chat fillers). Kept here
# rather than pulled from nltk, whose list needs a corpus download that fails offline.
STOPWORDS = frozenset(
    """
    a about above after again against all am an and any are aren't as at be because been before being
    below between both but by can can't cannot could couldn't did didn't do does doesn't doing don't down
    during each few for from further had hadn't has hasn't have haven't having he he'd he'll he's her here
    here's hers herself him himself his how how's i i'd i'll i'm i've if in into is isn't it it's its
    itself let's me more most mustn't my myself no nor not of off on once only or other ought our ours
    ourselves out over own same shan't she she'd she'll she's should shouldn't so some such than that
    that's the their theirs them themselves then there there's these they they'd they'll they're they've
    this those through to too under until up very was wasn't we we'd we'll we're we've were weren't what
    what's when when's where where's which while who who's whom why why's will with won't would wouldn't
    you you'd you'll you're you've your yours yourself yourselves also just really yeah yes oh wow hey hi
    hello thanks thank okay ok sure like get got go going gonna know think thing things lot lots much
    well still even way im ive dont didnt doesnt thats youre
    """.split()
)

_stemmer = Stemmer.Stemmer("english")


def words(text: str) -> list[str]:
    """Lower-cased word tokens, apostrophes kept inside words."""
    return _WORD.findall(text.lower())


@lru_cache(maxsize=200_000)
def _stem(word: str) -> str:
    return _stemmer.stemWord(word)


def terms(text: str) -> list[str]:
    """Index terms: words minus stop words, Snowball-stemmed, possessive 's dropped. Order kept."""
    out = []
    for w in words(text):
        if w.endswith("'s"):
            w = w[:-2]
        if w in STOPWORDS or len(w) < 2:
            continue
        out.append(_stem(w))
    return out


def keywords(text: str, limit: int = 24) -> tuple[str, ...]:
    """Distinct index terms of a text, in first-seen order, at most ``limit``."""
    seen: dict[str, None] = {}
    for t in terms(text):
        seen.setdefault(t, None)
        if len(seen) >= limit:
            break
    return tuple(seen)
