"""The near-miss guard: rejects semantic (L2) candidates that an embedding scores high but that ask something else.

Sentence embeddings are close for "how do I turn on X" and "how do I turn off X", for "refund within 30 days" and
"refund within 60 days", and for word-swapped sentences ("flights from Paris to Rome" / "from Rome to Paris"). The
guard compares the new question with the cached one on what such pairs differ in, and vetoes the hit when:

- negation differs (an odd number of negations on one side only: "not", "never", "n't", "without"…) and the rest
  says nearly the same words (at most 3 content words differ): "Is my data encrypted?" / "Is my data not
  encrypted?". A sentence said in other words that happens to negate ("in the absence of metadata" / "doesn't
  have metadata") is not a flip,
- an antonym appears on one side and its opposite on the other (on/off, enable/disable, before/after…),
- they ask for something else (a question opening with when vs where, who, why, how; how many / how long…),
- the numbers differ, by value: digits and number words ("1,000" = "1000", "thirty one" = 31, "one hundred" = 100,
  "thousands" = "several thousand"); list markers ("1)", "2)") and number words inside compounds ("zero-copy",
  "two-step") are not quantities,
- the dates differ (months, weekdays, relative days),
- a named entity of one (a capitalised word that does not start a sentence, an acronym) does not occur in the other;
  an acronym matches its expansion ("RAM" / "Random Access Memory", "JS" / "JavaScript"), a name matches its
  possessive, plural and run-together forms ("Hugging Face's" / "Huggingface"),
- two names trade places: each stands where the other stood, after the same word or the same content word ("from
  Paris to Rome" / "from Rome to Paris", "the Bears beat the Giants" / "the Giants beat the Bears"). A list in another
  order or a sentence turned around ("TensorFlow and JAX work with Datasets" / "Datasets works with TensorFlow and
  JAX") is not a swap.

A veto only turns a hit into a miss (the request is then generated), so the guard is deliberately strict.
:func:`is_time_sensitive` flags questions whose answer changes with time ("today", "latest", prices).

Example:
    >>> near_miss("How do I turn on dark mode?", "How do I turn off dark mode?")
    'antonym on/off'
    >>> near_miss("What is the capital of France?", "Which city is the capital of France?") is None
    True
"""

from __future__ import annotations

import functools
import re

__all__ = ["is_time_sensitive", "near_miss"]

