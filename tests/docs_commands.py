"""Every shell command the docs show, checked as a user would run it (tests/test_docs.py).

A command is a line of a ```bash block (or of an unlabelled block that starts with a command) or an inline
`code span` that starts with a command word. What is checked, without running anything heavy:
- `make T VAR=v`: T is a Makefile target (`train-<strategy>`, `train-*`: at least one matches), VAR is a variable
  the Makefile (or the code, as an environment variable) reads, no bare word or option make would reject;
  ARGS='...' is checked as what the target passes it to: recipe overrides (train-*: the key must exist in the
  schema) or the flags of the program the target runs (its argparse parser, read in-process);
- `python -m M ...`, `python script.py ...`, `accelerate launch ... script ...`: the module or script exists and
  accepts every `--flag` given; `train.py` overrides name schema keys; accelerate's own flags are accelerate's;
- every repo path a command names exists, unless an earlier command of the same page creates it (mkdir, cp)
  or it is a run's output. Placeholders (`<...>`, `...`, `…`) are not checked.
"""

from __future__ import annotations

import argparse
import typing
import gc
import importlib
import importlib.util
import re
import runpy
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND_WORDS = ("make", "python", "python3", ".venv/bin/python", "accelerate", ".venv/bin/accelerate", "sbatch",
                 "bash", "torchrun", "mkdir", "cp", "source")
REPO_ROOTS = ("recipes/", "accelerate_configs/", "scripts/", "data/", "docs/", "tests/", "disttrain/", "eval_tasks/",
              "model_configs/", "train.py")
PLACEHOLDER = "\x00"  # what `<...>` becomes before splitting
OUTPUTS = ("outputs/", "bench/", "gpu_kit", "gpu_acceptance", "logs/", "/tmp/", "artifacts/")


@dataclass
class Command:
    page: str
    line: int
    text: str


@dataclass
class Problem:
    command: Command
    what: str

    def __str__(self) -> str:
        return f"{self.command.page}:{self.command.line}: `{self.command.text}`: {self.what}"


def commands_in(page: Path, text: str | None = None) -> list[Command]:
    """The page's shell commands, in page order."""
    text = page.read_text() if text is None else text
    name = str(page.relative_to(REPO)) if page.is_relative_to(REPO) else page.name
    found, block, language, start, prose = [], None, "", 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and block is None:
            found += _span_commands(name, prose)
            block, language, start, prose = [], fence.group(1), number, []
        elif fence:
            found += _block_commands(name, start, block, language)
            block = None
        elif block is not None:
            block.append(line)
        else:
            prose.append((number, line))
    return found + _span_commands(name, prose)


def _span_commands(page: str, prose: list[tuple[int, str]]) -> list[Command]:
    """Inline `code spans` that start with a command word (a span may wrap onto the next line)."""
    if not prose:
        return []
    first, text = prose[0][0], "\n".join(line for _, line in prose)
    found = []
    for match in re.finditer(r"`([^`]+)`", text):
        span = " ".join(match.group(1).split())
        command = re.sub(r"^([A-Z_]+=\S+ )+", "", span)  # STRATEGY=hsdp sbatch ...
        if command.split(" ", 1)[0] in COMMAND_WORDS and " " in command:
            found.append(Command(page, first + text[:match.start()].count("\n"), span))
    return found


def _block_commands(page: str, start: int, block: list[str], language: str) -> list[Command]:
    if language not in ("bash", "sh", "shell", ""):
        return []
    found, pending, first = [], "", 0
    for offset, raw in enumerate(block, 1):
        line = re.sub(r"^\$ ", "", raw.strip())
        if not pending:
            first = start + offset
        pending += (" " if not _open_quote(pending) else "\n") + (line[:-1].strip() if line.endswith("\\") else line)
        if line.endswith("\\") or _open_quote(pending):
            continue
        command, pending = _strip_comment(pending.strip()), ""
        if command and (language or command.split(" ", 1)[0] in COMMAND_WORDS):
            found.append(Command(page, first, command))
    return found


