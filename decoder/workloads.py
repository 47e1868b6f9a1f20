"""Prompt workloads that need no download.

Built in (present on every Python install):

- ``prose``: English technical prose, docstrings of the standard library (read with ``ast``);
- ``code``: Python source, the opening of functions from standard-library modules;
- ``math``: grade-school word problems (GSM8K when present, else generated from templates);
- ``extract``: copy-heavy chat requests: reproduce a given passage.

Each has hundreds to thousands of distinct prompts, so a demo phase never repeats one.

From ``../shared/data`` when present (never copied into the repository): ``gsm8k``
(``gsm8k_test.jsonl``) and ``humaneval`` (``humaneval.jsonl.gz``). Any JSONL file of
``{"prompt": ..., "workload": ...}`` rows loads with :func:`load_jsonl`.
"""

from __future__ import annotations

import ast
import functools
import gzip
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

from store.schema import check_workload


@dataclass(frozen=True)
class Prompt:
    """A prompt; ``chat`` wraps it in the model's chat template (questions), else it is
    continued as raw text (prose, code)."""

    workload: str
    text: str
    chat: bool = False

    def token_ids(self, tokenizer) -> list[int]:
        return chat_format(tokenizer, self.text, raw=not self.chat)


_MATH = (
    "Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many apples does he have left?",
    "A train travels 60 miles per hour for 2.5 hours. How far does it travel?",
    "Sara buys 4 notebooks at $3 each and a pen for $2. How much does she spend in total?",
    "A class has 28 students. If 3/4 of them passed the test, how many students passed?",
    "A rectangle is 8 cm long and 5 cm wide. What is its area and its perimeter?",
    "Mike reads 15 pages a day. How many days does he need to finish a 210-page book?",
    "A shop sells pencils in packs of 6. How many packs are needed for 45 pencils?",
    "Anna saved $120. She spent 25% on a game. How much money does she have now?",
)


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


_SKIP_DIRS = {"test", "tests", "idle_test", "idlelib", "turtledemo", "ensurepip", "lib2to3", "site-packages",
              "__pycache__", "pydoc_data"}


