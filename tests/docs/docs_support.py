"""What README.md and docs/ name, read from their code spans and fenced blocks, and checked against the project.

Every backticked span and every line of a fenced block is an *item*. From the items come the references a reader
would act on, each checked where it lives:

* paths under the project's own folders (``workers/methods/larosa/runtime.py``, ``k8s/``,
  ``orchestrator/sweeps/h200_*.yaml``) exist; a placeholder segment (``<model>``, ``SPEC.yaml``, ``...``) checks the
  folder before it;
* dotted names of the project (``kernels.cpu_quant.TransposedParts``, ``workers.decode.timing.densify_slow_ffn``)
  resolve, read statically from the modules' source (no import);
* ``ctxsparse SUB [SUB] --flag``: the subcommands and flags exist in the real parser (``orchestrator.cli``);
* ``python -m MOD [action] --flag``: the module is ours (or an allowed tool's) and its source defines the flag;
* ``make TARGET VAR=...``: the target is a rule of the Makefile and the variable is the Makefile's;
* spec keys (``suites: {matmul: tf32}``, ``latency.cpu_weights``, the YAML blocks) are fields of
  ``orchestrator.spec``'s models, recursively; method names and their option names are registered ones;
* environment variables (``CTXSPARSE_*``, ``NAME=value``, ``$NAME``) appear in the project's code.

Names that are not the project's are on short, explicit allow-lists below, never skipped by a looser pattern.
"""
from __future__ import annotations

import ast
import re
import shlex
import typing
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

# the project's own top-level folders and files: a path starting with one of them must exist
ROOT_DIRS = ("kernels", "workers", "orchestrator", "db", "dashboard", "k8s", "docker", "benchmarks", "tests", "docs",
             ".ci")
ROOT_FILES = ("Makefile", "README.md", "BENCHMARKS.md", "pyproject.toml", "constraints.txt", "mkdocs.yml",
              ".gitignore")
PACKAGES = ("kernels", "workers", "orchestrator", "db", "dashboard", "benchmarks", "k8s", "tests")

# `python -m X` of tools that are not the project's
EXTERNAL_MODULES = frozenset({"pytest", "pip", "streamlit", "mkdocs", "compileall", "venv"})
# environment variables named in the docs that no file of the project mentions (none today)
EXTERNAL_ENV = frozenset()

SPEC_SECTIONS = ("data", "methods", "suites", "latency", "resources")


