"""The fourth prompt pool (issue 27, data at scale): real third-party code and prose, generated math, multi-turn chat.

Sources:
- `code-pkg`: tasks over functions of pinned installed packages (explain, test, refactor, translate...),
  read with `ast` from their files (nothing is imported), docstrings stripped from the code shown;
- `code-spec`: write a function from its real docstring summary, or complete its real signature;
- `summarize` / `rewrite`: tasks over prose paragraphs of those packages' docstrings (summarise, explain,
  simplify, fix injected typos) and over templated messages (rewrite in another tone or form);
- `math-steps`, `math-rate`, `math-percent`, `math-geometry`, `math-units`, `math-stats`: seeded word
  problems whose numbers are chosen so that the answers come out clean;
- `multi-turn`: conversations of user, assistant, user turns (the assistant turn is a worked solution
  we compute, a real docstring, or a role's greeting); each item carries `messages` for the chat template;
- `explain`: new topics and question forms.

The package part depends on exact package files, so `PINNED` records each package's version and a
fingerprint of what is read; a machine whose files differ cannot rebuild the pool identically and
gets a one-line error instead of silently other prompts.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import math
import random
import re
import textwrap
from fractions import Fraction
from pathlib import Path

from ..errors import UserError

# (distribution, version, package folder, sub-folders read (all when empty), fingerprint of what is read)
PINNED = (
    ("networkx", "3.6.1", "networkx", ("algorithms", "classes", "generators", "utils"), "2eb112b9e65f43c5"),
    ("numpy", "1.26.4", "numpy", ("lib", "core", "linalg", "polynomial", "fft"), "333b92b4f8f6a28b"),
    ("requests", "2.34.2", "requests", (), "c36e4e80fb0b670e"),
    ("click", "8.5.1", "click", (), "101f3cb276ee852f"),
    ("Jinja2", "3.1.6", "jinja2", (), "c8f59b7de797ea9b"),
    ("packaging", "26.4", "packaging", (), "58aaed01cbed6adb"),
    ("tqdm", "4.70.1", "tqdm", (), "62911ddabb40bcaa"),
    ("attrs", "26.1.0", "attr", (), "2d76d826d2b5d470"),
    ("PuLP", "3.3.2", "pulp", (), "d5067051a89ae3cd"),
    ("python-dateutil", "4.0.0", "dateutil", (), "f5903d45e3e1c7f0"),
    ("rich", "15.0.0", "rich", (), "226e35dfb777f122"),
    ("torch", "2.13.0+cpu", "torch", ("nn/modules", "optim", "utils/data", "distributions"), "e18bc4d880642327"),
    ("transformers", "5.17.0", "transformers", ("generation", "data", "models/llama", "models/gpt2", "models/bert"), "ea89d04ca18cfa2a"),
    ("sympy", "1.14.0", "sympy", ("ntheory", "combinatorics"), "866be34a8607d2c0"),
)
NEAR_DUP = Fraction(3, 5)  # a prompt sharing this share of its 8-word shingles with one earlier prompt is a near duplicate


def _is_test(rel: str) -> bool:
    return any(part.startswith(("test", "conftest", "_test")) or part.endswith("_test.py") or part == "testing"
               for part in rel.split("/"))


def _package_dir(folder: str) -> Path | None:
    spec = importlib.util.find_spec(folder)  # top-level names only: finds, does not import
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def _docstring_span(node) -> tuple[int, int] | None:
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.lineno, first.end_lineno
    return None


def _read_file(path: Path, pkg: str, rel: str) -> list[dict]:
    """Functions and methods of one file, in source order: name, header, body without docstring, docstring."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = src.splitlines()
    out = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                doc = ast.get_docstring(node) or ""
                span = _docstring_span(node)
                start, end = node.lineno - 1, node.end_lineno
                body_start = node.body[0].lineno - 1
                header = lines[start:body_start]
                code = [ln for i, ln in enumerate(lines[start:end], start)
                        if not (span and span[0] - 1 <= i < span[1])]
                out.append({"pkg": pkg, "file": rel, "name": f"{prefix}{node.name}",
                            "header": textwrap.dedent("\n".join(header)),
                            "code": textwrap.dedent("\n".join(code)), "doc": doc})
    visit(tree.body, "")
    for node in tree.body[:1]:  # the module docstring, as prose
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append({"pkg": pkg, "file": rel, "name": "", "header": "", "code": "",
                        "doc": textwrap.dedent(node.value.value).strip()})
    return out


@functools.lru_cache(maxsize=1)
def package_records() -> tuple[dict, ...]:
    """Every pinned package's functions (see `_read_file`), the files checked against the pinned fingerprints
    (parsing takes seconds, so a process does it once; callers must not modify the records)."""
    out = []
    for dist, version, folder, subs, pinned in PINNED:
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = None
        root = _package_dir(folder)
        if have is None or root is None:
            raise UserError(f"the training prompts from pool 4 on read the source of {dist} {version}, which is not "
                            f"installed here: `pip install --no-deps {dist}=={version}` (or use fewer prompts)")
        files = sorted({p for sub in (subs or ("",)) for p in (root / sub).rglob("*.py")})
        recs, digest = [], hashlib.sha256()
        for p in files:
            rel = p.relative_to(root).as_posix()
            if not _is_test(rel):
                digest.update(rel.encode() + b"\0" + p.read_bytes() + b"\0")
                recs += _read_file(p, folder, rel)
        fp = digest.hexdigest()[:16]
        if fp != pinned:  # the files decide (a +cu build of the same torch reads the same), the version guides
            raise UserError(f"the training prompts from pool 4 on read the source of {dist} {version}, but its files "
                            f"here ({have}) differ (fingerprint {fp}, pinned {pinned}): "
                            f"`pip install --force-reinstall --no-deps {dist}=={version}` (or use fewer prompts)")
        out += recs
    return tuple(out)


