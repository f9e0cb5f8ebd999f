"""Write `docs/api.md` from the docstrings of the public API.

The public names are those of `keras_autoshard._PUBLIC_NAMES` (grouped by the
module that defines them, in the order the package lists them), the data of
`keras_autoshard.types`, the errors of `keras_autoshard.errors`, and the
modules `keras_autoshard.building` and `keras_autoshard.distributed`.
Google-style docstring sections (`Args:`, `Returns:`, `Raises:`,
`Example:`) become Markdown; public methods and
properties a class defines itself (not Keras overrides) are listed under it.

    python -m tools.gen_api_docs          # rewrite docs/api.md
    python -m tools.gen_api_docs --check  # exit 1 if docs/api.md is stale

`tests/test_docs.py` runs the check, so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import textwrap
from collections.abc import Iterator

API_PAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "api.md")
REGENERATE = "python -m tools.gen_api_docs"
LINE_LENGTH = 88

SECTION = re.compile(
    r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Example|Examples):\s*$"
)
ITEM = re.compile(r"^(\*{0,2}[\w.]+)(?: \(([^)]*)\))?:\s*(.*)$")
ITEM_SECTIONS = {"Args", "Arguments", "Attributes", "Raises"}
SECTION_TITLES = {"Arguments": "Args", "Examples": "Example"}


def public_objects() -> Iterator[tuple[str, str, object]]:
    """(qualified name, defining module, object) for every documented name."""
    package = importlib.import_module("keras_autoshard")
    for name, module in package._PUBLIC_NAMES.items():
        yield f"keras_autoshard.{name}", module, getattr(package, name)
    # Modules of the API whose `__all__` is documented, each under its name.
    for module_name in (
        "keras_autoshard.building",
        "keras_autoshard.distributed",
        "keras_autoshard.types",
        "keras_autoshard.errors",
    ):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            yield f"{module_name}.{name}", module_name, getattr(module, name)


def own_members(cls: type) -> list[tuple[str, object]]:
    """Public methods and properties `cls` defines that no base class has."""
    inherited = {name for base in cls.__mro__[1:] for name in vars(base)}
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name in inherited:
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            members.append((name, value))
    return members


def is_exception(obj: object) -> bool:
    return inspect.isclass(obj) and issubclass(obj, BaseException)


def documented_parameters(obj: object) -> list[inspect.Parameter]:
    """The parameters a caller passes (no `self`, `cls`, `*args`, `**kwargs`)."""
    signature = call_signature(obj)
    if signature is None:
        return []
    return [
        p
        for p in signature.parameters.values()
        if p.name not in ("self", "cls")
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def call_signature(obj: object) -> inspect.Signature | None:
    """The signature a user calls: a class's `__init__` without `self`."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    parameters = list(signature.parameters.values())
    if inspect.isclass(obj):
        if parameters and parameters[0].name == "self":
            parameters = parameters[1:]
        signature = signature.replace(
            parameters=parameters, return_annotation=inspect.Signature.empty
        )
    return signature


def format_signature(name: str, signature: inspect.Signature) -> str:
    """`name(a: int = 1, ...) -> T`, one parameter a line when too long."""
    parts = []
    previous_kind = None
    for parameter in signature.parameters.values():
        if parameter.kind == parameter.KEYWORD_ONLY and previous_kind not in (
            parameter.KEYWORD_ONLY,
            parameter.VAR_POSITIONAL,
        ):
            parts.append("*")
        previous_kind = parameter.kind
        parts.append(_format_parameter(parameter))
    returns = ""
    if signature.return_annotation is not inspect.Signature.empty:
        returns = f" -> {_annotation(signature.return_annotation)}"
    one_line = f"{name}({', '.join(parts)}){returns}"
    if len(one_line) <= LINE_LENGTH or not parts:
        return one_line
    body = "".join(f"    {part},\n" for part in parts)
    return f"{name}(\n{body}){returns}"


def _format_parameter(parameter: inspect.Parameter) -> str:
    text = parameter.name
    if parameter.kind == parameter.VAR_POSITIONAL:
        text = f"*{text}"
    elif parameter.kind == parameter.VAR_KEYWORD:
        text = f"**{text}"
    if parameter.annotation is not inspect.Parameter.empty:
        text += f": {_annotation(parameter.annotation)}"
        if parameter.default is not inspect.Parameter.empty:
            text += f" = {parameter.default!r}"
    elif parameter.default is not inspect.Parameter.empty:
        text += f"={parameter.default!r}"
    return text


def _annotation(annotation: object) -> str:
    if isinstance(annotation, str):
        return annotation
    return inspect.formatannotation(annotation)


def split_sections(doc: str) -> list[tuple[str, list[str]]]:
    """[(section title or "", lines)] in docstring order."""
    sections: list[tuple[str, list[str]]] = [("", [])]
    in_fence = False
    for line in doc.splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
        match = None if in_fence else SECTION.match(line)
        if match:
            title = SECTION_TITLES.get(match.group(1), match.group(1))
            sections.append((title, []))
        else:
            sections[-1][1].append(line)
    return [(title, lines) for title, lines in sections if title or any(lines)]


def render_docstring(doc: str) -> str:
    """A Google-style docstring as Markdown."""
    blocks = []
    for title, lines in split_sections(doc):
        body = textwrap.dedent("\n".join(lines)).strip("\n")
        if not title:
            blocks.append(body)
        elif title in ITEM_SECTIONS:
            blocks.append(f"**{title}:**\n\n{_render_items(body)}")
        elif title == "Example":
            if not body.lstrip().startswith("```"):
                body = f"```python\n{body}\n```"
            blocks.append(f"**Example:**\n\n{body}")
        else:
            blocks.append(f"**{title}:** {_join_paragraph(body)}")
    return "\n\n".join(block for block in blocks if block.strip())