@functools.lru_cache(maxsize=1)
def _stdlib_texts() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(docstrings, (module, function opening source)) read from this Python's own standard
    library with ``ast`` (nothing is imported), each list in a fixed pseudo-random order (seeded),
    so any slice of it is a sample of the whole library, not of its first modules.

    Docstrings: of modules, classes and functions, whitespace-normalised, >= 300 characters,
    mostly words (no doctests). Functions: top-level and methods of >= 12 lines, dedented."""
    import random
    import sysconfig
    import textwrap

    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, dirs, fs in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("config-"))
        files += [Path(d) / f for f in sorted(fs) if f.endswith(".py")]
    docs: dict[str, None] = {}
    fns: dict[str, str] = {}
    for path in files:
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        module = _module_name(root, path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and ">>>" not in doc:
                    text = " ".join(doc.split())
                    words = sum(c.isalpha() or c == " " for c in text)
                    if len(text) >= 300 and words >= 0.85 * len(text):
                        docs.setdefault(text)
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 12:
                body = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.lineno - 1 + 12]))
                fns.setdefault(body, module)
    rng = random.Random(20261203)
    doc_list, fn_list = list(docs), [(m, b) for b, m in fns.items()]
    rng.shuffle(doc_list)
    rng.shuffle(fn_list)
    return tuple(doc_list), tuple(fn_list)


def _cut(text: str, chars: int) -> str:
    return text[:chars].rsplit(" ", 1)[0] if len(text) > chars else text


def prose_prompts(n: int = 8, chars: int = 400) -> list[Prompt]:
    """English technical prose: docstrings of the standard library (even positions of the
    shuffled list; ``extract`` takes the odd ones), cut to ``chars`` at a word. About 600
    distinct prompts, so a phase never repeats one. Not the bootstrap's prose corpus (pydoc
    topics): served prose is text the v0 never saw."""
    docs = _stdlib_texts()[0][0::2]
    return [Prompt("prose", _cut(t, chars)) for t in docs[:n]]


def code_prompts(n: int = 8, lines: int = 12) -> list[Prompt]:
    """Function openings (signature, docstring, first lines; ``lines`` lines at most) from the
    standard library's modules, except the code corpus's (``_CODE_CORPUS_MODULES``), so served
    code is never bootstrap text. About 3,000 distinct prompts in a fixed shuffled order."""
    out = []
    for module, body in _stdlib_texts()[1]:
        if module in _CODE_CORPUS_MODULES:
            continue
        out.append(Prompt("code", "\n".join(body.splitlines()[:lines])))
        if len(out) == n:
            break
    return out


EXTRACT_INSTRUCTIONS = (
    "Copy the following text exactly, word for word:",
    "Repeat this paragraph without changing it:",
    "Rewrite the text below with the same words, keeping every sentence:",
    "Return the following passage unchanged:",
)


def extract_prompts(n: int = 8, chars: int = 300) -> list[Prompt]:
    """A copy-heavy workload, as production sees in extraction and editing requests: a chat
    instruction to reproduce a given passage (a standard-library docstring, odd positions of the
    shuffled list, cut to ``chars``), so the answer copies its input and prompt lookup can
    propose it. About 600 distinct prompts."""
    docs = _stdlib_texts()[0][1::2]
    return [Prompt("extract", f"{EXTRACT_INSTRUCTIONS[i % len(EXTRACT_INSTRUCTIONS)]}\n\n{_cut(t, chars)}", chat=True)
            for i, t in enumerate(docs[:n])]


def shared_data_dir() -> Path | None:
    """``$DRAFTD_SHARED_DATA`` or ``../shared/data`` beside the checkout, if it exists."""
    env = os.environ.get("DRAFTD_SHARED_DATA")
    cands = [Path(env)] if env else []
    here = Path(__file__).resolve().parent.parent
    cands += [here.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    return next((p for p in cands if p.is_dir()), None)


def math_prompts(n: int = 8) -> list[Prompt]:
    """GSM8K questions from ../shared/data when present, else the built-in problems."""
    d = shared_data_dir()
    if d and (d / "gsm8k_test.jsonl").exists():
        rows = []
        with open(d / "gsm8k_test.jsonl", encoding="utf-8") as f:
            for line in f:
                rows.append(Prompt("math", json.loads(line)["question"], chat=True))
                if len(rows) == n:
                    break
        return rows
    out = [Prompt("math", q, chat=True) for q in _MATH[:n]]
    return out + [Prompt("math", q, chat=True) for q in generated_math(n - len(out))]


_NAMES = ("Tom", "Sara", "Mike", "Anna", "Liam", "Priya", "Omar", "Mei", "Lucas", "Zoe", "Ravi", "Elena", "Kofi",
          "Hana", "Diego", "Nora")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "balloons")
_MATH_TEMPLATES = (
    "{a} has {x} {i}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {i} does {a} have now?",
    "{a} buys {x} packs of {i} with {y} {i} in each pack. {a} uses {z} of them. How many {i} are left?",
    "A shop sells {i} at ${p} each. {a} buys {x} and pays with a ${m} bill. How much change does {a} get?",
    "{a} reads {x} pages a day for {y} days, then {z} pages on the last day. How many pages does {a} read in all?",
    "{a} and {b} share {t} {i} so that {a} gets {x} more than {b}. How many {i} does {b} get?",
    "A train travels {x} miles per hour for {y} hours and then {z} miles more. How far does it travel in total?",
    "{a} saves ${x} a week for {y} weeks and spends ${z} on a gift. How much money does {a} have left?",
    "A garden has {x} rows of {y} plants. {z} plants die. How many plants are still growing?",
)


def generated_math(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct grade-school word problems from templates with seeded names and numbers
    (the math workload where GSM8K is absent): thousands before any repeats."""
    import random

    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < max(0, n):
        a, b = rng.sample(_NAMES, 2)
        x, y = rng.randint(3, 60), rng.randint(2, 12)
        z = rng.randint(1, max(1, x * y // 3))
        p = rng.randint(2, 9)
        q = rng.choice(_MATH_TEMPLATES).format(a=a, b=b, i=rng.choice(_ITEMS), x=x, y=y, z=z, p=p,
                                               m=((x * p) // 10 + 1) * 10, t=2 * y + x)
        out.setdefault(q)
    return list(out)


def humaneval_prompts(n: int = 8) -> list[Prompt]:
    d = shared_data_dir()
    if not d or not (d / "humaneval.jsonl.gz").exists():
        return []
    out = []
    with gzip.open(d / "humaneval.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            out.append(Prompt("humaneval", json.loads(line)["prompt"]))
            if len(out) == n:
                break
    return out


def load_jsonl(path: str | Path) -> list[Prompt]:
    """Rows ``{"prompt": str, "workload": str (optional, default "default")}``.

    Raises:
        ValueError: an unreadable file, a line that is not UTF-8 JSON, or a row without a non-empty
            string ``prompt`` (names the file and line).
    """
    out = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the JSONL workload file ({e.strerror or e})") from e
    with f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{i}: not UTF-8 ({e}); save the file as UTF-8") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e}); expected {{\"prompt\": ..., \"workload\": ...}}") from e
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{i}: row has no string 'prompt' field")
            if not row["prompt"]:
                raise ValueError(f"{path}:{i}: 'prompt' is empty; a prompt needs at least one character")
            try:
                workload = check_workload(str(row.get("workload", "default")))
            except ValueError as e:
                raise ValueError(f"{path}:{i}: {e}") from e
            out.append(Prompt(workload, row["prompt"]))
    return out


BUILTIN = {"prose": prose_prompts, "code": code_prompts, "math": math_prompts, "extract": extract_prompts,
           "humaneval": humaneval_prompts}


def get_workload(name: str, n: int = 8) -> list[Prompt]:
    """Prompts of a built-in workload, or of a JSONL file path.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    if name in BUILTIN:
        return BUILTIN[name](n)
    if name == "gsm8k":
        return math_prompts(n)
    if Path(name).is_dir():
        raise ValueError(f"workload {name!r} is a directory; give a JSONL file or one of {sorted(BUILTIN)}")
    if Path(name).exists():
        return load_jsonl(name)[:n]
    raise ValueError(f"unknown workload {name!r}: use one of {sorted(BUILTIN)} or a path to a JSONL file")


def chat_format(tokenizer, text: str, raw: bool = False) -> list[int]:
    """Token ids of a user turn in the model's chat template (plain text if it has none)."""
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer(text).input_ids
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


# ---- corpora: whole documents of each workload, for teacher-forced distillation ----------------
# The code corpus is standard-library source of these modules; code_prompts skips them, so code
# prompts (served and evaluated) never appear in it.
_CODE_CORPUS_MODULES = (
    "argparse", "ast", "configparser", "dataclasses", "datetime", "enum", "functools", "gettext",
    "glob", "gzip", "inspect", "logging", "operator", "optparse", "os", "pathlib", "pickle",
    "pprint", "queue", "random", "re._parser", "selectors", "shutil", "smtplib", "socket",
    "subprocess", "tarfile", "tempfile", "threading", "tokenize", "traceback", "typing",
    "urllib.parse", "uuid", "zipfile",
)


def documents(workload: str) -> list[tuple[str, str]]:
    """Whole documents ``(key, text)`` of a built-in workload, in a fixed order.

    - ``prose``: every pydoc topic, whitespace-normalised (the prose prompts are their openings);
    - ``code``: full source of standard-library modules disjoint from the code prompts' modules;
    - ``math``: GSM8K question + worked answer rows from ``../shared/data`` (last rows first, so
      the first rows, which :func:`math_prompts` serves, come last), else nothing.

    Raises:
        ValueError: a workload without a built-in corpus.
    """
    if workload == "prose":
        from pydoc_data.topics import topics

        return [(k, " ".join(topics[k].split())) for k in sorted(topics)]
    if workload == "code":
        import importlib

        out = []
        for name in _CODE_CORPUS_MODULES:
            try:
                out.append((name, inspect.getsource(importlib.import_module(name))))
            except (OSError, TypeError, ImportError):
                continue
        return out
    if workload in ("math", "gsm8k"):
        d = shared_data_dir()
        if not d or not (d / "gsm8k_test.jsonl").exists():
            return []
        with open(d / "gsm8k_test.jsonl", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [(f"gsm8k-{i}", f"{r['question']}\n{r['answer']}") for i, r in reversed(list(enumerate(rows)))]
    raise ValueError(f"no built-in corpus for workload {workload!r}; choose prose, code or math")


EVAL_RESERVED_PROMPTS = 16  # the first prompts of each built-in workload: evaluation only, never in a bootstrap corpus


def bootstrap_documents(workload: str, reserved: int = EVAL_RESERVED_PROMPTS) -> list[tuple[str, str]]:
    """:func:`documents` of ``workload`` without the ones a reserved prompt comes from.

    The demo evaluates on the first prompts of each workload (never served); a draft bootstrapped
    on text that holds them would be judged on text it was trained on. A document is dropped when
    it shares any run of 8 words with any of the first ``reserved`` prompts of ``workload``
    (math: their GSM8K rows; code: a corpus module that a prompt quotes, e.g. ``inspect``, whose
    ``cleandoc`` docstring pydoc's ``_getdoc`` repeats; prose: normally none, the prompts are
    standard-library docstrings and the corpus is pydoc's topics).

    Raises:
        ValueError: a workload without a built-in corpus, or ``reserved`` < 0.
    """
    if reserved < 0:
        raise ValueError(f"reserved={reserved!r}: must be >= 0 prompts")
    docs = documents(workload)
    if not reserved or not docs:
        return docs
    n = 8
    runs = set()
    for p in get_workload(workload, reserved):
        words = p.text.split()
        runs.update(tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1)))

    def shares(text: str) -> bool:
        words = text.split()
        return any(tuple(words[i : i + n]) in runs for i in range(max(1, len(words) - n + 1)))

    return [(k, t) for k, t in docs if not shares(t)]


def split_documents(docs: list[tuple[str, str]], heldout_fraction: float, shingle: int = 12) -> tuple[list, list]:
    """Deterministic (train, held-out) split that keeps shared text on one side.

    Documents that share any run of ``shingle`` words (pydoc's "compound" topic contains "try",
    "with" and "for"; "specialnames" contains "numeric-types") form one group, and a group goes
    to one side whole. Groups are taken in the order of the sha256 of their first key; a group
    joins the held-out side if that keeps it within ``heldout_fraction`` of all characters, else
    it trains. So no held-out text is also training text (up to runs shorter than ``shingle``
    words), and the held-out share stays near the fraction even when one group is large.

    Raises:
        ValueError: ``heldout_fraction`` outside [0, 1] (or NaN), or ``shingle`` < 1.
    """
    import hashlib

    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction!r}: must be in [0, 1] (0.2 holds out 20 % of the characters)")
    if shingle < 1:
        raise ValueError(f"shingle={shingle!r}: must be >= 1 words (12 by default)")

    parent = list(range(len(docs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple, int] = {}
    for i, (_, text) in enumerate(docs):
        words = text.split()
        for j in range(len(words) - shingle + 1):
            o = first.setdefault(tuple(words[j : j + shingle]), i)
            a, b = find(o), find(i)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(len(docs)):
        groups.setdefault(find(i), []).append(i)
    order = sorted(groups.values(), key=lambda m: hashlib.sha256(min(docs[i][0] for i in m).encode("utf-8")).hexdigest())
    budget, held_chars, held_ids = heldout_fraction * sum(len(t) for _, t in docs), 0, set()
    for members in order:
        size = sum(len(docs[i][1]) for i in members)
        if held_chars + size <= budget:
            held_chars += size
            held_ids.update(members)
    train = [d for i, d in enumerate(docs) if i not in held_ids]
    held = [d for i, d in enumerate(docs) if i in held_ids]
    return train, held