# ---------------------------------------------------------------- code and prose from the packages
CODE_FORMS = ["Explain what this Python function from `{pkg}` does, step by step:",
              "Write pytest unit tests for this function from `{pkg}`:",
              "Refactor this function from `{pkg}` for readability and explain each change:",
              "Add type hints and a docstring to this function from `{pkg}`:",
              "What are the edge cases this function from `{pkg}` handles, and are any missing?",
              "Translate this Python function into {lang}, keeping its behaviour:",
              "Describe the inputs, outputs and side effects of this function from `{pkg}`:",
              "What is the time complexity of this function? Explain your reasoning.",
              "Suggest a better name for this function and its variables, and say why:",
              "Write a short docstring (one summary line, then the arguments) for this function:",
              "Give two example calls of this function and what each returns or does:",
              "Review this code as a senior engineer would: what would you change, and why?"]
LANGS = ["JavaScript", "TypeScript", "Go", "Rust", "Java", "C++", "C#", "Kotlin"]
SPEC_FORMS = ["Write a Python function `{name}` that does the following: {summary}",
              "Implement `{name}` in Python. It should: {summary}",
              "In Python, how would you write a function named `{name}`? Its job: {summary}",
              "Write a small Python function for this task, with a docstring and an example: {summary}"]
PROSE_FORMS = ["Summarize this passage from the `{pkg}` documentation in one sentence:",
               "Explain this passage from the documentation of `{pkg}` in plain English:",
               "List the key points of this passage as bullet points:",
               "Write a short title and a two-sentence summary for this passage:",
               "Explain this to someone who has never programmed:",
               "What question is this passage answering? Write the question, then a short answer:",
               "Translate this passage into {human}:",
               "Rewrite this passage to be shorter and clearer, keeping every fact:",
               "Write three quiz questions, with answers, based on this passage:"]
HUMAN_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "simple English"]
TYPO_FORMS = ["Fix the spelling mistakes in this text and list what you changed:",
              "Proofread this paragraph and return the corrected version:"]


def _prose_paragraphs(doc: str) -> list[str]:
    """Prose paragraphs of a docstring before its sections (Parameters, Examples...), joined to one line."""
    out = []
    for para in doc.split("\n\n"):
        lines = para.strip().splitlines()
        if (len(lines) > 1 and set(lines[1].strip()) <= set("-=~")) or re.match(
                r"(Parameters|Returns|Examples?|Args|Arguments|Raises|Yields|Notes|See Also|References)\b", para.strip()):
            break
        text = _plain(" ".join(x.strip() for x in lines))
        letters = sum(c.isalpha() or c == " " for c in text)
        if (160 <= len(text) <= 700 and ">>>" not in text and "::" not in text and len(text.split()) >= 25
                and letters >= 0.85 * len(text) and ". " in text + " "):
            out.append(text)
    return out


VERBS = {"return", "compute", "create", "get", "convert", "check", "find", "build", "generate", "make", "apply", "add",
         "remove", "calculate", "evaluate", "load", "parse", "construct", "count", "determine", "sort", "split",
         "update", "validate", "write", "read", "yield", "iterate", "estimate", "draw", "format", "render", "resolve",
         "normalize", "test", "set", "compare", "extract", "merge", "filter", "select", "encode", "decode", "replace",
         "produce", "join", "insert", "append", "raise", "fit", "solve", "print", "copy", "reshape", "transform"}


def _plain(text: str) -> str:
    """Sphinx markup (:class:`~a.B`, ``x``) as plain Markdown code."""
    text = re.sub(r":[\w:]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _summary(doc: str, task: bool = False) -> str | None:
    """The docstring's first paragraph on one line, if it reads as a sentence (and, for `task`, starts with
    a verb such as Return or Computes: a property's "Current iteration..." is no function to write)."""
    first = _plain(doc.strip().split("\n\n")[0].replace("\n", " ").strip()) if doc else ""
    if not 30 <= len(first) <= 300 or ">>>" in first or first.startswith(":"):
        return None
    word = first.split(" ")[0].lower()
    if task and not (word in VERBS or word.removesuffix("s") in VERBS or word.removesuffix("es") in VERBS):
        return None
    return first


def _typos(text: str, rng: random.Random) -> str:
    """`text` with a few words misspelt (a swapped, dropped or doubled letter)."""
    words = text.split(" ")
    for i in rng.sample(range(len(words)), min(4, len(words))):
        w = words[i]
        if len(w) < 5 or not w.isalpha():
            continue
        j = rng.randrange(1, len(w) - 2)
        words[i] = rng.choice([w[:j] + w[j + 1] + w[j] + w[j + 2:], w[:j] + w[j + 1:], w[:j] + w[j] + w[j:]])
    return " ".join(words)


def _code_prompts(recs: list[dict], rng: random.Random) -> list[tuple]:
    out = []
    seen_code = set()
    for r in recs:
        code, name = r["code"], r["name"].split(".")[-1]
        if not name:
            continue
        n_lines = code.count("\n") + 1
        if (6 <= n_lines <= 35 and len(code) <= 1000 and code not in seen_code and not name.startswith("test")
                and "NotImplementedError" not in code):
            seen_code.add(code)
            form = rng.choice(CODE_FORMS).format(pkg=r["pkg"], lang=rng.choice(LANGS))
            out.append(("code-pkg", f"{form}\n\n```python\n{code}\n```"))
        summary = _summary(r["doc"], task=True)
        if summary and not name.startswith("_"):
            header = r["header"]
            if rng.random() < 0.4 and len(header) <= 200 and header.count("\n") <= 3 and header.startswith(("def ", "async def ")):
                out.append(("code-spec", f'Complete this Python function:\n\n```python\n{header}\n    """{summary}"""\n```'))
            else:
                out.append(("code-spec", rng.choice(SPEC_FORMS).format(name=name, summary=summary)))
    return out


def _prose_prompts(recs: list[dict], rng: random.Random) -> list[tuple]:
    out = []
    for r in recs:
        for para in _prose_paragraphs(r["doc"]):
            if rng.random() < 0.15:
                out.append(("rewrite", f"{rng.choice(TYPO_FORMS)}\n\n{_typos(para, rng)}"))
            else:
                form = rng.choice(PROSE_FORMS).format(pkg=r["pkg"], human=rng.choice(HUMAN_LANGS))
                out.append(("summarize", f"{form}\n\n{para}"))
    return out


# ---------------------------------------------------------------- math word problems (answers computed)
NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Farid", "Grace", "Hugo", "Isla", "Jon", "Kira", "Leo", "Mia", "Noah",
         "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wen", "Yusuf", "Zoe", "Amara", "Bruno",
         "Carmen", "Dmitri", "Elif", "Felix", "Hana", "Ivan", "Jamal", "Keiko", "Lars", "Malik", "Nadia", "Oscar"]