def _render_items(body: str) -> str:
    items: list[list[str]] = []
    for line in body.splitlines():
        match = ITEM.match(line)
        if match and not line.startswith(" "):
            name, kind, text = match.groups()
            label = f"`{name}` ({kind})" if kind else f"`{name}`"
            items.append([f"{label}: {text}".rstrip()])
        elif items:
            items[-1].append(line.strip())
        else:
            items.append([line.strip()])
    return "\n".join("- " + " ".join(part for part in item if part) for item in items)


def _join_paragraph(body: str) -> str:
    return " ".join(line.strip() for line in body.splitlines() if line.strip())


def render_object(qualified_name: str, obj: object) -> str:
    """One `###` entry: signature, docstring, then the class's own members."""
    short = qualified_name.rsplit(".", 1)[1]
    lines = [f"### `{qualified_name}`", ""]
    if is_exception(obj):
        bases = ", ".join(base.__name__ for base in obj.__bases__)
        lines += ["```python", f"class {short}({bases})", "```"]
    else:
        signature = call_signature(obj)
        prefix = "class " if inspect.isclass(obj) else ""
        text = format_signature(short, signature) if signature else short
        lines += ["```python", prefix + text, "```"]
    lines += ["", render_docstring(inspect.getdoc(obj) or "")]
    if inspect.isclass(obj) and not is_exception(obj):
        for name, member in own_members(obj):
            lines += ["", render_member(short, name, member)]
    return "\n".join(lines)


def render_member(owner: str, name: str, member: object) -> str:
    doc = inspect.getdoc(member) or ""
    if isinstance(member, property):
        heading = f"#### `{owner}.{name}` (property)"
    else:
        signature = inspect.signature(member)
        parameters = list(signature.parameters.values())
        if parameters and parameters[0].name in ("self", "cls"):
            signature = signature.replace(parameters=parameters[1:])
        heading = f"#### `{owner}.{name}`\n\n```python\n"
        heading += format_signature(name, signature) + "\n```"
    return f"{heading}\n\n{render_docstring(doc)}".rstrip()


def docstring_problems() -> list[str]:
    """What the public docstrings lack, one line per problem.

    Every public name needs a summary line. A function needs `Args:` when it
    takes parameters, `Returns:` unless it returns `None` (or is a context
    manager), and an `Example:`. A class other than an exception needs
    `Args:` (or `Attributes:`) for its constructor's parameters and an
    `Example:`. Public methods and properties a class defines need a summary.
    """
    problems = []
    for qualified_name, _, obj in public_objects():
        doc = inspect.getdoc(obj) or ""
        titles = {title for title, _ in split_sections(doc)}
        if not doc.strip() or not doc.splitlines()[0].strip():
            problems.append(f"{qualified_name}: no summary line")
            continue
        if is_exception(obj):
            continue
        needed = ["Example"]
        if documented_parameters(obj):
            needed.append("Args")
        if inspect.isfunction(obj) and _returns_value(obj):
            needed.append("Returns")
        if inspect.isclass(obj) and "Attributes" in titles:
            titles.add("Args")
        problems += [
            f"{qualified_name}: no {title}: section"
            for title in needed
            if title not in titles
        ]
        if inspect.isclass(obj):
            for name, member in own_members(obj):
                member_doc = inspect.getdoc(member) or ""
                if not member_doc.strip():
                    problems.append(f"{qualified_name}.{name}: no docstring")
    return problems


def _returns_value(function) -> bool:
    if inspect.isgeneratorfunction(getattr(function, "__wrapped__", None)):
        return False  # a context manager
    annotation = inspect.signature(function).return_annotation
    return annotation not in (None, "None")


def render() -> str:
    """The whole of `docs/api.md`."""
    out = [
        "# API reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from the docstrings; do not edit. -->",
        "",
        "Everything importable from `keras_autoshard` (the names "
        "`keras_autoshard/__init__.py` lists), the data it returns "
        "(`keras_autoshard.types`), its errors (`keras_autoshard.errors`), "
        "model building (`keras_autoshard.building`) and the processes of a job "
        "with their collectives (`keras_autoshard.distributed`). Every other "
        "module is internal and may "
        "move. Grouped by the module that defines each name; the concepts are in "
        "[concepts.md](concepts.md), the error messages in "
        "[troubleshooting.md](troubleshooting.md).",
        "",
    ]
    groups: dict[str, list[tuple[str, object]]] = {}
    for qualified_name, module, obj in public_objects():
        groups.setdefault(module, []).append((qualified_name, obj))
    out += ["## Contents", ""]
    for module, entries in groups.items():
        names = ", ".join(
            f"[`{q.rsplit('.', 1)[1]}`](#{_anchor(q)})" for q, _ in entries
        )
        out.append(f"- `{module}`: {names}")
    for module, entries in groups.items():
        summary = _module_summary(module)
        out += ["", f"## `{module}`", ""]
        if summary:
            out += [summary, ""]
        out.append("\n\n".join(render_object(q, obj) for q, obj in entries))
    return "\n".join(out).rstrip() + "\n"


def _anchor(qualified_name: str) -> str:
    """GitHub's anchor for a `### \\`name\\`` heading."""
    return re.sub(r"[^a-z0-9_\- ]", "", qualified_name.lower()).replace(" ", "-")


def _module_summary(module: str) -> str:
    doc = inspect.getdoc(importlib.import_module(module)) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="fail if docs/api.md is out of date"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        with open(API_PAGE, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{API_PAGE} is stale; run: {REGENERATE}", file=sys.stderr)
                return 1
        return 0
    with open(API_PAGE, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {API_PAGE}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
