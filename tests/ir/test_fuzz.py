"""Deterministic fuzzing of hlo_tools.parse_module and hlo_tools.verify.

Whatever the input (mutated real modules, pathological nesting, binary garbage,
absurd shapes), parsing and verifying may only raise ``HloParseError`` (with a
1-based int line and column) or ``HloVerifyError``, and must finish quickly.
Text that parses must print back byte for byte.  Fuzzed text is never handed
to XLA: its C++ parser crashes the process on deep nesting.
"""

import random
import re
import time

import pytest

import hlo_tools
from support import CORPUS_DIR, read_exact

SEED = 0x41A
PER_CASE_LIMIT_S = 5.0
TOTAL_BUDGET_S = 30.0
MUTATIONS_PER_MODULE = 40
MAX_FUZZED_MODULE_CHARS = 60_000
CORPUS_SAMPLE = 12

_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")
_SPECIAL = "{}[]()<>=,:;%\"'\\/.-+*_ \n\t0123456789eE"
_BRACKETS = "{}[]()<>\"'"


def _span(rng: random.Random, n: int) -> tuple[int, int]:
    start = rng.randrange(n)
    return start, min(n, start + rng.randint(1, 40))


def delete_chars(rng, text):
    start, end = _span(rng, len(text))
    return text[:start] + text[end:]


def duplicate_chars(rng, text):
    start, end = _span(rng, len(text))
    return text[:end] + text[start:end] + text[end:]


def swap_chars(rng, text):
    chars = list(text)
    for _ in range(rng.randint(1, 4)):
        i, j = rng.randrange(len(chars)), rng.randrange(len(chars))
        chars[i], chars[j] = chars[j], chars[i]
    return "".join(chars)


def replace_chars(rng, text):
    chars = list(text)
    for _ in range(rng.randint(1, 4)):
        chars[rng.randrange(len(chars))] = rng.choice(_SPECIAL)
    return "".join(chars)


def truncate(rng, text):
    return text[:rng.randrange(len(text))]


def insert_brackets(rng, text):
    at = rng.randrange(len(text) + 1)
    return text[:at] + "".join(rng.choice(_BRACKETS) for _ in range(rng.randint(1, 6))) + text[at:]


def _tokens(text):
    return _TOKEN.findall(text)


def delete_token(rng, text):
    tokens = _tokens(text)
    del tokens[rng.randrange(len(tokens))]
    return "".join(tokens)


def duplicate_token(rng, text):
    tokens = _tokens(text)
    i = rng.randrange(len(tokens))
    tokens.insert(i, tokens[i])
    return "".join(tokens)


def swap_tokens(rng, text):
    tokens = _tokens(text)
    i, j = rng.randrange(len(tokens)), rng.randrange(len(tokens))
    tokens[i], tokens[j] = tokens[j], tokens[i]
    return "".join(tokens)


def move_token(rng, text):
    tokens = _tokens(text)
    token = tokens.pop(rng.randrange(len(tokens)))
    tokens.insert(rng.randrange(len(tokens) + 1), token)
    return "".join(tokens)


MUTATIONS = [delete_chars, duplicate_chars, swap_chars, replace_chars, truncate,
             insert_brackets, delete_token, duplicate_token, swap_tokens, move_token]


def _module(body: str) -> str:
    return f"HloModule m\n\nENTRY e {{\n{body}\n}}\n"