@dataclass(frozen=True)
class Item:
    """One code span, or one (continued) line of a fenced block."""
    file: str
    line: int
    text: str
    fenced: bool
    lang: str = ""

    def where(self) -> str:
        return f"{self.file}:{self.line}: `{self.text}`"


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, language, lines) of every fenced block."""
    out, cur, lang, start = [], None, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*(```|~~~)\s*([\w+-]*)", line)
        if m and cur is None:
            cur, lang, start = [], m.group(2), n + 1
        elif m:
            out.append((start, lang, cur))
            cur = None
        elif cur is not None:
            cur.append(line)
    return out


def items(path: Path) -> list[Item]:
    """The code spans of ``path`` outside fenced blocks, and the lines of its fenced blocks (a line ending in ``\\``
    joined with the next)."""
    text, name = path.read_text(), _rel(path)
    out: list[Item] = []
    prose: list[str] = []
    in_fence = False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            in_fence = not in_fence
            prose.append("")
            continue
        prose.append("" if in_fence else line)
    for start, lang, lines in fenced_blocks(text):
        joined, first = "", start
        for k, line in enumerate(lines):
            if not joined:
                first = start + k
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            if joined.strip():
                out.append(Item(name, first, joined.strip(), True, lang))
            joined = ""
    # inline spans may wrap lines: match over the prose with newlines as spaces, map offsets back to lines
    flat = "\n".join(prose)
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", flat, re.S):
        span = m.group(2).replace("\n", " ").replace("\\|", "|").strip()
        if span:
            out.append(Item(name, flat.count("\n", 0, m.start()) + 1, span, False))
    return out


def all_items() -> list[Item]:
    return [it for p in doc_files() for it in items(p)]


# ------------------------------------------------------------------------------------------------ the project
@lru_cache(maxsize=1)
def code_words() -> frozenset[str]:
    """Every identifier-like word of the project's code and configuration (not its prose: no .md file, not the
    results, not this folder)."""
    words: set[str] = set()
    files = [ROOT / f for f in ("Makefile", "pyproject.toml", "mkdocs.yml")] + [ROOT / ".ci" / "run"]
    for d in ROOT_DIRS:
        if d in ("docs", ".ci"):
            continue
        for p in (ROOT / d).rglob("*"):
            if (p.is_file() and p.suffix not in (".md", ".json", ".jsonl", ".csv", ".png", ".log", ".gz", ".npz")
                    and not {"results", "artifacts", "__pycache__"} & set(p.parts)
                    and not p.is_relative_to(Path(__file__).parent) and p.stat().st_size < 2 << 20):
                files.append(p)
    for p in files:
        try:
            words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", p.read_text(errors="replace")))
        except OSError:
            continue
    return frozenset(words)


@lru_cache(maxsize=1)
def make_targets() -> frozenset[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-][^:=#\t]*?)\s*:(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(t for t in m.group(1).split() if not t.startswith(".") and "$" not in t and "%" not in t)
    return frozenset(targets)


@lru_cache(maxsize=1)
def make_variables() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*[:?+]?=", text, re.M)) | frozenset(
        re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", text))


def cli_parser():
    from orchestrator.cli import build_parser

    return build_parser()


def subparsers(parser) -> dict:
    import argparse

    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def option_strings(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def walk_cli(parser=None, path=()):
    """(subcommand path, parser) of every leaf and inner subcommand of ``ctxsparse``."""
    parser = parser or cli_parser()
    for name, sub in subparsers(parser).items():
        yield path + (name,), sub
        yield from walk_cli(sub, path + (name,))


# --------------------------------------------------------------------------------------- python source, statically
def module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _names(body) -> dict[str, ast.AST | None]:
    """Names bound at this level of a module or class body (through if/try blocks), with their node."""
    out: dict[str, ast.AST | None] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = None
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for sub in ("body", "orelse", "finalbody"):
                out.update(_names(getattr(node, sub, [])))
            for h in getattr(node, "handlers", []):
                out.update(_names(h.body))
    return out


@lru_cache(maxsize=None)
def _module_names(path: Path) -> dict:
    return _names(ast.parse(path.read_text()).body)


def resolve_dotted(name: str) -> str | None:
    """None where ``name`` (a module, or a module then attributes) exists in the source; else why not."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        f = module_file(".".join(parts[:i]))
        if f is None:
            continue
        rest = parts[i:]
        if not rest:
            return None
        scope = _module_names(f)
        for k, attr in enumerate(rest):
            if attr not in scope:
                where = ".".join(parts[:i + k])
                return f"{where} has no {attr!r}"
            node = scope[attr]
            scope = _names(node.body) if isinstance(node, ast.ClassDef) else {}
        return None
    return f"no module {parts[0]!r}" if module_file(parts[0]) is None else f"no module {name!r}"