GOODS = [("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("sandwich", "sandwiches"),
         ("ticket", "tickets"), ("plant", "plants"), ("mug", "mugs"), ("bag of rice", "bags of rice"),
         ("T-shirt", "T-shirts"), ("book", "books"), ("cupcake", "cupcakes"), ("battery", "batteries"),
         ("bottle of juice", "bottles of juice"), ("pack of cards", "packs of cards"), ("candle", "candles")]
PLACES = ["the library", "the market", "school", "the park", "the museum", "the lake", "the station", "the beach",
          "the next town", "the farm", "the stadium", "the airport"]
LEADS = ["Here is a problem from my homework.", "My teacher gave us this one.", "A puzzle from our maths club:",
         "Quick maths check, please.", "I'm stuck on this word problem.", "Can you help me solve this?",
         "This came up while I was planning a trip.", "My little brother asked me this and I'm not sure.",
         "From a practice test:", "I'm revising for an exam. Here is a question.", "Try this one:",
         "A real question from my job today:", "We argued about this at dinner.", "For a school project:",
         "I want to check my answer to this.", "This is from a workbook for adults returning to maths.",
         "Solve this for me, and explain it like a tutor would.", "Here's a brain teaser.",
         "I need this for planning a community event.", "A question from a job interview aptitude test:"]
ASKS = ["", " Show your work.", " Explain step by step.", " Give the final answer on its own line.",
        " Think it through before answering.", " Explain your reasoning briefly."]


def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}".rstrip("0").rstrip(".")


