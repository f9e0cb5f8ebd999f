"""The documentation in `docs/` says what the code does.

- `docs/api.md` is what `python -m tools.gen_api_docs` makes of the current
  docstrings, and every public docstring has its summary and sections;
- every error message `docs/troubleshooting.md` quotes is one the library
  prints: the cheap ones are triggered and compared word for word, the rest
  are matched against the message templates of the module they come from;
- relative links between the pages lead to files that exist.
"""

import os
import re

import pytest

from tools import error_messages, gen_api_docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
TROUBLESHOOTING = os.path.join(DOCS, "troubleshooting.md")
QUOTE = re.compile(
    r"<!-- error: (?P<id>[\w-]+) raises: (?P<raises>\w+) from: (?P<module>\S+) -->\n"
    r"```text\n(?P<message>.*?)\n```",
    flags=re.DOTALL,
)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _quotes() -> dict[str, dict[str, str]]:
    quotes = {}
    for match in QUOTE.finditer(_read(TROUBLESHOOTING)):
        assert match["id"] not in quotes, f"error id {match['id']} quoted twice"
        quotes[match["id"]] = match.groupdict()
    return quotes


def test_api_reference_matches_the_docstrings():
    expected = gen_api_docs.render()
    assert _read(gen_api_docs.API_PAGE) == expected, (
        f"docs/api.md is stale: run `{gen_api_docs.REGENERATE}` and commit it."
    )


def test_every_public_name_has_summary_args_returns_and_example():
    problems = gen_api_docs.docstring_problems()
    assert not problems, "Public docstrings lack:\n" + "\n".join(problems)


def test_troubleshooting_quotes_every_triggered_error():
    missing = sorted(set(error_messages.TRIGGERS) - set(_quotes()))
    assert not missing, f"docs/troubleshooting.md does not quote {missing}"


@pytest.mark.parametrize("error_id", sorted(error_messages.TRIGGERS))
def test_troubleshooting_quote_is_the_message_the_library_prints(error_id):
    quote = _quotes()[error_id]
    raised, message = error_messages.error_message(error_id)
    assert raised == quote["raises"]
    assert quote["message"] == message, (
        f"docs/troubleshooting.md quotes for {error_id}:\n{quote['message']}\n"
        f"but the library now prints:\n{message}\n(python -m "
        f"tools.error_messages {error_id} prints it)"
    )


def test_every_troubleshooting_quote_comes_from_its_module():
    unmatched = []
    for error_id, quote in _quotes().items():
        templates = error_messages.message_templates(quote["module"])
        for line in quote["message"].splitlines():
            if not error_messages.matches_a_template(line, templates):
                unmatched.append(f"{error_id} ({quote['module']}): {line}")
    assert not unmatched, "Quoted lines no message template produces:\n" + (
        "\n".join(unmatched)
    )


def test_relative_links_in_docs_lead_to_files():
    pages = [os.path.join(ROOT, "README.md")]
    for directory, _, names in os.walk(DOCS):
        pages += [os.path.join(directory, n) for n in names if n.endswith(".md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _read(page)):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(page), target))
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)} -> {target}")
    assert not broken, "Broken links:\n" + "\n".join(broken)
