"""coco-caption's scores: BLEU against a hand computation, CIDEr and ROUGE-L on cases with known
values, the Python PTB tokenizer against the Java one it replaces, and the errors."""

import csv
import gc
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from pycocoevalcap.tokenizer import ptbtokenizer

from experiments.captioning import scores as caption_scores
from experiments.captioning.scores import ptb_tokenize, ptb_tokens, score_captions

JAVA = shutil.which("java")
needs_java = pytest.mark.skipif(JAVA is None, reason="java is not on the PATH (coco-caption's Java tools)")


def test_bleu_agrees_with_a_hand_computation_with_the_closest_reference_length():
    references = {
        1: ["A dog runs on the grass.", "A brown dog is running."],  # lengths 6, 5
        2: ["Two children play in the snow.", "Kids play in snow."],  # lengths 6, 4
    }
    candidates = {1: "A dog is running.", 2: "The children play in the snow."}  # lengths 4, 6
    # clipped matches / candidate n-grams, summed over the corpus:
    #   1-grams: image 1: a dog is running 4/4; image 2: "the" twice but at most once in a reference, 5/6
    #   2-grams: a-dog dog-is is-running 3/3; children-play play-in in-the the-snow 4/5
    #   3-grams: dog-is-running 1/2; children-play-in play-in-the in-the-snow 3/4
    #   4-grams: 0/1; children-play-in-the play-in-the-snow 2/3
    precisions = [9 / 10, 7 / 8, 4 / 6, 2 / 4]
    # brevity penalty: candidate length 10; reference length 5 + 6, the reference length closest to
    # each candidate's (coco-caption's Bleu uses option="closest"; "shortest" would give 9, BP = 1)
    brevity = math.exp(1 - 11 / 10)
    expected = [100 * brevity * math.prod(precisions[:n]) ** (1 / n) for n in range(1, 5)]

    scores = score_captions(references, candidates, meteor=False)

    assert [scores[f"bleu{n}"] for n in range(1, 5)] == pytest.approx(expected, rel=1e-6)


def test_rouge_l_is_the_f_measure_of_the_longest_common_subsequence():
    scores = score_captions({"x": ["a big dog runs fast"]}, {"x": "a dog runs"}, meteor=False)
    precision, recall, beta = 3 / 3, 3 / 5, 1.2  # LCS "a dog runs"
    expected = (1 + beta**2) * precision * recall / (recall + beta**2 * precision)
    assert scores["rouge_l"] == pytest.approx(100 * expected)


SCENES = {
    "beach": ["a surfer rides a big wave", "a man surfing a wave in the ocean"],
    "park": ["two dogs chase a ball on the grass", "dogs playing with a ball in a park"],
    "street": ["a woman rides a bicycle down the street", "a cyclist on a city street"],
    "snow": ["children build a snowman in the snow", "kids playing in the snow"],
}


def test_cider_of_a_candidate_identical_to_its_references_is_the_maximum():
    references = {k: [v[0]] * 5 for k, v in SCENES.items()}
    identical = score_captions(references, {k: v[0] for k, v in references.items()}, meteor=False)
    shuffled = dict(zip(references, [v[0] for v in list(references.values())[1:] + list(references.values())[:1]]))
    wrong = score_captions(references, shuffled, meteor=False)

    # CIDEr-D is 10 x the mean over n of a clipped cosine similarity, 1 for identical n-gram vectors
    assert identical["cider"] == pytest.approx(1000.0)
    assert identical["bleu4"] == pytest.approx(100.0)
    assert wrong["cider"] < 100.0
    assert wrong["cider"] < identical["cider"] and wrong["bleu4"] < identical["bleu4"]


def test_cider_depends_on_the_scored_set():
    candidates = {k: v[1] for k, v in SCENES.items()}
    alone = score_captions({"beach": SCENES["beach"]}, {"beach": candidates["beach"]}, meteor=False)
    together = score_captions(SCENES, candidates, meteor=False)
    # one image: every n-gram is in all scored images' references, its idf log(1/1) is 0
    assert alone["cider"] == 0.0
    assert together["cider"] > 0.0
    assert alone["bleu4"] > 0.0


@pytest.mark.parametrize("text, tokens", [
    ("A dog runs.", ["a", "dog", "runs"]),
    ("Two dogs, one brown; one black!", ["two", "dogs", "one", "brown", "one", "black"]),
    ("A Man In RED", ["a", "man", "in", "red"]),
    ("The dog's ball", ["the", "dog", "'s", "ball"]),
    ("The dogs' ball", ["the", "dogs", "ball"]),
    ("He doesn't and can't", ["he", "does", "n't", "and", "ca", "n't"]),
    ("A black-and-white dog - a T-shirt -- running", ["a", "black-and-white", "dog", "a", "t-shirt", "running"]),
    ('A sign that says "Stop here."', ["a", "sign", "that", "says", "stop", "here"]),
    ("A \u201ccurly\u201d quote \u2013 and an ellipsis\u2026", ["a", "curly", "quote", "and", "an", "ellipsis"]),
    ("A dog (brown) and [red] toy", ["a", "dog", "-lrb-", "brown", "-rrb-", "and", "-lsb-", "red", "-rsb-", "toy"]),
    ("Mr. Smith on St. Patrick's day at 5:30 p.m.", ["mr.", "smith", "on", "st.", "patrick", "'s", "day", "at", "5:30", "p.m."]),
    ("1,000 people paid $5.50 or 50%", ["1,000", "people", "paid", "$", "5.50", "or", "50", "%"]),
    ("Salt &amp; pepper", ["salt", "&", "pepper"]),
    ("A <unk> on a <b>bike</b>", ["a", "<unk>", "on", "a", "<b>", "bike", "</b>"]),
    ("   ", []),
])
def test_ptb_tokenize(text, tokens):
    assert ptb_tokenize(text) == tokens