def _open_quote(text: str) -> bool:
    """A quoted string goes on over the next line (`python -c "` ... `"`)."""
    try:
        shlex.split(_strip_comment(text))
    except ValueError:
        return True
    return False


def _strip_comment(line: str) -> str:
    """`make train   # a comment` -> `make train` (a # inside quotes stays)."""
    quote = None
    for i, char in enumerate(line):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (i == 0 or line[i - 1] == " "):
            return line[:i].strip()
    return line


# ------------------------------------------------------------------ what the repo offers


@dataclass
class Repo:
    """The Makefile's targets and variables, the schema's keys, the programs' parsers (read once)."""

    targets: dict[str, str] = field(default_factory=dict)  # target -> its recipe lines
    variables: set[str] = field(default_factory=set)
    parsers: dict[str, argparse.ArgumentParser | None] = field(default_factory=dict)

    @classmethod
    def read(cls) -> Repo:
        text = (REPO / "Makefile").read_text().replace("\\\n", " ")
        repo, current = cls(), None
        for line in text.splitlines():
            rule = re.match(r"^([a-zA-Z0-9_.-]+):(?!=)", line)
            if rule:
                current = rule.group(1)
                repo.targets[current] = ""
            elif line.startswith("\t") and current:
                repo.targets[current] += line + "\n"
            elif line and not line.startswith("#"):
                current = None
        repo.variables = (set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*[?:]?=", text, re.M))
                          | set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", text)))
        return repo

    def environment_variable(self, name: str) -> bool:
        """A variable the code reads from the environment (make exports command-line variables to recipes)."""
        return any(f'"{name}"' in path.read_text() for folder in ("disttrain", "tests", "scripts")
                   for path in (REPO / folder).rglob("*.py"))

    def parser(self, program: str) -> argparse.ArgumentParser | None:
        """The argparse parser of `-m module` or a script path, captured as its main() builds it."""
        if program not in self.parsers:
            self.parsers[program] = _capture_parser(program)
        return self.parsers[program]


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _capture_parser(program: str) -> argparse.ArgumentParser | None:
    original, argv = argparse.ArgumentParser.parse_known_args, sys.argv

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_known_args = capture
    sys.argv, collecting = [program, "--help"], gc.isenabled()  # train.py pauses the collector as it imports
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before (by conftest)
            if program.endswith(".py"):
                runpy.run_path(str(REPO / program), run_name="__main__")
            else:
                runpy.run_module(program, run_name="__main__", alter_sys=True)
    except _Captured as captured:
        return captured.parser
    except SystemExit:
        return None
    finally:
        argparse.ArgumentParser.parse_known_args, sys.argv = original, argv
        if collecting:
            gc.enable()
    return None


def _options(parser: argparse.ArgumentParser) -> set[str]:
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _options(sub)
    return options


def _schema_key(key: str) -> str | None:
    """None when `a.b.c` names a recipe field, else what is wrong."""
    from pydantic import BaseModel

    from disttrain.recipe.reference import _section_class
    from disttrain.recipe.schema import Recipe

    model: type[BaseModel] | None = Recipe
    entries: type[BaseModel] | None = None  # the field just named is a list of these sections
    for part in key.split("."):
        if part.isdigit() and entries is not None:  # `rl.rewards.0.model`, `data.sources.1.weight`
            model, entries = entries, None
            continue
        if model is None or part not in model.model_fields:
            return f"no recipe field {key}"
        annotation = model.model_fields[part].annotation
        listed = [a for a in (typing.get_args(annotation) or ()) if typing.get_origin(a) is list] + \
            ([annotation] if typing.get_origin(annotation) is list else [])
        entries = _section_class(typing.get_args(listed[0])[0]) if listed else None
        model = _section_class(annotation)
    return None


# ------------------------------------------------------------------ checking


def check(commands: list[Command], repo: Repo) -> list[Problem]:
    problems, created = [], set()
    for command in commands:
        problems += [Problem(command, what) for what in _check_one(command.text, repo, created)]
    return problems


def _words(text: str) -> list[list[str]]:
    """The command split into simple commands (&&, ;, |), each into words; placeholders become one marker."""
    text = re.sub(r"<[^<>]+>", PLACEHOLDER, text).replace("…", PLACEHOLDER).replace("...", PLACEHOLDER)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    parts, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            parts.append(current)
            current = []
        else:
            current.append(token)
    return [p for p in parts + [current] if p]


def _check_one(text: str, repo: Repo, created: set[str]) -> list[str]:
    try:
        simple = _words(text)
    except ValueError as exc:
        return [f"cannot be split as a shell would: {exc}"]
    problems = []
    for words in simple:
        while len(words) > 1 and re.match(r"^[A-Z_]+=", words[0]):  # STRATEGY=hsdp sbatch ...: the environment
            problems += _check_paths(words[:1], created)
            words = words[1:]
        head = Path(words[0]).name if words[0].startswith(".venv/") else words[0]
        if head == "make":
            problems += _check_make(words[1:], repo, created)
        elif head in ("python", "python3"):
            problems += _check_python(words[1:], repo, created)
        elif head == "accelerate":
            problems += _check_accelerate(words[1:], repo, created)
        elif head in ("mkdir", "cp"):
            destinations = [w for w in words[1:] if not w.startswith("-")]
            problems += _check_paths(destinations[:-1] if head == "cp" else [], created)
            created.update(destinations[-1:] if head == "cp" else destinations)
        else:
            problems += _check_paths(words[1:], created)
    return problems


MAKE_OPTIONS = {"-s", "-n", "-k", "-B", "-j"}


def _check_make(words: list[str], repo: Repo, created: set[str]) -> list[str]:
    problems, targets, args = [], [], None
    for word in words:
        word = word[1:-1] if word.startswith("[") and word.endswith("]") else word  # [BASE=1]: optional
        if PLACEHOLDER == word:
            continue
        assignment = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", word, re.S)
        if assignment:
            name, value = assignment.groups()
            if name not in repo.variables and not repo.environment_variable(name):
                problems.append(f"make variable {name} is read by neither the Makefile nor the code")
            if name == "ARGS":
                args = value
            elif name in ("RECIPE", "CHECKPOINT", "LOG", "RUN", "OUT", "INCLUDE", "HOSTFILE"):
                problems += _check_paths(value.split(), created, must=name in ("RECIPE", "INCLUDE"))
        elif word.startswith("-"):
            if word not in MAKE_OPTIONS and not word.isdigit():
                problems.append(f"make does not take {word}: a program's flags go in ARGS='{word} ...'")
        elif word.isdigit():
            continue
        else:
            pattern = re.escape(word).replace(re.escape(PLACEHOLDER), ".+").replace(r"\*", ".+")
            matched = [t for t in repo.targets if re.fullmatch(pattern, t)]
            if not matched:
                problems.append(f"no make target {word!r}" + (" (make reads a bare word as a target: give it as "
                                                               "VAR=value)" if "/" in word else ""))
            targets += matched
    if args is not None:
        for target in targets[:1]:
            problems += _check_program_args(repo.targets[target], args, repo, created)
    return problems


def _check_program_args(recipe_lines: str, args: str, repo: Repo, created: set[str]) -> list[str]:
    """ARGS as the target passes it on: to train.py as overrides, or to the program the target runs."""
    try:
        words = [w for part in _words(args) for w in part]
    except ValueError as exc:
        return [f"ARGS cannot be split: {exc}"]
    if "train.py" in recipe_lines:
        return _check_overrides(words)
    program = re.search(r"\$\(PY\) (?:-m ([\w.]+)|(\S+\.py))", recipe_lines)
    if program is None:
        return ["this target does not pass ARGS to any program"]
    return _check_program(program.group(1) or program.group(2), words, repo, created)


def _check_overrides(words: list[str]) -> list[str]:
    problems = []
    for word in words:
        if PLACEHOLDER in word:
            continue
        if "=" not in word or word.startswith("-"):
            problems.append(f"{word!r} is not a recipe override (key.path=value)")
        else:
            problems += [p for p in [_schema_key(word.split("=", 1)[0])] if p]
    return problems


def _check_python(words: list[str], repo: Repo, created: set[str]) -> list[str]:
    if words[:1] == ["-c"] and len(words) > 1:
        return _check_snippet(words[1])
    if words[:1] == ["-m"] and len(words) > 1 and PLACEHOLDER in words[1]:
        return []  # `python -m disttrain...`: a family of modules
    if words[:1] == ["-m"] and len(words) > 1:
        return _check_program(words[1], words[2:], repo, created)
    if words and words[0].endswith(".py"):
        return _check_program(words[0], words[1:], repo, created)
    return []


def _check_program(program: str, words: list[str], repo: Repo, created: set[str]) -> list[str]:
    if program.endswith(".py"):
        if PLACEHOLDER in program or not (REPO / program).is_file():
            return [] if PLACEHOLDER in program else [f"no script {program}"]
    elif importlib.util.find_spec(program.split(".")[0]) is None or (
            program.startswith("disttrain") and importlib.util.find_spec(program) is None):
        return [f"no module {program}"]
    if not program.startswith(("disttrain", "train.py", "scripts/")):
        return []  # another project's program (deepspeed's converter, ...): not ours to check
    parser = repo.parser(program)
    if parser is None:
        return [f"{program} has no command-line parser to check the flags against"]
    options, problems = _options(parser), []
    for word in words:
        if word.startswith("--") and word.split("=", 1)[0] not in options:
            problems.append(f"{program} has no option {word.split('=', 1)[0]}")
        elif program == "train.py" and "=" in word and not word.startswith("-") and PLACEHOLDER not in word:
            problems += [p for p in [_schema_key(word.split("=", 1)[0])] if p]
    if not problems and not any(PLACEHOLDER in w for w in words):
        problems += _parse(parser, program, words)
    return problems + _check_paths([w for w in words if not w.startswith("-")], created)


class _Refused(Exception):
    pass


def _parse(parser: argparse.ArgumentParser, program: str, words: list[str]) -> list[str]:
    """The program's own parser reads the words (types, choices, required options, stray words)."""
    def refuse(message):
        raise _Refused(message)

    parser.error, original = refuse, parser.error
    try:
        parser.parse_args(words)
    except _Refused as refused:
        return [f"{program}: {refused}"]
    finally:
        parser.error = original
    return []


def _check_snippet(code: str) -> list[str]:
    """`python -c CODE`: it compiles, and what it imports from the project exists."""
    import ast

    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return [f"python -c: {exc}"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("disttrain"):
            module = importlib.import_module(node.module)
            problems += [f"{node.module} has no {a.name}" for a in node.names if not hasattr(module, a.name)]
    return problems


def _check_accelerate(words: list[str], repo: Repo, created: set[str]) -> list[str]:
    if words[:1] != ["launch"]:
        return []
    from accelerate.commands.launch import launch_command_parser

    options = _options(launch_command_parser())
    problems = []
    for i, word in enumerate(words[1:], 1):
        if word.startswith("--"):
            if word.split("=", 1)[0] not in options:
                problems.append(f"accelerate launch has no option {word}")
        elif word.endswith(".py") or word.startswith("-m"):
            rest = words[i:]
            return problems + _check_python(rest if word.endswith(".py") else rest, repo, created)
        elif words[i - 1] == "--config_file" and not (REPO / word).is_file() and PLACEHOLDER not in word:
            problems.append(f"no config file {word}")
    return problems


def _check_paths(words: list[str], created: set[str], must: bool = False) -> list[str]:
    """Repo paths a command names must exist (or be made earlier on the page); `must`: any path at all."""
    problems = []
    for word in words:
        path = word.split("=", 1)[-1]
        if PLACEHOLDER in path or "*" in path or path.startswith(OUTPUTS) or "{" in path:
            continue
        if not (must or path.startswith(REPO_ROOTS)):
            continue
        if not (REPO / path).exists() and not any(path == c or path.startswith(c.rstrip("/") + "/") for c in created):
            problems.append(f"no such file or directory: {path}")
    return problems
