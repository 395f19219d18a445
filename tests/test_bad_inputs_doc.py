"""Each message that docs/bad_inputs.md quotes is one the code prints: the doc is written by
hand, and a message changed in the code would otherwise stay old there. Each code span of the
doc's "what you see" column is cut at its wildcards (<anything>, ..., …), and 70% of each part
must be made of the code's strings, cut at their {...}: whole pieces, or pieces that run off the
part's ends (a message is joined from several strings at run time). Only the letters of words
count, not the names, numbers and 'quoted' values that fill a {...}, nor what messages quote
from Python, the OS or a library."""
import ast
import glob
import itertools
import os
import re

import pytest

from conftest import ROOT

CODE = ["ddpgpt/*.py", "*.py", "examples/*.py"]
# a token with a digit, =, / or _, a .suffix, a CamelCase name, an imported module, N
VALUE = re.compile(r"\S*([\d=/_]|\.\w|[a-z][A-Z])\S*|(?<=import )\S+|(?<!\w)'[^']*'(?!\w)|"
                   r"\b[A-Z]\b")
FOREIGN = re.compile(r"No space left on device|Read-only file system|Expecting value|invalid "
                     r"syntax|requested and \S+ written|invalid value: integer|expected u32")


def normal(text):
    """One space for white space; no backticks, which a doc's code span cannot hold."""
    return re.sub(r"\s+", " ", text.replace("`", ""))


@pytest.fixture(scope="module")
def pieces():
    """The text between the {...} of the code's strings (docstrings aside; an f-string's text is
    its Constant nodes) and between the $VARs of the launch scripts, whose messages the doc
    quotes too; but pieces of one word, keys and names of which any sentence could be made."""
    found = []
    for path in itertools.chain(*(glob.glob(os.path.join(ROOT, p)) for p in CODE)):
        tree = ast.parse(open(path).read())
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        found += [re.sub(r"\{[^{}]*\}", "\0", n.value) for n in ast.walk(tree) if isinstance(
            n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]
    for path in glob.glob(os.path.join(ROOT, "launch", "*.sh")):
        found.append(re.sub(r"\$\{?\w+\}?", "\0", open(path).read().replace("\\\n", "")))
    return {p for p in normal("\0".join(found)).split("\0") if " " in p}


def doc_messages():
    """(row's input, message) for each code span of a table row's second cell, but those of a
    '(was ...' or '(removed ...', which the code no longer says, and a test's [id]."""
    for line in open(os.path.join(ROOT, "docs", "bad_inputs.md")):
        if line.startswith("|"):  # a header row quotes too little to be checked
            row, cell = line.replace("\\|", "\0").split("|")[1:3]
            cell = re.sub(r"\((was|removed)\b(`[^`]*`|\([^()]*\)|[^()`])*\)", "", cell)
            yield from ((row.strip(), span[2].replace("\0", "|")) for span in
                        re.finditer(r"(`+)(.+?)(?<!`)\1(?!`)", cell) if span[2][0] != "[")


def stale(message, pieces):
    """The parts of message, cut at the doc's wildcards, that pieces do not cover 70% of."""
    for text in re.split(r"<[^<>]*>|\.\.\.|…", normal(message)):
        letters = [c.isalpha() for c in text]
        for m in itertools.chain(VALUE.finditer(text), FOREIGN.finditer(text)):
            letters[m.start():m.end()] = [False] * (m.end() - m.start())
        if sum(letters) < 12:  # names and values, or too few words to mean anything
            continue
        n, covered = len(text), set()  # where a piece lies: whole, or running off an end
        for p in (p for p in pieces if p[:4] in text or text[:4] in p):
            for i in (i for i in range(n) if text.startswith(p[:4], i)):
                if text.startswith(p, i) or p.startswith(text[i:].rstrip()):
                    covered.update(range(i, i + len(p)))
            for j in (j for j in range(len(p)) if p.startswith(text[:4], j)):
                if text.startswith(p[j:]) or p[j:].startswith(text):
                    covered.update(range(len(p) - j))
        if sum(letters[i] for i in covered if i < n) < 0.7 * sum(letters):
            yield text


def test_every_message_the_doc_quotes_is_the_codes(pieces):
    # the check can fail: a made-up message is stale, and a real one is not
    assert list(stale("this message appears nowhere in the code at all, surely", pieces))
    assert not list(stale("<out_dir> holds no loadable checkpoint (ckpt_*.pt, ckpt_*/ or "
                          "nanoGPT's ckpt.pt): give the out_dir of a run", pieces))
    messages = list(doc_messages())
    assert len(messages) > 200, "the doc's tables were not read"
    wrong = [f"{row}: {text!r}" for row, m in messages for text in stale(m, pieces)]
    assert not wrong, "docs/bad_inputs.md quotes what the code does not say:\n" + "\n".join(wrong)