def test_ptb_tokens_keep_the_punctuation_tokens_coco_caption_then_drops():
    assert ptb_tokens('He said "hi" (twice)...') == ["he", "said", "``", "hi", "''", "-lrb-", "twice", "-rrb-", "..."]


TRICKY = [
    "Don't can't won't cannot gonna I'm you're they've we'd she'll o'clock rock'n'roll",
    "A dog's ball (red) is [here] {there} \"quoted\" 'single' `back' ...",
    "A black-and-white dog -- jumps - over a 3.5 m wall, 1,000 times; at 5:30 p.m. & U.S.A.",
    "Price $5.00 or 50% off! E-mail me@x.com http://www.x.com #tag and/or 1/2 ... .. ....",
    "Cafe \u201ccurly\u201d \u2018quotes\u2019 \u2013 dash \u2014 \u2026 \u00bd, a 3-wheeler in their 30s at the 3rd St. No. 5",
    "Sony Corp., Gov. Smith, Jan. 5 and Calif. Home of the A&amp;M team; the 49ers' Q&A.",
    "A <unk> dog and <b>bold</b> text, x < y > z",
]


@needs_java
def test_ptb_tokens_match_the_java_tokenizer_on_real_captions(data_root, tmp_path):
    with open(data_root / "flickr8k_subset" / "captions.txt", newline="") as handle:
        captions = [row["caption"] for row in csv.DictReader(handle)]
    lines = captions + TRICKY
    source = tmp_path / "captions.txt"
    source.write_text("\n".join(lines) + "\n")
    jar = Path(ptbtokenizer.__file__).parent / ptbtokenizer.STANFORD_CORENLP_3_4_1_JAR
    # the command coco-caption's PTBTokenizer runs
    java = subprocess.run([JAVA, "-cp", str(jar), "edu.stanford.nlp.process.PTBTokenizer", "-preserveLines",
                           "-lowerCase", str(source)], capture_output=True, text=True, check=True, timeout=120)
    expected = java.stdout.split("\n")[: len(lines)]
    # (the lexer looks across lines: an acronym ending one line before "The ..." gets a period; not here)

    mismatches = [(line, tokens, ptb_tokens(line)) for line, tokens in zip(lines, expected)
                  if ptb_tokens(line) != tokens.split()]
    assert len(expected) == len(lines) and len(lines) > 5000
    assert mismatches == []


def test_mismatched_ids_are_named():
    with pytest.raises(ValueError, match=r"same ids: 1 candidate ids without references \(e.g. \['b'\]\)"):
        score_captions({"a": ["a dog"]}, {"a": "a dog", "b": "a cat"}, meteor=False)
    with pytest.raises(ValueError, match=r"1 reference ids without a candidate \(e.g. \['b'\]\)"):
        score_captions({"a": ["a dog"], "b": ["a cat"]}, {"a": "a dog"}, meteor=False)


@pytest.mark.parametrize("references, candidates, error, message", [
    ({}, {}, ValueError, "no candidate captions"),
    ({"a": "a dog"}, {"a": "a dog"}, TypeError, "references of 'a' should be a non-empty sequence"),
    ({"a": []}, {"a": "a dog"}, TypeError, "references of 'a' should be a non-empty sequence"),
    ({"a": ["a dog"]}, {"a": ["a dog"]}, TypeError, "candidate 'a' should be one caption string, got list"),
])
def test_bad_input_gets_a_one_line_error(references, candidates, error, message):
    with pytest.raises(error, match=message):
        score_captions(references, candidates, meteor=False)


def test_meteor_required_without_java_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(caption_scores.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="METEOR needs java on the PATH"):
        score_captions({"a": ["a dog"]}, {"a": "a dog"}, meteor=True)
    assert "meteor" not in score_captions({"a": ["a dog"]}, {"a": "a dog"})


def test_a_failing_java_is_a_clear_error_not_a_hang(tmp_path, monkeypatch):
    broken = tmp_path / "java"
    broken.write_text("#!/bin/sh\necho 'Error: no JVM here' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match=r"METEOR failed, java gave no score \(Error: no JVM here\)"):
        score_captions({"a": ["a dog"]}, {"a": "a dog"}, meteor=True)
    gc.collect()  # pycocoevalcap's clean-up waits on its lock: it must have been released


@pytest.mark.slow
@needs_java
def test_meteor_is_scored_where_java_runs():
    scores = score_captions(SCENES, {k: v[0] for k, v in SCENES.items()}, meteor=True)  # one JVM start, ~25 s
    assert list(scores) == ["bleu1", "bleu2", "bleu3", "bleu4", "meteor", "rouge_l", "cider"]
    assert 90.0 < scores["meteor"] <= 100.0  # identical to one of two references, less a fragmentation penalty