_WORD = re.compile(r"[A-Za-z][A-Za-z'’]*|\d[\d,.]*\d|\d")
# "1) downloads ... 2) generates" or a numbered line ("1. Open Settings"): list markers, not quantities
_LIST_MARKER = re.compile(r"(?:^|[\s(\[])(\d{1,2})\)(?=\s)|^\s*(\d{1,2})\.\s", re.MULTILINE)
_CAMEL = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z']+|\d+")
_COMPOUND = re.compile(r"\b([A-Za-z]+)-([A-Za-z]+)\b")
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
_COUNTING: dict[str, float] = {w: float(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
_COUNTING.update({"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90})
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
_SCALES.update({f"{w}s": v for w, v in _SCALES.items()})  # "thousands of files" = "several thousand files"
_COUNTING.update({w: float(v) for w, v in _SCALES.items()})
_NUMBER_WORDS: dict[str, float] = {"half": 0.5, "twice": 2, "double": 2, "triple": 3, "dozen": 12, "third": 3,
                                   "fourth": 4, "fifth": 5, "pair": 2}
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
_CONJUNCTIONS = {"and", "or", "nor", "as", "well", "also", "plus"}
_STOPWORDS = {"a", "an", "the", "and", "or", "but", "if", "of", "to", "in", "on", "at", "by", "for", "with", "from",
              "as", "into", "about", "than", "then", "so", "that", "this", "these", "those", "it", "its", "is", "are",
              "was", "were", "be", "been", "being", "am", "do", "does", "did", "done", "have", "has", "had", "can",
              "could", "will", "would", "shall", "should", "may", "might", "must", "i", "me", "my", "we", "our",
              "you", "your", "he", "she", "his", "her", "they", "them", "their", "what", "which", "who", "whom",
              "whose", "when", "where", "why", "how", "there", "here", "any", "some", "such", "also", "just", "very",
              "one", "get", "way", "s", "t", "im", "ive", "id", "ill", "youre", "whats", "hows", "thats"}
# Negation on one side only vetoes when the rest differs by at most this many content words.
_NEGATION_SCOPE = 3
_TIME_SENSITIVE = re.compile(
    r"\b(today|tonight|tomorrow|yesterday|now|right now|currently|current|latest|newest|most recent|recent|"
    r"this (week|month|year|morning|evening)|at the moment|price|prices|pricing|stock|stocks|share price|"
    r"exchange rate|weather|forecast|news|headlines|score|scores|breaking|trending|as of|time is it|"
    r"what time|what day|what date|status)\b", re.IGNORECASE)


def _tokens(text: str) -> list[str]:
    return [t.replace("’", "'") for t in _WORD.findall(text)]


def _lower_words(tokens: list[str]) -> list[str]:
    return [t.lower().removesuffix("'s").replace("'", "") for t in tokens]


_ANSWER_NO = re.compile(r"\s*no\s*[,.!;:]", re.IGNORECASE)


def _negations(text: str, tokens: list[str], words: list[str]) -> int:
    count = sum(1 for t, w in zip(tokens, words, strict=True) if w in _NEGATIONS or t.lower().endswith("n't"))
    # "No, it is not." answers before it negates; "No refund is given" negates
    return count - (1 if _ANSWER_NO.match(text) else 0)


def _asks(tokens: list[str]) -> set[str]:
    """The question word a question starts with ("what's" asks what); none for a statement. A relative "which" or
    "how" inside a sentence is not a question word."""
    head = tokens[0].lower().split("'")[0] if tokens else ""
    return {_ASKS[head]} if head in _ASKS else set()


def _numbers(text: str, tokens: list[str], words: list[str]) -> tuple[list[float], list[str]]:
    """The numbers of a text, sorted ("1,000" = "1000" = "thousand"), and those float() cannot read ("1.2.3", by
    text). List markers ("1)", "(2)") are not numbers."""
    markers = {m.group(1) or m.group(2) for m in _LIST_MARKER.finditer(text)}
    compounds: set[str] = set()
    for m in _COMPOUND.finditer(text):
        left, right = m.group(1).lower(), m.group(2).lower()
        if not (left in _COUNTING and right in _COUNTING):  # "twenty-one" is a number
            compounds.update((left, right))
    values: list[float] = []
    texts: list[str] = []
    run: list[str] = []  # consecutive number words: "thirty one" = 31, "one hundred" = 100
    for t, w in [*zip(tokens, words, strict=True), ("", "")]:
        if w in compounds:
            w = ""  # "zero-copy", "two-step", "one-time": an adjective, not a quantity
        if w in _COUNTING or (w == "and" and run):
            run.append(w)
            continue
        if run and run != ["one"]:  # a lone "one" is mostly a pronoun
            values.append(_count(run))
        run = []
        if t and t[0].isdigit():
            if t in markers:
                continue
            try:
                values.append(float(t.replace(",", "")))
            except ValueError:
                texts.append(t)
        elif w in _NUMBER_WORDS:
            values.append(float(_NUMBER_WORDS[w]))
    return sorted(values), sorted(texts)


def _count(run: list[str]) -> float:
    total = current = 0.0
    for w in run:
        if w in _SCALES:
            if _SCALES[w] == 100:
                current = max(current, 1.0) * 100
            else:
                total += max(current, 1.0) * _SCALES[w]
                current = 0.0
        elif w != "and":
            current += _COUNTING[w]
    return total + current


def _entities(text: str, tokens: list[str]) -> list[tuple[int, str]]:
    """(token index, name) of each capitalised word that does not start a sentence and of each acronym; the name is
    lower case without a possessive ("Face's" -> "face")."""
    starts = {m.start(2) for m in _SENTENCE_START.finditer(text)}
    out: list[tuple[int, str]] = []
    pos = 0
    for k, t in enumerate(tokens):
        i = text.find(t, pos)
        pos = i + len(t) if i >= 0 else pos
        if not t[0].isalpha():
            continue
        acronym = len(t) >= 2 and t.isupper()
        capital = t[0].isupper() and i not in starts
        name = t.lower().strip("'").removesuffix("'s")
        if (acronym or capital) and name not in _NOT_ENTITIES:
            out.append((k, name))
    return out


def _found(k: int, name: str, own: _Side, other: _Side) -> bool:
    """Whether the name at token ``k`` of one side occurs in the other: as a word (singular or plural), run together
    with a neighbour on either side ("Hugging Face" = "Huggingface"), or as an acronym of consecutive words there
    ("RAM" = "Random Access Memory", "JS" = "JavaScript"; the reverse is :meth:`_Side.expand`'s)."""
    if name in other.words or _stem(name) in other.stems or name in other.joined:
        return True
    w = own.lower
    if (k and w[k - 1] + w[k] in other.words) or (k + 1 < len(w) and w[k] + w[k + 1] in other.words):
        return True
    token = own.tokens[k]
    return len(token) >= 2 and token.isupper() and token.isalpha() and name in other.initials


class _Side:
    """One text, tokenised once for every rule."""

    def __init__(self, text: str) -> None:
        text = text.replace("’", "'")
        self.text = text
        self.tokens = _tokens(text)
        self.lower = _lower_words(self.tokens)
        self.words = set(self.lower)
        self.stems = {_stem(w) for w in self.lower}
        # two or three words run together: "Hugging Face" as written "Huggingface"
        self.joined = {"".join(self.lower[i:i + n]) for n in (2, 3) for i in range(len(self.lower) - n + 1)}
        self.entities = _entities(text, self.tokens)
        self.content = {_stem(w) for w in self.lower if w not in _STOPWORDS and w not in _NEGATIONS}
        self.negated = _negations(text, self.tokens, self.lower) % 2 == 1
        self.asks = _asks(self.tokens) | {m.lower() for m in _QUANTITY.findall(text)}
        self.numbers = _numbers(text, self.tokens, self.lower)
        self.dates = {w for w in self.lower if w in _DATES}
        # first letters of the words, camel-case parts counted as words ("JavaScript" -> "js"): an acronym of one
        # side is found in, or spelt out by, the other's
        self._firsts = [(k, p[0].lower()) for k, t in enumerate(self.tokens) if t[0].isalpha()
                        for p in _CAMEL.findall(t)]
        self.initials = "".join(c for _, c in self._firsts)

    def expanded(self, other: _Side) -> set[str]:
        """The words of this side that spell out an acronym of the other ("Random Access Memory" for RAM)."""
        out: set[str] = set()
        for _, name in other.entities:
            if 2 <= len(name) <= 6 and name.isalpha():
                at = self.initials.find(name)
                if at >= 0:
                    out.update(self.lower[k] for k, _ in self._firsts[at:at + len(name)])
        return out


# A side is immutable once built, so sides are shared between checks: a lookup compares its question with up to 4
# candidates, and popular cached questions are compared again and again (~0.1 ms saved per side).
_side = functools.lru_cache(maxsize=1024)(_Side)


def _stem(word: str) -> str:
    """A crude English stem, enough to match "tables"/"table", "loading"/"loaded"/"load"."""
    for suffix in ("ing", "ies", "ed", "es", "s", "ly"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            if suffix == "es" and not word.endswith(("ses", "xes", "zes", "ches", "shes")):
                continue  # "faces" -> "face" (by "s"), "boxes" -> "box"
            return word[:-len(suffix)] + ("y" if suffix == "ies" else "")
    return word


def _roles(side: _Side) -> dict[str, tuple[str, str]]:
    """Each name's place in the sentence: the word just before it (before its whole run of capitalised words) and
    the nearest content word before it ("from" and "flights" in "flights from Paris")."""
    entity_at = {k: name for k, name in side.entities}
    roles: dict[str, tuple[str, str]] = {}
    for k, name in side.entities:
        start = k
        while start - 1 in entity_at:
            start -= 1
        left = side.lower[start - 1] if start else ""
        content = next((side.lower[j] for j in range(start - 1, -1, -1)
                        if j not in entity_at and side.lower[j] not in _STOPWORDS), "")
        roles.setdefault(name, (left, _stem(content)))
    return roles


def _swapped(q: _Side, c: _Side, shared: set[str]) -> bool:
    """Two names that trade places: each stands where the other stood ("from Paris to Rome" / "from Rome to Paris",
    "the Bears beat the Giants" / "the Giants beat the Bears"). A list in another order or a sentence turned around
    ("TensorFlow and JAX work with Datasets" / "Datasets works with TensorFlow and JAX") is not a swap."""
    rq, rc = _roles(q), _roles(c)
    names = sorted(shared)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for part in (0, 1):
                qa, qb, ca, cb = rq[a][part], rq[b][part], rc[a][part], rc[b][part]
                if qa != qb and qa == cb and qb == ca and (qa or qb) and not {qa, qb} <= _CONJUNCTIONS | {""}:
                    return True
    return False


def near_miss(query: str, cached: str) -> str | None:
    """Why ``cached`` must not answer ``query`` (a short reason), or None when the guard has no objection."""
    return _near_miss(_side(query), _side(cached))


def _near_miss(q: _Side, c: _Side) -> str | None:
    if q.negated != c.negated and _close(q, c):
        return "negation"
    sq, sc = q.words, c.words
    for a, b in _ANTONYMS:
        if (a in sq and b in sc and b not in sq and a not in sc) or (b in sq and a in sc and a not in sq and
                                                                      b not in sc):
            return f"antonym {a}/{b}"
    if q.asks and c.asks and q.asks != c.asks:
        return "question word"
    if q.numbers != c.numbers:
        return "numbers"
    if q.dates != c.dates:
        return "dates"
    expanded_q, expanded_c = q.expanded(c), c.expanded(q)
    names_q = {name for k, name in q.entities if name not in expanded_q and not _found(k, name, q, c)}
    names_c = {name for k, name in c.entities if name not in expanded_c and not _found(k, name, c, q)}
    if names_q or names_c:
        return "entities"  # a name of one side does not occur in the other at all
    shared = {name for _, name in q.entities} & {name for _, name in c.entities}
    if len(shared) > 1 and _swapped(q, c, shared):
        return "entity order"
    return None


def _close(q: _Side, c: _Side) -> bool:
    """Whether two texts say nearly the same words (apart from negations): then a negation on one side only flips
    the meaning ("Is my data encrypted?" / "Is my data not encrypted?"). A rephrased sentence that negates in other
    words ("in the absence of metadata" / "doesn't have metadata") is not a flip."""
    return len(q.content ^ c.content) <= _NEGATION_SCOPE


def is_time_sensitive(text: str) -> bool:
    """True when the answer likely depends on when it is asked ("today", "latest", prices, weather, news)."""
    return bool(_TIME_SENSITIVE.search(text))
