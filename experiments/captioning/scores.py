"""Caption scores as coco-caption computes them, without its Java tokenizer.

:func:`ptb_tokenize` does in Python what coco-caption's ``PTBTokenizer`` does through Java
(Stanford CoreNLP 3.4.1's ``PTBTokenizer -preserveLines -lowerCase``, then the removal of
punctuation tokens), and :func:`score_captions` scores a whole split with pycocoevalcap's pure
Python ``Bleu(4)``, ``Cider()`` and ``Rouge()`` scorers, plus ``Meteor()`` where ``java`` runs.
No SPICE: it downloads Stanford CoreNLP models on first use, which cannot work offline.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import unicodedata
from typing import Hashable, Mapping, Optional, Sequence

from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge

#: coco-caption's ``PUNCTUATIONS`` (pycocoevalcap/tokenizer/ptbtokenizer.py), compared with the
#: *lowercased* Java output; so ``-lrb-`` and the other bracket tokens are kept, as there
PUNCTUATIONS = frozenset(["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-",
                          ".", "?", "!", ",", ":", "-", "--", "...", ";"])

#: what the Java lexer reads as another form: Unicode quotes, dashes, ellipsis and fractions, and
#: the HTML ampersand
_NORMALIZED = {"\u2018\u2018": " `` ", "\u2019\u2019": " '' ", "\u201c": " `` ", "\u201d": " '' ",
               "\u2018": " ` ", "\u2019": "'", "\u2013": " -- ", "\u2014": " -- ", "\u2026": " ... ",
               "\u00a0": " ", "\u00bd": "1/2", "\u00bc": "1/4", "\u00be": "3/4", "&amp;": "&"}
_NORMALIZE = re.compile("|".join(sorted(_NORMALIZED, key=len, reverse=True)))

#: words that keep their final period, in any case, as in the Java lexer (checked against it one by
#: one): titles, then months, days, states and company words; before a capitalized word, the lexer
#: takes the latter to end a sentence too and adds a period
_TITLES = ("mrs? ms drs? profs? sens? reps? attys? lt col gen messrs govs? adm rev maj sgt cpl pvt mt capt "
           "ste? ave pres lieut hon brig c?o?mdr pfc spc supts? det mme mlle dept ph ft vs").split()
_ABBREVIATIONS = (
    "jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thurs fri "
    "ala ariz calif colo conn ct dak fla ga ind kans? ky md mich minn mo mont neb nev okla penn tenn va vt "
    "wisc? wyo jr sr bros blvd rd esq inc cos? corp pty ltd plc bancorp bhd assn univ intl sys "
    "tel est ext sq etc al bldg alta sask ont"
).split()
#: the same, only capitalized or in capitals (lowercase, they are words: ``ill.``, ``wash.``)
_CAPITALIZED_ABBREVIATIONS = "Az Ark Del Ill La Mass Miss Ore Pa Tex Wash".split()
#: titles only before a number (``No. 5``, ``fig. 2``)
_NUMBER_TITLES = "nos? prop figs? pp".split()

#: capitalized words after which the Java lexer takes an acronym (``U.S.``) to end a sentence and adds
#: a period (found by trying words one by one; the lexer's own list may hold more)
_SENTENCE_STARTS = re.compile(r"\s+(?:The|A|An|He|She|It|They|We|This|That|These|There|Here|In|At|But|So|If|When|"
                              r"While|As|What|Her|Their|Our|You|Some|Many|Mr\.|Ms\.|After|Then|Yet|One|Since|"
                              r"However|Other|Such|Once|Now|Last)(?=\s|$)")

#: a capitalized word next, after which the lexer takes an abbreviation (``Calif.``) to end a sentence
_CAPITALIZED_NEXT = re.compile(r"\s+[A-Z]")

_BRACKETS = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}

_TOKEN = re.compile(
    r"""
      (?P<tag></?[a-z][\w:.\-]*/?>)
    | (?P<url>(?:https?://|www\.)\S*[^\s.,;:!?'")\]])
    | (?P<acronym>(?:[a-z]\.){2,}(?:-\w+)*)
    | (?P<title>(?:TITLES|[a-z])\.(?![\w.])|(?:NUMBERS)\.(?=\s+\d))
    | (?P<abbreviation>(?:ABBREVIATIONS|(?-i:CAPITALIZED))\.(?![\w.]))
    | (?P<number>(?:\d+|(?<!\w)\.\d+)(?:[.,:/]\d+)*(?![\w-]|[.,:/]\d))
    | (?P<clitic>n't|'(?:s|m|d|re|ve|ll|em)\b|'n'|'t(?=is\b))
    | (?P<word>(?-i:[A-Z]+&[A-Z]+)|(?:\#(?=[a-z]))?[\w@]+(?:[-'/.@][\w]+)*)
    | (?P<ellipsis>\.{3,}|\.(?:\ \.){2,})
    | (?P<dashes>-{2,})
    | (?P<quote>``|''|"|`|')
    | (?P<stops>[?!]+)
    | (?P<other>\S)
    """.replace("TITLES", "|".join(_TITLES)).replace("ABBREVIATIONS", "|".join(_ABBREVIATIONS))
       .replace("CAPITALIZED", "|".join(_CAPITALIZED_ABBREVIATIONS + [w.upper() for w in _CAPITALIZED_ABBREVIATIONS]))
       .replace("NUMBERS", "|".join(_NUMBER_TITLES)),
    re.VERBOSE | re.IGNORECASE,
)

#: words the Java lexer splits in two
_SPLIT_WORDS = {"cannot": ("can", "not"), "gonna": ("gon", "na"), "gotta": ("got", "ta"),
                "wanna": ("wan", "na"), "y'all": ("y'", "all")}

_CLITIC = re.compile(r"(?P<stem>.+?)(?P<clitic>n't|'(?:s|m|d|re|ve|ll))$")


def _split_word(word: str) -> list[str]:
    """``don't`` -> ``do n't``, ``dog's`` -> ``dog 's``, ``cannot`` -> ``can not``,
    ``rock'n'roll`` -> ``rock 'n' roll``, as PTB does."""
    if "'n'" in word:
        before, after = word.split("'n'", 1)
        return [*(_split_word(before) if before else []), "'n'", *(_split_word(after) if after else [])]
    if word in _SPLIT_WORDS:
        return list(_SPLIT_WORDS[word])
    match = _CLITIC.match(word)
    if match:
        return [match["stem"], match["clitic"]]
    return [word]


def _quote(text: str, match: re.Match) -> str:
    """A straight quote as the lexer writes it: opening (two backticks, or one for ') where it
    starts a word (after a space or an opening bracket, before a non-space), else closing."""
    token, start, end = match.group(), match.start(), match.end()
    if token not in ('"', "'"):
        return token
    opens = (start == 0 or text[start - 1].isspace() or text[start - 1] in "([{") \
        and end < len(text) and not text[end].isspace()
    if token == '"':
        return "``" if opens else "''"
    return "`" if opens else "'"


def ptb_tokens(text: str) -> list[str]:
    """The lowercased tokens of Stanford's PTBTokenizer (as coco-caption runs it), punctuation
    included: ``(`` is ``-lrb-``, straight quotes are the lexer's opening and closing quotes,
    ``....`` is ``...``."""
    text = _NORMALIZE.sub(lambda m: _NORMALIZED[m.group()], unicodedata.normalize("NFC", text))
    tokens: list[str] = []
    for match in _TOKEN.finditer(text):
        kind, token = match.lastgroup, match.group().lower()
        if kind == "word":
            tokens += _split_word(token)
        elif kind == "quote":
            tokens.append(_quote(text, match))
        elif (kind == "abbreviation" and _CAPITALIZED_NEXT.match(text, match.end())
              or kind == "acronym" and _SENTENCE_STARTS.match(text, match.end())):
            tokens += [token, "."]  # the lexer's guess that a sentence ends there
        elif kind == "ellipsis":
            tokens.append("...")
        elif kind == "other":
            tokens.append(_BRACKETS.get(token, token))
        else:
            tokens.append(token)
    return tokens


def ptb_tokenize(text: str) -> list[str]:
    """The tokens coco-caption scores for caption ``text``: what its ``PTBTokenizer.tokenize``
    (pycocoevalcap/tokenizer/ptbtokenizer.py) gives, without Java: Stanford CoreNLP 3.4.1's
    ``PTBTokenizer -preserveLines -lowerCase``, then the tokens in its ``PUNCTUATIONS`` list dropped.

    That list is compared with the lowercased output, so bracket tokens (``-lrb-``, ``-rrb-``)
    survive there and here; periods, commas, quotes, dashes and the like go. Clitics are split
    (``dog's`` -> ``dog 's``, ``don't`` -> ``do n't``), hyphenated words stay whole.
    """
    return [t for t in ptb_tokens(text) if t not in PUNCTUATIONS]


#: the names :func:`score_captions` returns, in the paper's column order (``meteor`` where scored)
SCORES = ("bleu1", "bleu2", "bleu3", "bleu4", "meteor", "rouge_l", "cider")


def java_available() -> bool:
    """Whether ``java`` is on the PATH (METEOR runs its jar)."""
    return shutil.which("java") is not None


def _tokenized(references: Mapping[Hashable, Sequence[str]], candidates: Mapping[Hashable, str]
               ) -> tuple[dict[Hashable, list[str]], dict[Hashable, list[str]]]:
    """Both sides checked and tokenized into coco-caption's ``{id: [space-joined tokens]}`` form."""
    if not candidates:
        raise ValueError("no candidate captions to score")
    missing = [k for k in candidates if k not in references]
    extra = [k for k in references if k not in candidates]
    if missing or extra:
        raise ValueError(f"references and candidates must have the same ids: {len(missing)} candidate ids "
                         f"without references (e.g. {missing[:3]}), {len(extra)} reference ids without a "
                         f"candidate (e.g. {extra[:3]})")
    gts, res = {}, {}
    for key, candidate in candidates.items():
        refs = references[key]
        if not isinstance(candidate, str):
            raise TypeError(f"candidate {key!r} should be one caption string, got {type(candidate).__name__}")
        if isinstance(refs, str) or not refs or not all(isinstance(r, str) for r in refs):
            raise TypeError(f"references of {key!r} should be a non-empty sequence of caption strings, got {refs!r}")
        gts[key] = [" ".join(ptb_tokenize(r)) for r in refs]
        res[key] = [" ".join(ptb_tokenize(candidate))]
    return gts, res


def _meteor(gts: dict[Hashable, list[str]], res: dict[Hashable, list[str]]) -> float:
    """METEOR 1.5 of the set, from pycocoevalcap's ``Meteor`` (a java process). A java that fails
    is a ``RuntimeError`` with java's last words: pycocoevalcap's own error would leave its lock
    held, and its clean-up at garbage collection would then wait on that lock forever."""
    scorer = Meteor()
    try:
        return float(scorer.compute_score(gts, res)[0])
    except (ValueError, OSError) as error:
        process = scorer.meteor_p
        process.kill()
        said = process.stderr.read().decode(errors="replace").strip().splitlines()
        with contextlib.suppress(OSError):
            process.stdin.close()
        scorer.lock.release()
        raise RuntimeError(f"METEOR failed, java gave no score ({said[-1] if said else error}); "
                           "pass meteor=False to score without it") from error


def score_captions(references: Mapping[Hashable, Sequence[str]], candidates: Mapping[Hashable, str],
                   meteor: Optional[bool] = None) -> dict[str, float]:
    """coco-caption's scores of ``candidates`` (one caption per id) against ``references`` (the
    captions of the same ids), in percent as the paper's tables: ``bleu1`` .. ``bleu4`` (corpus
    BLEU, brevity penalty from the reference length closest to each candidate's), ``rouge_l``,
    ``cider`` (CIDEr-D's ``Cider()``, mean over ids) and ``meteor`` (METEOR 1.5).

    Both sides go through :func:`ptb_tokenize`. CIDEr weighs n-grams by document frequencies taken
    from the references of the scored set itself, so scores of different subsets do not add up:
    score a whole split in one call. ``meteor``: None scores METEOR where ``java`` is on the PATH,
    True requires it (``RuntimeError`` without java), False skips it.
    """
    if meteor and not java_available():
        raise RuntimeError("METEOR needs java on the PATH (pycocoevalcap runs meteor-1.5.jar); "
                           "install a Java runtime or pass meteor=False")
    gts, res = _tokenized(references, candidates)
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    scores = {f"bleu{n + 1}": float(b) for n, b in enumerate(bleu)}
    if meteor is not False and java_available():
        scores["meteor"] = _meteor(gts, res)
    scores["rouge_l"] = float(Rouge().compute_score(gts, res)[0])
    scores["cider"] = float(Cider().compute_score(gts, res)[0])
    return {name: 100.0 * scores[name] for name in SCORES if name in scores}
