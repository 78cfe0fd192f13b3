"""The near-miss guard: rejects semantic (L2) candidates that an embedding scores high but that ask something else.

Sentence embeddings are close for "how do I turn on X" and "how do I turn off X", for "refund within 30 days" and
"refund within 60 days", and for word-swapped sentences ("flights from Paris to Rome" / "from Rome to Paris"). The
guard compares the new question with the cached one on what such pairs differ in, and vetoes the hit when:

- negation differs (an odd number of negations on one side only: "not", "never", "n't", "without"…),
- an antonym appears on one side and its opposite on the other (on/off, enable/disable, before/after…),
- they ask for something else (a question opening with when vs where, who, why, how; how many / how long…),
- the numbers differ (digits and number words, "1,000" = "1000"),
- the dates differ (months, weekdays, relative days),
- a named entity of one (a capitalised word that does not start a sentence, an acronym) does not occur in the other,
  or the same entities appear in another order.

A veto only turns a hit into a miss (the request is then generated), so the guard is deliberately strict.
:func:`is_time_sensitive` flags questions whose answer changes with time ("today", "latest", prices).

Example:
    >>> near_miss("How do I turn on dark mode?", "How do I turn off dark mode?")
    'antonym on/off'
    >>> near_miss("What is the capital of France?", "Which city is the capital of France?") is None
    True
"""

from __future__ import annotations

import re

__all__ = ["is_time_sensitive", "near_miss"]

_WORD = re.compile(r"[A-Za-z][A-Za-z'’]*|\d[\d,.]*\d|\d")
_SENTENCE_START = re.compile(r"(^|[.!?:;]\s+|\n)\s*[\"'(\[]*([A-Za-z][\w'’-]*)")
_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere", "without",
              "cannot", "cant", "dont", "doesnt", "didnt", "isnt", "arent", "wasnt", "werent", "wont", "shouldnt",
              "couldnt", "wouldnt", "havent", "hasnt", "hadnt", "mustnt", "neednt", "aint"}
_ANTONYMS = [("on", "off"), ("enable", "disable"), ("enabled", "disabled"), ("activate", "deactivate"),
             ("increase", "decrease"), ("add", "remove"), ("before", "after"), ("max", "min"),
             ("maximum", "minimum"), ("start", "stop"), ("open", "close"), ("buy", "sell"), ("include", "exclude"),
             ("up", "down"), ("true", "false"), ("yes", "no"), ("more", "less"), ("above", "below"),
             ("allow", "deny"), ("allow", "block"), ("lock", "unlock"), ("subscribe", "unsubscribe"),
             ("install", "uninstall"), ("upgrade", "downgrade"), ("import", "export"), ("upload", "download"),
             ("encrypt", "decrypt"), ("connect", "disconnect"), ("show", "hide"), ("first", "last"),
             ("highest", "lowest"), ("best", "worst"), ("largest", "smallest"), ("most", "least"),
             ("in", "out"), ("login", "logout"), ("positive", "negative"), ("inside", "outside"),
             ("input", "output"), ("win", "lose"), ("accept", "reject"), ("same", "different"),
             ("early", "late"), ("cheap", "expensive"), ("fast", "slow"), ("left", "right"), ("north", "south"),
             ("east", "west"), ("male", "female"), ("men", "women"), ("man", "woman"), ("boy", "girl"),
             ("old", "new"), ("old", "young"), ("hot", "cold"), ("long", "short"), ("big", "small"),
             ("always", "never"), ("all", "none"), ("can", "cannot"), ("should", "shouldnt"), ("with", "without"),
             ("import", "export"), ("send", "receive"), ("give", "take")]
_NUMBER_WORDS: dict[str, float] = {w: float(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split()) if w != "one"}  # "one" is mostly a pronoun
_NUMBER_WORDS.update({"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80,
                      "ninety": 90, "hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9,
                      "half": 0.5, "twice": 2, "double": 2, "triple": 3, "dozen": 12, "third": 3, "fourth": 4,
                      "fifth": 5})
# What a question asks for: "when was X born" and "where was X born" embed almost identically.
_ASKS = {"what": "what", "which": "what", "when": "when", "where": "where", "who": "who", "whom": "who",
         "whose": "who", "why": "why", "how": "how"}
_QUANTITY = re.compile(r"\bhow (many|much|long|old|far|big|often)\b", re.IGNORECASE)
# ("may", "march" and "fall" are left out: mostly verbs)
_DATES = {"january", "february", "april", "june", "july", "august", "september", "october", "november",
          "december", "jan", "feb", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "monday",
          "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday", "today", "tomorrow", "yesterday",
          "tonight", "weekend", "summer", "autumn", "winter", "christmas", "easter"}