@lru_cache(maxsize=1)
def method_options() -> dict[str, frozenset[str]]:
    """{method: option names} of every ``@register``-ed method in the method folders of workers/methods/, read from
    the source the way ``register`` reads them: its ``options=`` mapping, else the fit function's keyword parameters
    beside ctx, sparsity and rank."""
    out = {}
    for f in sorted((ROOT / "workers" / "methods").glob("*/*.py")):
        tree = ast.parse(f.read_text())
        top = {n.targets[0].id: n.value for n in tree.body
               if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
        top.update({n.target.id: n.value for n in tree.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None})
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            for d in fn.decorator_list:
                if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "register":
                    name = d.args[0].value
                    given = {k.arg: k.value for k in d.keywords}.get("options")
                    if isinstance(given, ast.Name):
                        opts = {k.value for k in top[given.id].keys}
                    else:
                        params = fn.args.args + fn.args.kwonlyargs
                        opts = {a.arg for a in params} - {"ctx", "sparsity", "rank"}
                    out[name] = frozenset(opts)
    return out


# --------------------------------------------------------------------------------------------------- spec models
def _nested_model(annotation):
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        m = _nested_model(arg)
        if m is not None:
            return m
    return None


def spec_models() -> list:
    from orchestrator import spec

    seen, todo = [], [spec.SweepSpec]
    while todo:
        m = todo.pop(0)
        if m in seen:
            continue
        seen.append(m)
        todo += [n for f in m.model_fields.values() if (n := _nested_model(f.annotation)) is not None]
    return seen


def _is_placeholder(value) -> bool:
    return isinstance(value, str) and bool(re.search(r"\.\.\.|…|<|[A-Z]{2,}", value))


def check_spec_value(model, value, where: str) -> list[str]:
    """Errors for the keys of ``value`` (a mapping, or a list of them) that ``model`` does not have, recursively;
    method names and their option names against the registered methods."""
    from orchestrator.spec import MethodSpec

    if isinstance(value, list):
        return [e for v in value for e in check_spec_value(model, v, where)]
    if not isinstance(value, dict):
        return []
    errors = []
    for key, v in value.items():
        if _is_placeholder(key):
            continue
        if key not in model.model_fields:
            errors.append(f"{where}: {model.__name__} has no key {key!r}")
            continue
        if model is MethodSpec and key == "name" and not _is_placeholder(v) and v not in method_options():
            errors.append(f"{where}: no method {v!r}")
        if model is MethodSpec and key == "options" and isinstance(v, dict):
            known = method_options().get(value.get("name"), frozenset().union(*method_options().values()))
            errors += [f"{where}: method {value.get('name')!r} has no option {o!r}" for o in v
                       if o not in known and not _is_placeholder(o)]
            continue
        nested = _nested_model(model.model_fields[key].annotation)
        if nested is not None:
            errors += check_spec_value(nested, v, f"{where}.{key}")
    return errors


def check_spec_path(path: str, where: str) -> list[str]:
    """``latency.cpu_weights``, ``suites.tasks.0.shards``, ``methods[].allocation``: every named key exists."""
    from orchestrator.spec import SweepSpec

    model = SweepSpec
    for part in path.replace("[]", "").split("."):
        if part.isdigit():
            continue
        if model is None or part not in model.model_fields:
            return [f"{where}: no spec key {path!r} ({part!r})"]
        model = _nested_model(model.model_fields[part].annotation)
    return []


def spec_field_owner(key: str):
    return next((m for m in spec_models() if key in m.model_fields), None)


# --------------------------------------------------------------------------------------------------- the checks
def _tokens(segment: str) -> list[str]:
    try:
        return shlex.split(segment, posix=True)
    except ValueError:
        return segment.split()


def _segments(text: str) -> list[str]:
    text = re.sub(r"(^|\s)#.*$", "", text)               # a shell comment
    return [s for s in re.split(r"\s(?:&&|\|\||;|\|)\s", text) if s.strip()]


FLAG = re.compile(r"^\[?(--?[a-z][a-z0-9-]*)")
WORD = re.compile(r"^[a-z][a-z0-9-]*$")


def check_ctxsparse(args: list[str], where: str) -> list[str]:
    parser, path = cli_parser(), ["ctxsparse"]
    i = 0
    while i < len(args):
        subs = subparsers(parser)
        tok = args[i].strip("[]")
        if not subs or tok not in subs:
            break
        parser, path, i = subs[tok], path + [tok], i + 1
    if i < len(args) and subparsers(parser) and WORD.match(args[i].strip("[]")):
        return [f"{where}: `{' '.join(path)}` has no subcommand {args[i]!r} "
                f"(it has: {', '.join(subparsers(parser))})"]
    known = option_strings(parser)
    return [f"{where}: `{' '.join(path)}` has no flag {m.group(1)}" for a in args[i:]
            if (m := FLAG.match(a)) and m.group(1) not in known]


def _quoted_in(source: str, word: str) -> bool:
    return f'"{word}"' in source or f"'{word}'" in source


def check_python_m(args: list[str], where: str) -> list[str]:
    if not args:
        return []                                            # `python -m` itself, in prose
    mod, rest = args[0], args[1:]
    if re.search(r"[<>A-Z]|\.\.\.", mod):
        return []                                            # a placeholder (benchmarks.<name>)
    if mod.split(".")[0] not in PACKAGES:
        return [] if mod.split(".")[0] in EXTERNAL_MODULES else [f"{where}: `python -m {mod}`: not the project's "
                                                                  "module nor an allowed tool's"]
    f = module_file(mod)
    main = ROOT.joinpath(*mod.split(".")) / "__main__.py"
    if f is not None and f.name == "__init__.py":
        f = main if main.is_file() else None
    if f is None:
        return [f"{where}: `python -m {mod}`: no such module (or no __main__)"]
    source = f.read_text()
    errors = []
    if rest and "add_subparsers" in source and WORD.match(rest[0]) and not _quoted_in(source, rest[0]):
        errors.append(f"{where}: `python -m {mod}` has no action {rest[0]!r}")
    for a in rest:
        m = FLAG.match(a)
        if m and m.group(1) not in ("-h", "--help") and m.group(1).startswith("--") and not _quoted_in(source,
                                                                                                        m.group(1)):
            errors.append(f"{where}: `python -m {mod}` has no flag {m.group(1)}")
    return errors


def check_make(args: list[str], where: str) -> list[str]:
    errors = []
    for a in args:
        if a.startswith("-"):
            break
        if m := re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=", a):
            if m.group(1) not in make_variables():
                errors.append(f"{where}: the Makefile has no variable {m.group(1)}")
        elif WORD.match(a):
            if a not in make_targets():
                errors.append(f"{where}: the Makefile has no target {a!r}")
        else:
            break
    return errors


def check_commands(it: Item) -> list[str]:
    errors = []
    for seg in _segments(it.text):
        toks = _tokens(seg)
        command = next((j for j, x in enumerate(toks) if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", x)), 0)
        for k, t in enumerate(toks):
            if (t == "ctxsparse" or t.endswith("/ctxsparse")) and k == command:
                errors += check_ctxsparse(toks[k + 1:], it.where())
                break
            if re.fullmatch(r'(.*/)?python3?|"?\$\(?PY\)?"?', t) and k + 1 < len(toks) and toks[k + 1] == "-m":
                errors += check_python_m(toks[k + 2:], it.where())
                break
            if t == "make" and k == command:
                errors += check_make(toks[k + 1:], it.where())
                break
    return errors


PATH_TOKEN = re.compile(r"[^\s`'\"(),;\[\]{}|]+")
PLACEHOLDER = re.compile(r"<|>|…|\.\.\.|^[A-Z][A-Z0-9_-]*(\.[a-z][a-z.]*)?$|^NN$|-NN")


def check_paths(it: Item) -> list[str]:
    errors = []
    for tok in PATH_TOKEN.findall(it.text):
        tok = re.sub(r"[.:]+$", "", tok.split("#")[0])
        first = tok.split("/")[0]
        if not (first in ROOT_DIRS and "/" in tok) and tok not in ROOT_FILES:
            continue
        if "*" in tok:
            if not list(ROOT.glob(tok.rstrip("/"))):
                errors.append(f"{it.where()}: nothing matches {tok}")
            continue
        if (ROOT / tok).exists():
            continue
        parts = tok.rstrip("/").split("/")
        cut = next((k for k, p in enumerate(parts) if PLACEHOLDER.search(p)), None)
        if cut is not None and (ROOT.joinpath(*parts[:cut])).is_dir():
            continue
        errors.append(f"{it.where()}: no file or folder {tok}")
    return errors


DOTTED = re.compile(r"(?<![\w/.-])((?:%s)(?:\.[A-Za-z_]\w*)+)(?![\w/-])" % "|".join(PACKAGES))
FILE_SUFFIX = re.compile(r"\.(py|c|h|sh|md|ya?ml|json|jsonl|toml|txt)$")


def check_dotted(it: Item) -> list[str]:
    errors = []
    for m in DOTTED.finditer(it.text):
        name = m.group(1)
        if FILE_SUFFIX.search(name):
            continue
        why = resolve_dotted(name)
        if why:
            errors.append(f"{it.where()}: {name}: {why}")
    return errors


ENV_NAME = re.compile(r"(?<![A-Za-z0-9_])(CTXSPARSE_[A-Z0-9_]+)")
ENV_SET = re.compile(r"(?:^|\s)([A-Z][A-Z0-9_]*)=")
ENV_REF = re.compile(r"\$\{?([A-Z][A-Z0-9_]*)")


def check_env(it: Item) -> list[str]:
    names = set(ENV_NAME.findall(it.text)) | set(ENV_SET.findall(it.text)) | set(ENV_REF.findall(it.text))
    if not it.fenced and re.fullmatch(r"[A-Z][A-Z0-9]*_[A-Z0-9_]+", it.text):
        names.add(it.text)
    return [f"{it.where()}: no file of the project uses {n}" for n in sorted(names)
            if n not in code_words() and n not in EXTERNAL_ENV]


KEY_VALUE = re.compile(r"^\{?\s*([a-z_][a-z0-9_]*(?:(?:\[\])?\.[a-z0-9_]+)*):\s")
SPEC_PATH = re.compile(r"^(%s)(?:\[\])?(?:\.[a-z0-9_]+)+$" % "|".join(SPEC_SECTIONS))


def check_spec_item(it: Item) -> list[str]:
    if it.fenced:
        return []                                  # YAML blocks are checked whole (check_spec_blocks)
    if SPEC_PATH.match(it.text):
        return check_spec_path(it.text, it.where())
    if re.fullmatch(r"[A-Z]\w*Spec", it.text):
        from orchestrator import spec

        return [] if hasattr(spec, it.text) else [f"{it.where()}: orchestrator.spec has no {it.text}"]
    m = KEY_VALUE.match(it.text)
    if not m:
        return []
    key = m.group(1)
    if "." in key:
        return check_spec_path(key, it.where())
    try:
        value = yaml.safe_load(it.text)
    except yaml.YAMLError:
        value = None
    from orchestrator.spec import SweepSpec

    if not isinstance(value, dict):                       # not parseable: every `key:` must be a spec key or option
        keys = re.findall(r"([a-z_][a-z0-9_]*):\s", it.text)
        options = frozenset().union(*method_options().values())
        return [f"{it.where()}: {k!r} is neither a spec key nor a method option" for k in keys
                if spec_field_owner(k) is None and k not in options]
    errors = []
    for k, v in value.items():
        if k in SweepSpec.model_fields:
            errors += check_spec_value(SweepSpec, {k: v}, it.where())
        elif (owner := spec_field_owner(k)) is not None:
            errors += check_spec_value(owner, {k: v}, it.where())
        elif k not in frozenset().union(*method_options().values()):
            errors.append(f"{it.where()}: {k!r} is neither a spec key nor a method option")
    return errors


def check_spec_blocks(path: Path) -> list[str]:
    """Every YAML block of the docs is (part of) a sweep spec: its keys are the spec's."""
    from orchestrator.spec import SweepSpec

    errors = []
    for start, lang, lines in fenced_blocks(path.read_text()):
        if lang not in ("yaml", "yml"):
            continue
        where = f"{_rel(path)}:{start}"
        try:
            data = yaml.safe_load("\n".join(lines))
        except yaml.YAMLError as e:
            errors.append(f"{where}: not valid YAML ({e})")
            continue
        errors += check_spec_value(SweepSpec, data, where)
    return errors


@lru_cache(maxsize=1)
def known_flags() -> frozenset[str]:
    """Every long flag the project defines: the ``ctxsparse`` parser's, any quoted ``"--flag"`` of its Python
    modules, and the flags its shell scripts and Makefile handle."""
    flags = {o for _, p in walk_cli() for o in option_strings(p)} | option_strings(cli_parser())
    for d in PACKAGES:
        if d == "tests":
            continue
        for p in (ROOT / d).rglob("*.py"):
            if "__pycache__" not in p.parts:
                flags.update(re.findall(r"""["'](--[a-z][a-z0-9-]*)["'=]""", p.read_text(errors="replace")))
    for p in [ROOT / "Makefile", *(ROOT / "orchestrator").glob("*.sh"), *(ROOT / "docker").glob("*.sh")]:
        flags.update(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", p.read_text(errors="replace")))
    return frozenset(flags)


def check_bare_flag(it: Item) -> list[str]:
    """A span that is a flag alone (``--follow``, ``--address URL``): some command of the project has it."""
    m = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =]\S+)?", it.text)
    if it.fenced or not m:
        return []
    return [] if m.group(1) in known_flags() else [f"{it.where()}: no command of the project has {m.group(1)}"]


def check_item(it: Item) -> list[str]:
    return (check_commands(it) + check_paths(it) + check_dotted(it) + check_env(it) + check_spec_item(it)
            + check_bare_flag(it))


# ----------------------------------------------------------------------------------------------------- links
def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (mkdocs' default)."""
    text = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    blocks = {n for start, _, lines in fenced_blocks(text) for n in range(start, start + len(lines))}
    return {slug(m.group(1)) for n, line in enumerate(text.splitlines(), 1)
            if n not in blocks and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line))}


def check_links(path: Path) -> list[str]:
    """Relative markdown links of ``path`` lead to a file of the repository, and an anchor to one of its
    headings."""
    errors = []
    text = path.read_text()
    for n, line in enumerate(text.splitlines(), 1):
        for m in re.finditer(r"\]\(([^)\s]+)\)", line):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                errors.append(f"{_rel(path)}:{n}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                errors.append(f"{_rel(path)}:{n}: link to {target}: no heading #{anchor} there")
    return errors
