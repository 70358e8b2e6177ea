"""
What the pages of docs/ (and README.md, BENCHMARKS.md) name must exist, and what a test shows
working must not be called unbuilt (issue 26): used by tests/test_docs.py, which runs in CI.

 - a module: an C{llmport_agent/...} path (or C{tests/}, C{bench/}, C{deploy/}, C{packaging/},
   C{docs/} path), a dotted C{llmport_agent.x.y} name (a module, or an attribute of one), a
   C{name.py} in code that no file of the repository has;
 - a command or option of C{llmport-agent} (from the argument parsers: the main one, doctor,
   demo, devbackend and its admin verbs), where a command line starts with it;
 - an C{LLM_PORT_NODE_AGENT_*} variable that is not a setting;
 - a sentence that says "not built", "not yet built", "not available", "refused", "not
   shipped", ... of a feature in L{WORKING}, each of which names the test that shows it works.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
from collections.abc import Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pages() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    found = sorted(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md"))
    return found + [os.path.join(ROOT, n) for n in ("README.md", "BENCHMARKS.md") if os.path.exists(os.path.join(ROOT, n))]


# -- modules and paths -------------------------------------------------------------------------

_PATH = re.compile(r"(?<![\w/.-])((?:llmport_agent|tests|bench|deploy|packaging|docs|twisted)/[A-Za-z0-9_./-]*)")
_DOTTED = re.compile(r"(?<![\w.])(llmport_agent(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
_PY_IN_CODE = re.compile(r"(?<![\w./-])([A-Za-z0-9_]+\.py)(?![\w/])")


def _repo_basenames() -> set[str]:
    names: set[str] = set()
    for top in ("llmport_agent", "tests", "bench", "packaging", "docs", "twisted"):
        for _dir, _dirs, files in os.walk(os.path.join(ROOT, top)):
            names.update(files)
    return names


def path_problems(where: str, text: str) -> list[str]:
    problems = []
    # Paths are named in code (prose says "a deploy/start" of commands); an indented line may be
    # a list item's prose, so there only a path to a file (name.ext) or a directory (dir/) counts.
    strict = "\n".join(_code(text, indented=False))
    loose = "\n".join(line for line in text.splitlines() if line.startswith("    "))
    candidates = [(m, strict) for m in _PATH.finditer(strict)]
    candidates += [(m, loose) for m in _PATH.finditer(loose)
                   if m.group(1).endswith("/") or "." in m.group(1).rstrip(".,;:").rsplit("/", 1)[-1]]
    code = strict + "\n" + loose
    for m, where_found in candidates:
        path = m.group(1).rstrip(".,;:")
        following = where_found[m.end():m.end() + 1]
        if following and following in "<>*{}$" or path.startswith("docs/_build"):
            continue
        if not os.path.exists(os.path.join(ROOT, path)):
            problems.append(f"{where}: {path} does not exist")
    basenames = _repo_basenames()
    for m in _PY_IN_CODE.finditer(code):
        name = m.group(1)
        if name not in basenames:
            problems.append(f"{where}: {name} is no file of the repository")
    return problems


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _source_strings() -> str:
    chunks = []
    for directory, _dirs, files in os.walk(os.path.join(ROOT, "llmport_agent")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    chunks.append(f.read())
    return "\n".join(chunks)


def dotted_problems(where: str, text: str, source: str = "") -> list[str]:
    """A dotted name is a module, an attribute of one, or a name the code spells (a log namespace)."""
    out = []
    for m in _DOTTED.finditer(text):
        name = m.group(1).rstrip(".")
        if not _resolves(name) and f'"{name}"' not in source:
            out.append(f"{where}: {name} is no module or attribute")
    return out


# -- the command line --------------------------------------------------------------------------


def cli_options() -> dict[str, set[str]]:
    """Command (as typed after llmport-agent; "" is `run` implied) -> the options it accepts."""
    from llmport_agent.cli import build_parser
    from llmport_agent.demo.run import build_parser as demo_parser
    from llmport_agent.devbackend.cli import ADMIN_VERBS, admin_parser
    from llmport_agent.devbackend.cli import build_parser as devbackend_parser
    from llmport_agent.doctor.run import build_parser as doctor_parser

    def options(parser: argparse.ArgumentParser) -> set[str]:
        return {o for a in parser._actions for o in a.option_strings}

    main = build_parser()
    out: dict[str, set[str]] = {}
    for action in main._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = options(sub)
    out["doctor"], out["demo"], out["devbackend"] = options(doctor_parser()), options(demo_parser()), options(devbackend_parser())
    for verb in ADMIN_VERBS:
        out[f"devbackend {verb}"] = options(admin_parser(verb))
    out[""] = options(main) | out["run"]
    return out


#: `llmport-agent ...` where a command line starts: at the start of a code span or line, after
#: sudo (and its options), variable assignments or a shell separator; the executable may be
#: named by its path.
_COMMAND = re.compile(
    r"(?:^|[;&|(]\s*|\bsudo\s+(?:-\S+\s+)*)(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:[\w./-]*/)?llmport-agent((?:[ \t]+[^\s;&|#`]+)*)",
    re.M,
)


def _code(text: str, indented: bool = True) -> Iterable[str]:
    """
    Inline code spans and the lines of fenced code blocks, and (C{indented}) of lines indented
    by four spaces (code blocks, but also the continuation of a list item).
    """
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or indented and line.startswith("    "):
            yield line.strip()
    for m in re.finditer(r"`([^`\n]+)`", text):
        yield m.group(1)


#: `llmport-agent stopped and disabled ...`: the agent's own output quoted, not a command line.
_OUTPUT_WORDS = frozenset({"stopped", "started", "is", "was", "has", "runs"})


def cli_problems(where: str, text: str, known: dict[str, set[str]]) -> list[str]:
    problems = []
    for code in _code(text):
        for m in _COMMAND.finditer(code):
            try:
                words = shlex.split(m.group(1), comments=True)
            except ValueError:
                words = m.group(1).split()
            words = [w.strip("[]") for w in words]
            command = ""
            if words and not words[0].startswith("-"):
                first = words[0]
                if first.startswith("<") or first.isupper() or first in ("...", "--") or first in _OUTPUT_WORDS:
                    continue
                alternatives = first.split("|")
                if not all(a in known for a in alternatives):
                    problems.append(f"{where}: `llmport-agent {first}` is no command")
                    continue
                command = alternatives[0]
                words = words[1:]
                if command == "devbackend" and words and f"devbackend {words[0]}" in known:
                    command, words = f"devbackend {words[0]}", words[1:]
            for word in words:
                for option in word.split("/"):
                    option = option.split("=", 1)[0].rstrip(".,;:)")
                    if option.startswith("--") and option not in ("--", "--option") and option not in known[command]:
                        problems.append(f"{where}: `llmport-agent {command or 'run'}` has no option {option}")
    return problems


# -- settings ----------------------------------------------------------------------------------

_SETTING = re.compile(r"\bLLM_PORT_NODE_AGENT_([A-Z0-9_]*)")


def setting_problems(where: str, text: str) -> list[str]:
    from llmport_agent.core.config import SETTINGS

    names = {s.name for s in SETTINGS}
    return [f"{where}: LLM_PORT_NODE_AGENT_{m.group(1)} is no setting"
            for m in _SETTING.finditer(text) if m.group(1) and m.group(1).rstrip("_") not in names]


# -- what a test shows working -----------------------------------------------------------------

_NEGATIVE = r"\s*(\([^)]*\))?\s*(is|are)\s+(refused|not\s+(yet\s+)?(built|available|supported))"

#: A feature a test shows working: (name, claims a page must not make of it (regular expressions
#: over one sentence), the same inside a table row whose first cell names the command (or None),
#: the test (file, a string in it) that shows it working).
WORKING: tuple[tuple[str, tuple[str, ...], tuple[str, str] | None, tuple[str, str]], ...] = (
    ("join --user", (r"join\s+(\[?URL\]?\s+)?\[?--user\]?`?" + _NEGATIVE,),
     (r"\bjoin\b", r"`--user`" + _NEGATIVE), ("tests/test_systemd_sessions.py", '"join", "--user"')),
    ("start --user", (r"start\s+\[?--user\]?`?" + _NEGATIVE,),
     (r"\bstart\b", r"`--user`" + _NEGATIVE), ("tests/test_systemd_sessions.py", '"start", "--user"')),
    ("shipping the logs of adopted containers",
     (r"adopt\w*[^.]{0,120}\b(is|are)\s+not\s+(followed|shipped|read)\b[^.]{0,60}\b(logs?|Loki)\b",
      r"\b(logs?|output)\b[^.]{0,60}\badopt\w*[^.]{0,60}\b(is|are)\s+not\s+(followed|shipped|read)\b"),
     None, ("tests/test_adoption.py", 'loki.lines(job="node-container", runtime_id=rid)')),
    ("a stop or remove ending a readiness wait",
     (r"\b(stop|remove)\w*[^.]{0,80}(?<!not )(?<!never )\b(waits?|queued)\s+behind\b[^.]{0,80}\breadiness",),
     None, ("tests/test_integration_supersede.py", "superseded by remove_workload")),
)


def _units(text: str) -> Iterable[tuple[str, str]]:
    """(first cell of its table row or "", sentence) for every sentence of the page."""
    paragraph: list[str] = []

    def flush() -> Iterable[tuple[str, str]]:
        flat = " ".join(paragraph)
        paragraph.clear()
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`*(])", flat):
            if sentence.strip():
                yield "", sentence
    for line in text.splitlines():
        if line.startswith("|"):
            yield from flush()
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            for cell in cells[1:]:
                for sentence in re.split(r"(?<=[.!?;])\s+", cell):
                    yield cells[0], sentence
        elif not line.strip() or line.startswith("#") or re.match(r"\s*([-*]|\d+\.)\s", line):
            yield from flush()
            if line.strip():
                paragraph.append(re.sub(r"^\s*([-*]|\d+\.)\s|^#+\s", "", line))
        else:
            paragraph.append(line.strip())
    yield from flush()


def claim_problems(where: str, text: str) -> list[str]:
    problems = []
    for first, sentence in _units(text):
        for feature, claims, row, _test in WORKING:
            said = any(re.search(c, sentence, re.I) for c in claims)
            if row is not None and first and re.search(row[0], first) and re.search(row[1], sentence, re.I):
                said = True
            if said:
                problems.append(f"{where}: says {feature} does not work, but a test shows it does: "
                                f"{sentence[:200]!r}")
    return problems


def heading_problems(where: str, text: str) -> list[str]:
    seen: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(#{1,6})\s+(.*\S)", line)
        if m:
            seen[m.group(2)] = seen.get(m.group(2), 0) + 1
    return [f"{where}: the heading {h!r} is there {n} times" for h, n in seen.items() if n > 1]


def architecture_problems(text: str | None = None) -> list[str]:
    """docs/architecture.md (or C{text}) names every module and package of llmport_agent/."""
    if text is None:
        with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
            text = f.read()
    package = os.path.join(ROOT, "llmport_agent")
    out = []
    for name in sorted(os.listdir(package)):
        if name == "__init__.py" or name.startswith(".") or name in ("__pycache__", "data", "py.typed"):
            continue
        if name.endswith(".py"):
            shown = name
        elif os.path.isdir(os.path.join(package, name)):
            shown = name + "/"
        else:
            continue
        if not re.search(r"(?<![\w/])" + re.escape(shown), text):
            out.append(f"docs/architecture.md: llmport_agent/{shown} is not in the layout")
    return out


def problems_of(where: str, text: str, known: dict[str, set[str]], source: str = "") -> list[str]:
    return (path_problems(where, text) + dotted_problems(where, text, source) + cli_problems(where, text, known)
            + setting_problems(where, text) + claim_problems(where, text) + heading_problems(where, text))


def all_problems() -> list[str]:
    known = cli_options()
    source = _source_strings()
    out: list[str] = []
    for path in pages():
        with open(path, encoding="utf-8") as f:
            out += problems_of(os.path.relpath(path, ROOT), f.read(), known, source)
    return out + architecture_problems()