# Capitalised words that are not names: pronouns, question words and common sentence openers that may also appear
# mid-sentence after a comma or in titles.
_NOT_ENTITIES = {"i", "i'm", "i've", "i'd", "i'll", "what", "which", "who", "whom", "whose", "when", "where", "why",
                 "how", "is", "are", "can", "do", "does", "the", "a", "an", "and", "or", "if", "in", "on", "to",
                 "of", "for", "my", "your", "it", "this", "that", "please", "hi", "hello", "thanks", "ok"} | _DATES
_TIME_SENSITIVE = re.compile(
    r"\b(today|tonight|tomorrow|yesterday|now|right now|currently|current|latest|newest|most recent|recent|"
    r"this (week|month|year|morning|evening)|at the moment|price|prices|pricing|stock|stocks|share price|"
    r"exchange rate|weather|forecast|news|headlines|score|scores|breaking|trending|as of|time is it|"
    r"what time|what day|what date|status)\b", re.IGNORECASE)


def _tokens(text: str) -> list[str]:
    return [t.replace("’", "'") for t in _WORD.findall(text)]


def _lower_words(tokens: list[str]) -> list[str]:
    return [t.lower().replace("'", "") for t in tokens]


def _negations(tokens: list[str], words: list[str]) -> int:
    count = sum(1 for t, w in zip(tokens, words, strict=True) if w in _NEGATIONS or t.lower().endswith("n't"))
    return count - (1 if words and words[0] == "no" else 0)  # a leading "No, ..." answers, it does not negate


def _asks(tokens: list[str]) -> set[str]:
    """The question word a question starts with ("what's" asks what); none for a statement. A relative "which" or
    "how" inside a sentence is not a question word."""
    head = tokens[0].lower().split("'")[0] if tokens else ""
    return {_ASKS[head]} if head in _ASKS else set()


def _numbers(tokens: list[str], words: list[str]) -> list[float]:
    out: list[float] = []
    for t, w in zip(tokens, words, strict=True):
        if t[0].isdigit():
            try:
                out.append(float(t.replace(",", "")))
            except ValueError:
                out.append(float(len(t)))  # "1.2.3": compared by its text below
        elif w in _NUMBER_WORDS:
            out.append(float(_NUMBER_WORDS[w]))
    return sorted(out)


def _entities(text: str, tokens: list[str]) -> list[str]:
    starts = {m.start(2) for m in _SENTENCE_START.finditer(text)}
    out: list[str] = []
    pos = 0
    for t in tokens:
        i = text.find(t, pos)
        pos = i + len(t) if i >= 0 else pos
        if not t[0].isalpha():
            continue
        acronym = len(t) >= 2 and t.isupper()
        capital = t[0].isupper() and i not in starts
        if (acronym or capital) and t.lower() not in _NOT_ENTITIES:
            out.append(t.lower())
    return out


def near_miss(query: str, cached: str) -> str | None:
    """Why ``cached`` must not answer ``query`` (a short reason), or None when the guard has no objection."""
    tq, tc = _tokens(query), _tokens(cached)
    wq, wc = _lower_words(tq), _lower_words(tc)
    if _negations(tq, wq) % 2 != _negations(tc, wc) % 2:
        return "negation"
    sq, sc = set(wq), set(wc)
    for a, b in _ANTONYMS:
        if (a in sq and b in sc and b not in sq and a not in sc) or (b in sq and a in sc and a not in sq and
                                                                      b not in sc):
            return f"antonym {a}/{b}"
    asks_q = _asks(tq) | {m.lower() for m in _QUANTITY.findall(query)}
    asks_c = _asks(tc) | {m.lower() for m in _QUANTITY.findall(cached)}
    if asks_q and asks_c and asks_q != asks_c:
        return "question word"
    if _numbers(tq, wq) != _numbers(tc, wc):
        return "numbers"
    digits_q = [t for t in tq if t[0].isdigit()]
    digits_c = [t for t in tc if t[0].isdigit()]
    if sorted(d.replace(",", "") for d in digits_q) != sorted(d.replace(",", "") for d in digits_c):
        return "numbers"
    if {w for w in wq if w in _DATES} != {w for w in wc if w in _DATES}:
        return "dates"
    eq, ec = _entities(query, tq), _entities(cached, tc)
    if (set(eq) - sc) or (set(ec) - sq):
        return "entities"  # a name of one side does not occur in the other at all
    # the same names in another order: "from Paris to Rome" vs "from Rome to Paris"
    order_q = [e for e in dict.fromkeys(eq) if e in set(ec)]
    order_c = [e for e in dict.fromkeys(ec) if e in set(eq)]
    if len(order_q) > 1 and order_q != order_c:
        return "entity order"
    return None


def is_time_sensitive(text: str) -> bool:
    """True when the answer likely depends on when it is asked ("today", "latest", prices, weather, news)."""
    return bool(_TIME_SENSITIVE.search(text))