def _math_steps(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    (_g1, g1s), (_g2, g2s) = rng.sample(GOODS, 2)
    k = rng.randrange(6)
    if k == 0:
        x, p, y, q = rng.randint(2, 9), rng.randint(2, 15), rng.randint(2, 9), rng.randint(1, 12)
        total = x * p + y * q
        bill = (total // 10 + 1 + rng.randint(0, 3)) * 10
        return (f"{a} buys {x} {g1s} at ${p} each and {y} {g2s} at ${q} each, and pays with a ${bill} note. "
                f"How much change does {a} get?",
                f"The {g1s} cost {x} x ${p} = ${x * p} and the {g2s} {y} x ${q} = ${y * q}, ${total} in all. "
                f"The change is ${bill} - ${total} = ${bill - total}.")
    if k == 1:
        s, e, sp, w = rng.randint(10, 200), rng.randint(15, 60), rng.randint(5, 14), rng.randint(3, 12)
        return (f"{a} has ${s} saved. Each week {a} earns ${e} from a paper round and spends ${sp}. "
                f"How much will {a} have after {w} weeks?",
                f"Each week {a} keeps ${e} - ${sp} = ${e - sp}. In {w} weeks that is {w} x ${e - sp} = "
                f"${w * (e - sp)}, so {a} will have ${s} + ${w * (e - sp)} = ${s + w * (e - sp)}.")
    if k == 2:
        start, mon, deliv = rng.randint(80, 300), rng.randint(10, 60), rng.randint(20, 100)
        left = start - mon + deliv
        left += left % 2
        start = left + mon - deliv
        return (f"A shop starts the week with {start} {g1s}. It sells {mon} on Monday, receives a delivery of "
                f"{deliv} on Tuesday, and sells half of what it has on Wednesday. How many {g1s} are left?",
                f"After Monday: {start} - {mon} = {start - mon}. After the delivery: {start - mon} + {deliv} = "
                f"{left}. Half of that is sold, leaving {left} / 2 = {left // 2}.")
    if k == 3:
        rows, seats, broken, sold = rng.randint(8, 30), rng.randint(10, 25), rng.randint(1, 9), 0
        sold = rng.randint(rows * seats // 3, rows * seats - broken)
        return (f"A theatre has {rows} rows of {seats} seats. {broken} seats are broken, and {sold} tickets have "
                f"been sold. How many working seats are still free?",
                f"There are {rows} x {seats} = {rows * seats} seats, {rows * seats - broken} of them working. "
                f"Free working seats: {rows * seats - broken} - {sold} = {rows * seats - broken - sold}.")
    if k == 4:
        young, mult, yrs = rng.randint(3, 15), rng.randint(2, 5), rng.randint(2, 10)
        old = young * mult
        return (f"{a} is {mult} times as old as {b}. In {yrs} years their ages will add up to "
                f"{old + young + 2 * yrs}. How old is each of them now?",
                f"Let {b}'s age be x, so {a} is {mult}x. In {yrs} years: x + {yrs} + {mult}x + {yrs} = "
                f"{old + young + 2 * yrs}, so {mult + 1}x = {old + young}, x = {young}. {b} is {young} and {a} is {old}.")
    per, people, extra = rng.randint(2, 6), rng.randint(3, 12), rng.randint(1, 5)
    packs = rng.choice([4, 6, 8, 10])
    need = per * people + extra
    n_packs = -(-need // packs)
    return (f"{a} is planning a party for {people} guests. Each guest gets {per} {g1s}, and {a} wants {extra} spare. "
            f"{g1s.capitalize()} come in packs of {packs}. How many packs should {a} buy?",
            f"{a} needs {per} x {people} + {extra} = {need} {g1s}. {need} / {packs} = {_n(need / packs)}, so "
            f"{a} must buy {n_packs} packs ({n_packs * packs - need} left over).")


def _math_rate(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    k = rng.randrange(9)
    if k == 5:
        ppm, copies, pages = rng.randint(10, 60), rng.randint(5, 40), rng.randint(4, 30)
        return (f"An office printer prints {ppm} pages per minute. How long does it take to print {copies} copies of a "
                f"{pages}-page report?",
                f"{copies} x {pages} = {copies * pages} pages; {copies * pages} / {ppm} = "
                f"{_n(round(copies * pages / ppm, 2))} minutes.")
    if k == 6:
        v1, v2 = rng.choice([(10, 15), (12, 20), (20, 30), (30, 60), (40, 60), (15, 30), (24, 40)])
        return (f"{a} cycles to {rng.choice(PLACES)} at {v1} km/h and comes back the same way at {v2} km/h. What is "
                f"the average speed for the whole round trip?",
                f"For a distance d each way the time is d/{v1} + d/{v2}, so the average is 2 / (1/{v1} + 1/{v2}) = "
                f"{_n(round(2 * v1 * v2 / (v1 + v2), 2))} km/h, not the mean of the two speeds.")
    if k == 7:
        r, h, d, target = rng.randint(20, 200), rng.randint(6, 16), rng.randint(4, 7), rng.randint(10, 200) * 100
        g = rng.choice(GOODS)[1]
        return (f"A factory makes {r} {g} an hour. It runs {h} hours a day, {d} days a week. How many {g} does it make "
                f"in a week, and how many weeks does an order of {target} take?",
                f"Per week: {r} x {h} x {d} = {r * h * d}. {target} / {r * h * d} = {_n(round(target / (r * h * d), 2))}, "
                f"so {-(-target // (r * h * d))} weeks.")
    if k == 8:
        w, h, t = rng.randint(12, 45), rng.randint(8, 40), rng.randint(5, 80) * 100
        return (f"{a} earns ${w} an hour and works {h} hours a week. How many weeks will it take to earn ${t}?",
                f"{a} earns {w} x {h} = ${w * h} a week; {t} / {w * h} = {_n(round(t / (w * h), 2))}, so "
                f"{-(-t // (w * h))} weeks.")
    if k == 0:
        v, t = rng.randint(4, 24) * 5, rng.choice([1.5, 2, 2.5, 3, 4, 0.5])
        return (f"{a} drives to {rng.choice(PLACES)} at an average speed of {v} km/h and the trip takes {_n(t)} hours. "
                f"How far is it, and how long would the trip take at {v + 10} km/h?",
                f"Distance = {v} x {_n(t)} = {_n(v * t)} km. At {v + 10} km/h it takes {_n(v * t)} / {v + 10} = "
                f"{_n(round(v * t / (v + 10), 2))} hours.")
    if k == 1:
        ta, tb = rng.choice([(2, 3), (3, 6), (4, 12), (6, 3), (5, 20), (10, 15), (4, 6)])
        return (f"{a} can paint a fence in {ta} hours and {b} can paint it in {tb} hours. How long does it take if "
                f"they work together?",
                f"Per hour {a} paints 1/{ta} and {b} 1/{tb} of the fence, together {_n(1 / ta + 1 / tb)}. "
                f"The time is 1 / (1/{ta} + 1/{tb}) = {_n(round(ta * tb / (ta + tb), 2))} hours.")
    if k == 2:
        fill, drain = rng.choice([(3, 6), (4, 12), (2, 6), (5, 20), (6, 9)])
        return (f"One pipe fills a tank in {fill} hours; a drain empties it in {drain} hours. If both are open, how "
                f"long does it take to fill the empty tank?",
                f"Net rate: 1/{fill} - 1/{drain} = {_n(round(1 / fill - 1 / drain, 4))} of the tank per hour, so it "
                f"fills in {_n(round(fill * drain / (drain - fill), 2))} hours.")
    if k == 3:
        w, t, m = rng.randint(30, 90), rng.randint(5, 40), rng.randint(200, 3000)
        return (f"{a} types {w} words per minute. How long will it take to type a {m}-word essay, and how many "
                f"words can {a} type in {t} minutes?",
                f"{m} / {w} = {_n(round(m / w, 2))} minutes for the essay; in {t} minutes {a} types {w} x {t} = {w * t} words.")
    litres, km = rng.randint(30, 60), rng.randint(4, 12) * 100
    return (f"A car uses {litres} litres of fuel to travel {km} km. How much fuel does it need for "
            f"{km // 2 + 150} km, and what is its consumption per 100 km?",
            f"It uses {litres} / {km} = {_n(round(litres / km, 4))} litres per km, so {km // 2 + 150} km needs "
            f"{_n(round(litres / km * (km // 2 + 150), 2))} litres; per 100 km: {_n(round(litres / km * 100, 2))} litres.")


def _math_percent(rng: random.Random) -> tuple[str, str]:
    a = rng.choice(NAMES)
    g, _gs = rng.choice(GOODS)
    k = rng.randrange(10)
    if k == 6:
        p, u, d = rng.randint(4, 40) * 10, rng.choice([10, 20, 25, 50]), rng.choice([10, 20, 25, 50])
        final = p * (1 + u / 100) * (1 - d / 100)
        return (f"A {g} costs ${p}. Its price goes up by {u}% and later comes down by {d}%. What is the final price, "
                f"and is it more or less than at first?",
                f"${p} x {_n(1 + u / 100)} = ${_n(p * (1 + u / 100))}, then x {_n(1 - d / 100)} = ${final:.2f}, "
                f"{'more' if final > p else 'less' if final < p else 'the same as'} than ${p}.")
    if k == 7:
        t = rng.choice([20, 25, 40, 50, 60, 80])
        c = rng.randint(t // 2, t)
        return (f"{a} got {c} out of {t} questions right on a test. What percentage is that?",
                f"{c} / {t} = {_n(c / t)}, which is {_n(100 * c / t)}%.")
    if k == 8:
        pop, r, y = rng.randint(20, 900) * 100, rng.choice([1, 2, 3, 4, 5]), rng.randint(2, 6)
        return (f"A town has {pop} people and its population grows by {r}% a year. About how many people will live "
                f"there in {y} years?",
                f"{pop} x {_n(1 + r / 100)}^{y} = {pop * (1 + r / 100) ** y:.0f} people.")
    if k == 9:
        orig, d = rng.randint(4, 60) * 5, rng.choice([10, 20, 25, 40, 50])
        return (f"After a {d}% discount, {a} paid ${_n(orig * (100 - d) / 100)} for a {g}. What was the original price?",
                f"${_n(orig * (100 - d) / 100)} is {100 - d}% of the original, so it was "
                f"${_n(orig * (100 - d) / 100)} / {_n((100 - d) / 100)} = ${orig}.")
    if k == 0:
        p, d = rng.randint(4, 40) * 5, rng.choice([10, 15, 20, 25, 30, 40, 50])
        return (f"A {g} costs ${p}. It is on sale for {d}% off. What is the sale price?",
                f"The discount is {d}% of ${p} = ${_n(p * d / 100)}, so the price is ${_n(p - p * d / 100)}.")
    if k == 1:
        p, t = rng.randint(10, 200), rng.choice([5, 7, 8, 10, 12, 20])
        return (f"{a} buys a {g} for ${p} before tax. The sales tax is {t}%. What is the total?",
                f"Tax: {t}% of ${p} = ${_n(p * t / 100)}. Total: ${_n(p + p * t / 100)}.")
    if k == 2:
        old, new = rng.randint(20, 200), 0
        new = old + rng.choice([-1, 1]) * old * rng.choice([10, 20, 25, 50]) // 100
        return (f"Last year a club had {old} members; this year it has {new}. By what percentage did membership change?",
                f"The change is {new} - {old} = {new - old}; {new - old} / {old} = {_n(100 * (new - old) / old)}%.")
    if k == 3:
        n, pct = rng.choice([20, 25, 40, 50, 80, 120, 200]), rng.choice([15, 25, 30, 35, 45, 60, 75])
        return (f"In a class of {n} students, {pct}% walk to school. How many students do not walk?",
                f"{pct}% of {n} = {_n(n * pct / 100)} walk, so {_n(n - n * pct / 100)} do not.")
    if k == 4:
        p, r, y = rng.choice([500, 1000, 1500, 2000, 5000]), rng.choice([2, 3, 4, 5, 6]), rng.randint(2, 5)
        comp = p * (1 + r / 100) ** y
        return (f"{a} invests ${p} at {r}% interest per year. How much is there after {y} years with simple interest, "
                f"and with interest compounded yearly?",
                f"Simple: ${p} + {y} x {r}% x ${p} = ${_n(p + p * r * y / 100)}. Compound: ${p} x {_n(1 + r / 100)}^{y} "
                f"= ${comp:.2f}.")
    bill, tip, people = rng.randint(40, 300), rng.choice([10, 15, 18, 20]), rng.randint(2, 8)
    total = bill * (1 + tip / 100)
    return (f"{people} friends share a restaurant bill of ${bill} and add a {tip}% tip. How much does each pay?",
            f"The tip is ${_n(bill * tip / 100)}, the total ${_n(total)}, and each pays ${total / people:.2f}.")


TRIPLES = [(3, 4, 5), (5, 12, 13), (6, 8, 10), (8, 15, 17), (9, 12, 15), (7, 24, 25), (12, 16, 20), (20, 21, 29)]


def _math_geometry(rng: random.Random) -> tuple[str, str]:
    a = rng.choice(NAMES)
    k = rng.randrange(10)
    if k == 6:
        side = rng.randint(2, 40)
        return (f"A square has a perimeter of {4 * side} cm. What are its area and the length of its diagonal?",
                f"Each side is {4 * side} / 4 = {side} cm, the area {side * side} cm^2 and the diagonal "
                f"{side} x sqrt(2) = {side * 2 ** 0.5:.2f} cm.")
    if k == 7:
        r, h = rng.randint(1, 5), rng.randint(1, 6)
        return (f"A cylindrical water tank has a radius of {r} m and a height of {h} m. How many litres does it hold? "
                f"Use pi = 3.14.",
                f"Volume = 3.14 x {r}^2 x {h} = {_n(round(3.14 * r * r * h, 2))} m^3 = "
                f"{_n(round(3140 * r * r * h))} litres.")
    if k == 8:
        length, width, t = rng.randint(2, 9), rng.randint(2, 7), rng.choice([20, 25, 50])
        return (f"A room is {length} m by {width} m. How many square tiles of {t} cm by {t} cm are needed to cover "
                f"the floor?",
                f"Each metre takes {100 // t} tiles, so {length * 100 // t} x {width * 100 // t} = "
                f"{(length * 100 // t) * (width * 100 // t)} tiles.")
    if k == 9:
        side = rng.randint(2, 30) * 2
        return (f"A circle just fits inside a square with sides of {side} cm. What is the area of the square outside "
                f"the circle? Use pi = 3.14.",
                f"The square is {side * side} cm^2, the circle (radius {side // 2}) 3.14 x {side // 2}^2 = "
                f"{_n(round(3.14 * (side // 2) ** 2, 2))} cm^2; the difference is "
                f"{_n(round(side * side - 3.14 * (side // 2) ** 2, 2))} cm^2.")
    if k == 0:
        w, h, c = rng.randint(5, 40), rng.randint(5, 30), rng.randint(3, 15)
        return (f"{a}'s garden is a rectangle {w} m long and {h} m wide. Fencing costs ${c} per metre. What is the "
                f"garden's area, and how much does it cost to fence it?",
                f"Area = {w} x {h} = {w * h} m^2. Perimeter = 2 x ({w} + {h}) = {2 * (w + h)} m, costing "
                f"{2 * (w + h)} x ${c} = ${2 * (w + h) * c}.")
    if k == 1:
        r = rng.randint(2, 30)
        return (f"A circular pond has a radius of {r} m. What are its area and circumference? Use pi = 3.14.",
                f"Area = 3.14 x {r}^2 = {_n(round(3.14 * r * r, 2))} m^2; circumference = 2 x 3.14 x {r} = "
                f"{_n(round(6.28 * r, 2))} m.")
    if k == 2:
        f = rng.randint(1, 4)
        x, y, z = (m * f for m in rng.choice(TRIPLES))
        return (f"A ladder leans against a wall. Its foot is {x} m from the wall and it reaches {y} m up the wall. "
                f"How long is the ladder?",
                f"By Pythagoras: sqrt({x}^2 + {y}^2) = sqrt({x * x + y * y}) = {z} m.")
    if k == 3:
        l, w, h = rng.randint(2, 20), rng.randint(2, 15), rng.randint(2, 12)
        return (f"A box is {l} cm long, {w} cm wide and {h} cm high. What are its volume and surface area?",
                f"Volume = {l} x {w} x {h} = {l * w * h} cm^3. Surface = 2 x ({l * w} + {l * h} + {w * h}) = "
                f"{2 * (l * w + l * h + w * h)} cm^2.")
    if k == 4:
        b, h = rng.randint(2, 30) * 2, rng.randint(3, 25)
        return (f"A triangular sail has a base of {b} m and a height of {h} m. What is its area?",
                f"Area = 1/2 x {b} x {h} = {b * h // 2} m^2.")
    l, w, h, cov = rng.randint(3, 8), rng.randint(3, 6), rng.choice([2.4, 2.5, 2.7, 3]), rng.choice([8, 10, 12])
    walls = 2 * (l + w) * h
    return (f"{a} wants to paint the four walls of a room {l} m by {w} m with a {_n(h)} m high ceiling. One litre of "
            f"paint covers {cov} m^2. How many litres are needed for two coats?",
            f"Wall area = 2 x ({l} + {w}) x {_n(h)} = {_n(walls)} m^2; two coats: {_n(2 * walls)} m^2; "
            f"{_n(2 * walls)} / {cov} = {_n(round(2 * walls / cov, 2))} litres.")


UNITS = [("kilometres", "miles", 0.621371), ("miles", "kilometres", 1.609344), ("kilograms", "pounds", 2.20462),
         ("pounds", "kilograms", 0.453592), ("litres", "US gallons", 0.264172), ("inches", "centimetres", 2.54),
         ("metres", "feet", 3.28084), ("cups", "millilitres", 236.588), ("ounces", "grams", 28.3495)]


def _math_units(rng: random.Random) -> tuple[str, str]:
    a = rng.choice(NAMES)
    k = rng.randrange(8)
    if k == 4:
        x = rng.randint(2, 30)
        return (f"{a} ran {x} miles this week. How many kilometres and how many metres is that?",
                f"{x} x 1.609344 = {x * 1.609344:.2f} km = {x * 1609.344:.0f} m.")
    if k == 5:
        kg, rate = rng.randint(1, 40), rng.choice([2, 3, 4, 5])
        return (f"Shipping costs ${rate} per pound. What does it cost to ship a {kg} kg parcel?",
                f"{kg} kg x 2.20462 = {kg * 2.20462:.2f} lb, costing {kg * 2.20462:.2f} x ${rate} = ${kg * 2.20462 * rate:.2f}.")
    if k == 6:
        f = rng.randint(25, 95) * 5
        return (f"An old recipe says to bake at {f} degrees Fahrenheit. What oven setting is that in Celsius?",
                f"C = (F - 32) x 5/9 = ({f} - 32) x 5/9 = {(f - 32) * 5 / 9:.1f} degrees Celsius.")
    if k == 7:
        mpg = rng.randint(18, 60)
        return (f"{a}'s car does {mpg} miles per US gallon. What is that in litres per 100 km?",
                f"L/100 km = 235.215 / mpg = 235.215 / {mpg} = {235.215 / mpg:.2f}.")
    if k == 0:
        src, dst, f = rng.choice(UNITS)
        x = rng.randint(2, 250)
        return (f"Convert {x} {src} to {dst}.", f"The factor is {f} {dst} per unit, so {x} {src} = {x} x {f} = {x * f:.2f} {dst}.")
    if k == 1:
        c = rng.randint(-30, 45)
        return (f"The forecast says {c} degrees Celsius. What is that in Fahrenheit, and would {a} need a coat?",
                f"F = C x 9/5 + 32 = {c} x 1.8 + 32 = {_n(c * 1.8 + 32)} degrees Fahrenheit.")
    if k == 2:
        v = rng.randint(2, 30) * 5
        return (f"A train travels at {v} km/h. What is that in metres per second?",
                f"{v} km/h = {v} x 1000 m / 3600 s = {v / 3.6:.2f} m/s.")
    mins = rng.randint(70, 1000)
    return (f"{a}'s playlist lasts {mins} minutes. How many hours and minutes is that, and how many seconds?",
            f"{mins} = {mins // 60} x 60 + {mins % 60}, so {mins // 60} h {mins % 60} min, or {mins * 60} seconds.")


def _math_stats(rng: random.Random) -> tuple[str, str]:
    a = rng.choice(NAMES)
    k = rng.randrange(4)
    if k in (0, 1):
        xs = [rng.randint(40, 100) for _ in range(rng.choice([5, 6, 7]))]
        s = sorted(xs)
        med = s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2
        what = "test scores" if k == 0 else "daily step counts (in hundreds)"
        return (f"{a}'s {what} are {', '.join(map(str, xs))}. What are the mean, the median and the range?",
                f"Sum {sum(xs)} / {len(xs)} = mean {sum(xs) / len(xs):.2f}; sorted {s}, median {_n(med)}; range "
                f"{s[-1]} - {s[0]} = {s[-1] - s[0]}.")
    if k == 2:
        r, b = rng.randint(1, 9), rng.randint(1, 9)
        return (f"A bag has {r} red and {b} blue marbles. {a} draws two without looking or replacing. What is the "
                f"probability that both are red?",
                f"P = {r}/{r + b} x {max(r - 1, 0)}/{r + b - 1} = {r * (r - 1)}/{(r + b) * (r + b - 1)}.")
    n, t = rng.randint(3, 9), rng.randint(60, 95)
    cur = [rng.randint(50, 100) for _ in range(n)]
    need = t * (n + 1) - sum(cur)
    return (f"{a} has scored {', '.join(map(str, cur))} on {n} quizzes. What score on the next quiz would make the "
            f"average exactly {t}?",
            f"An average of {t} over {n + 1} quizzes needs {t * (n + 1)} points; {a} has {sum(cur)}, so needs {need}"
            f"{' (not possible out of 100)' if need > 100 else ''}.")


MATH = {"math-steps": _math_steps, "math-rate": _math_rate, "math-percent": _math_percent,
        "math-geometry": _math_geometry, "math-units": _math_units, "math-stats": _math_stats}
MATH_FOLLOW = ["Can you explain the second step in more detail?", "How could I check that this answer is right?",
               "Write a similar problem with different numbers and solve it.",
               "Explain the same solution to a ten-year-old.", "What would change if all the numbers were doubled?",
               "Turn this into a multiple-choice question with four options.", "Is there a faster way to solve it?",
               "What mistake might a student typically make here?"]


# ---------------------------------------------------------------- multi-turn conversations
CODE_FOLLOW = ["Show me an example of calling it.", "Can you write two pytest tests for it?",
               "How would you write it in JavaScript?", "What happens if the input is empty?",
               "Could the code be simpler? Show a simpler version.", "When would I use this in a real project?"]
PROSE_FOLLOW = ["Now explain it to someone who has never programmed.", "Make your summary more formal.",
                "Give a concrete example that illustrates it.", "Turn it into three quiz questions.",
                "Translate your summary into Spanish.", "Shorten it to at most ten words."]
ROLES_V4 = ["a tour guide in Kyoto", "a bicycle mechanic", "a nutritionist", "a chess coach", "a marine biologist",
            "a startup founder", "a high school history teacher", "a bookshop owner", "a car salesperson",
            "a yoga instructor", "a cybersecurity analyst", "a wedding planner", "a beekeeper", "a pilot",
            "an architect", "a personal finance advisor", "a video game designer", "a gardener", "a news anchor",
            "a customer support agent for an internet provider", "a medieval blacksmith", "a science fiction author"]
ROLE_Q_V4 = ["What should a beginner learn first?", "What is the hardest part of your work?",
             "Can you tell me a funny story from your job?", "What tools do you use every day?",
             "How did you get started?", "What would you recommend I try this weekend?",
             "What is a common myth about your field?", "How has your field changed in the last ten years?",
             "Could you explain one technical term from your work?", "What advice would you give your younger self?"]


def _multi_turn(rng: random.Random, recs: list[dict], n_math: int, n_code: int, n_prose: int, n_role: int) -> list[tuple]:
    out = []
    kinds = sorted(MATH)
    for i in range(n_math):
        q, sol = MATH[kinds[i % len(kinds)]](rng)
        out.append(("multi-turn", [("user", q), ("assistant", sol), ("user", rng.choice(MATH_FOLLOW))]))
    documented = [r for r in recs if r["name"] and _summary(r["doc"]) and 6 <= r["code"].count("\n") + 1 <= 25
                  and len(r["code"]) <= 800]
    for r in rng.sample(documented, min(n_code, len(documented))):
        name = r["name"].split(".")[-1]
        q = f"What does `{name}` from `{r['pkg']}` do?\n\n```python\n{r['code']}\n```"
        out.append(("multi-turn", [("user", q), ("assistant", _summary(r["doc"])), ("user", rng.choice(CODE_FOLLOW))]))
    paras = [(r["pkg"], p) for r in recs for p in _prose_paragraphs(r["doc"])]
    for pkg, para in rng.sample(paras, min(n_prose, len(paras))):
        first = re.split(r"(?<=\.)\s", para, maxsplit=1)[0]
        q = f"Summarize this passage from the `{pkg}` documentation in one sentence:\n\n{para}"
        out.append(("multi-turn", [("user", q), ("assistant", first), ("user", rng.choice(PROSE_FOLLOW))]))
    for _ in range(n_role):
        role = rng.choice(ROLES_V4)
        q1, q2 = rng.sample(ROLE_Q_V4, 2)
        greet = rng.choice([f"Of course! I'm {role}. What would you like to know?",
                            f"Hello! As {role}, I'm happy to help. Ask me anything.",
                            f"Sure, I'll answer as {role}. Go ahead."])
        out.append(("multi-turn", [("user", f"Pretend you are {role} and stay in character. {q1}"), ("assistant", greet),
                                   ("user", q2)] if rng.random() < 0.5 else
                    [("user", f"Pretend you are {role} and stay in character."), ("assistant", greet), ("user", q1)]))
    return out


# ---------------------------------------------------------------- explanations and templated rewriting
TOPICS_V4 = ["vaccination schedules", "the Krebs cycle", "ocean acidification", "the Doppler effect", "entropy",
             "the Monty Hall problem", "Bayes' theorem", "public key cryptography", "garbage collection",
             "TCP handshakes", "the CAP theorem", "gradient descent", "overfitting", "photosynthesis in cacti",
             "the Treaty of Westphalia", "the Meiji Restoration", "the Apollo program", "monsoons", "glaciers",
             "fermentation", "the placebo effect", "opportunity cost", "comparative advantage", "index funds",
             "mortgages", "the golden ratio", "fractals", "prime factorisation", "matrix multiplication",
             "regular expressions", "recursion in everyday life", "caching", "load balancing", "containers",
             "unit conversion", "the metric system", "time zones", "leap years", "the periodic table",
             "chemical bonds", "the speed of light", "sound waves", "the Fibonacci sequence", "solar panels",
             "wind turbines", "electric cars", "bees and pollination", "food chains", "the nitrogen cycle",
             "soil erosion", "the Great Barrier Reef", "the Byzantine Empire", "the Magna Carta", "the Enlightenment",
             "impressionism", "the sonnet", "haiku", "supply chains", "inflation targeting", "credit scores",
             "the scientific peer review process", "open source software", "the history of the bicycle",
             "how vaccines are tested", "how maps are made", "how elevators work", "how refrigerators work",
             "how search engines rank pages", "how GPS works", "how a bill becomes law", "how bread rises"]
EXPLAIN_V4 = ["Explain {t} in simple terms, then give one real-world example.", "What are three surprising facts about {t}?",
              "Write a one-paragraph explanation of {t} for a school newsletter.",
              "Describe {t} as a sequence of numbered steps.", "What would happen in a world without {t}?",
              "Give a short history of {t} and why it matters today.", "Explain {t} with a metaphor a child would get.",
              "What are the main arguments for and against {t}?", "Create a study guide for {t} with five key points.",
              "Explain {t}, then ask me two questions to check my understanding."]
MESSAGES = ["hi {b}, cant make it to the meeting on {day}, something came up. can we do {day2} instead? thx {a}",
            "Dear {b}, I am writing to complain that my order of {gs} arrived late and two were broken. {a}",
            "{b} - the report is done but I still need the numbers from {place}. Send them by {day}? {a}",
            "Hey {b}! Thanks so much for the {gs} you brought on {day}, everyone loved them. See you soon, {a}",
            "To all staff: {place} will be closed on {day} for repairs. Please use the side entrance. {a}",
            "{b}, reminder that rent is due on {day}. Let me know if there is a problem. Thanks, {a}"]
REWRITE_FORMS = ["Rewrite this message in a formal tone:", "Make this message friendlier:",
                 "Shorten this message to one sentence:", "Turn this message into a polite text message:",
                 "Rewrite this message so a child could understand it:", "Fix the grammar and punctuation of this message:",
                 "Write a reply to this message:", "Rewrite this message as a short poem:"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _explain_prompts(rng: random.Random) -> list[tuple]:
    out = []
    for t in TOPICS_V4:
        out += [("explain", f.format(t=t)) for f in rng.sample(EXPLAIN_V4, 8)]
    return out


def _rewrite_prompts(rng: random.Random, n: int) -> list[tuple]:
    out = []
    for _ in range(n):
        a, b = rng.sample(NAMES, 2)
        d1, d2 = rng.sample(DAYS, 2)
        msg = rng.choice(MESSAGES).format(a=a, b=b, day=d1, day2=d2, gs=rng.choice(GOODS)[1], place=rng.choice(PLACES))
        out.append(("rewrite", f"{rng.choice(REWRITE_FORMS)}\n\n{msg}"))
    return out


# ---------------------------------------------------------------- the pool
def pool_v4(seed: int) -> list[tuple]:
    """(source, prompt text or [(role, text), ...]) in a fixed seeded order; each source has its own stream."""
    recs = package_records()

    def rng(name):
        return random.Random(f"{seed}-v4-{name}")  # str seeds hash with SHA-512: no hash randomization

    pool = _code_prompts(recs, rng("code")) + _prose_prompts(recs, rng("prose"))
    m = rng("math")
    for kind in sorted(MATH):
        for _ in range(1400):
            q, _sol = MATH[kind](m)
            lead = m.choice(LEADS) + " " if m.random() < 0.7 else ""
            pool.append((kind, lead + q + m.choice(ASKS)))
    pool += _multi_turn(rng("multi"), recs, n_math=1200, n_code=700, n_prose=500, n_role=1000)
    pool += _explain_prompts(rng("explain")) + _rewrite_prompts(rng("rewrite"), 1300)
    rng("order").shuffle(pool)
    return pool


def conversation_text(item) -> str:
    return item if isinstance(item, str) else "\n\n".join(text for _, text in item)


class NearDupIndex:
    """8-word shingles of the prompts kept so far: a new prompt is a near duplicate when one earlier prompt
    holds NEAR_DUP of its shingles. Exact, and fast: an earlier prompt that holds `need` of a prompt's n
    shingles holds one of any n - need + 1 of them, so only the owners of its rarest ones are compared."""

    def __init__(self, shingle_fn):
        self.shingles, self.owners, self.sets = shingle_fn, {}, {}

    def add(self, i: int, text: str) -> None:
        sh = self.sets[i] = self.shingles(text)
        for s in sh:
            self.owners.setdefault(s, []).append(i)

    def is_near_dup(self, text: str) -> bool:
        sh = self.shingles(text)
        need = math.ceil(NEAR_DUP * len(sh))
        if not sh:
            return False
        rare = sorted((len(self.owners.get(s, ())), s) for s in sh)[:len(sh) - need + 1]
        return any(len(sh & self.sets[j]) >= need for j in {j for _, s in rare for j in self.owners.get(s, ())})