def pathological_cases() -> dict[str, str]:
    """Hand-made hostile inputs: deep nesting, garbage, empty text, absurd sizes."""
    deep = 10_000
    deeper = 100_000
    rng = random.Random(SEED)
    return {
        "empty": "",
        "whitespace": " \n\t\n",
        "header only": "HloModule",
        "module without computations": "HloModule m\n",
        "unterminated entry": "HloModule m\nENTRY e {\n",
        "tuple shape nested 10000 deep": _module(
            f"  ROOT p = {'(' * deep}f32[]{')' * deep} parameter(0)"),
        "unclosed tuple shape 10000 deep": _module(f"  ROOT p = {'(' * deep}f32[] parameter(0)"),
        "parentheses 100000 deep": _module(f"  ROOT a = f32[] add({'(' * deeper}{')' * deeper})"),
        "braces 100000 deep in attribute": _module(
            f"  p = f32[4] parameter(0)\n  ROOT t = f32[4] transpose(p), dimensions={'{' * deeper}0{'}' * deeper}"),
        "braces 100000 deep in literal": _module(f"  ROOT c = f32[1] constant({'{' * deeper}1{'}' * deeper})"),
        "unclosed braces 100000 deep": _module(f"  ROOT c = f32[1] constant({'{' * deeper}"),
        "brackets 100000 deep": _module(f"  ROOT p = f32{'[' * deeper} parameter(0)"),
        "mixed nesting 100000 deep": "HloModule m, x=" + "([{<" * (deeper // 4),
        "quote never closed": _module('  ROOT p = f32[] parameter(0), metadata={op_name="' + "x" * 10_000),
        "binary garbage": bytes(rng.randrange(256) for _ in range(4096)).decode("latin-1"),
        "NUL bytes in module": _module("  ROOT p = f32[] par\x00ameter(0)"),
        "huge constant, elided": _module("  ROOT c = f32[999999999999] constant({...})"),
        "huge constant, scalar literal": _module("  ROOT c = f32[999999999999] constant(0)"),
        "huge parameter": _module("  ROOT p = f32[999999999999,999999999999,999999999999] parameter(0)"),
        "huge dimension": _module("  ROOT p = f32[99999999999999999999999999999999] parameter(0)"),
        "integer out of range": _module("  ROOT c = s32[] constant(99999999999999999999999999)"),
        "huge parameter number": _module("  ROOT p = f32[] parameter(99999999999999999999999)"),
        "a million-character name": _module(f"  ROOT {'n' * 1_000_000} = f32[] parameter(0)"),
        "a million lines": "HloModule m\n" + "\n" * 1_000_000,
    }


def check_input(text: str) -> str | None:
    """None if hlo_tools handles ``text`` acceptably, else what went wrong."""
    start = time.perf_counter()
    try:
        module = hlo_tools.parse_module(text)
    except hlo_tools.HloParseError as exc:
        location = (exc.line, exc.column)
        if not all(type(n) is int and n >= 1 for n in location):
            return f"HloParseError with line/column {location!r}: {exc}"
        if "internal error" in exc.message:  # the parser's safety net caught one of its own bugs
            return f"parser bug: {exc}"
    except Exception as exc:  # anything but HloParseError is a bug
        return f"parse_module raised {type(exc).__name__}: {str(exc)[:200]}"
    else:
        try:
            printed = module.to_text()
            if printed != text:
                return "accepted text does not print back byte for byte"
            hlo_tools.verify(module)
            module.to_text(regenerate=True)
        except hlo_tools.HloVerifyError:
            pass
        except Exception as exc:
            return f"print/verify raised {type(exc).__name__}: {str(exc)[:200]}"
    elapsed = time.perf_counter() - start
    if elapsed >= PER_CASE_LIMIT_S:
        return f"took {elapsed:.1f} s"
    return None


def _describe(text: str) -> str:
    return repr(text[:120]) + (f"... ({len(text)} chars)" if len(text) > 120 else "")


@pytest.mark.parametrize("name", sorted(pathological_cases()))
def test_pathological_input(name):
    text = pathological_cases()[name]
    assert check_input(text) is None


def _seed_modules(real_modules: dict[str, str]) -> dict[str, str]:
    """The real modules to mutate: generated ones plus an evenly spread corpus sample."""
    seeds = {name: text for name, text in real_modules.items() if len(text) <= MAX_FUZZED_MODULE_CHARS}
    if CORPUS_DIR.is_dir():
        corpus = sorted(p for p in CORPUS_DIR.glob("*/*.hlo"))
        step = max(1, len(corpus) // CORPUS_SAMPLE)
        for path in corpus[::step][:CORPUS_SAMPLE]:
            seeds[f"corpus/{path.parent.name}/{path.stem}"] = read_exact(path)
    return seeds


def test_mutated_real_modules(real_modules):
    rng = random.Random(SEED)
    seeds = _seed_modules(real_modules)
    cases = []
    for name in sorted(seeds):
        for mutation in rng.choices(MUTATIONS, k=MUTATIONS_PER_MODULE):
            cases.append((f"{name} / {mutation.__name__}", mutation(rng, seeds[name])))
    deadline = time.perf_counter() + TOTAL_BUDGET_S
    problems, checked = [], 0
    for label, text in cases:
        if time.perf_counter() > deadline:
            break
        checked += 1
        problem = check_input(text)
        if problem:
            problems.append(f"{label}: {problem}; input {_describe(text)}")
    assert checked >= len(seeds), f"only {checked} of {len(cases)} cases ran within {TOTAL_BUDGET_S} s"
    assert not problems, f"{len(problems)} of {checked} cases failed:\n" + "\n".join(problems[:30])
