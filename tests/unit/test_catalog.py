"""The contract has one source (watchdog/catalog.py): the code logs what it lists, the docs show it.

Metrics are checked both ways against a live registry in tests/unit/test_metrics.py; here the log
events are checked both ways against the code, read with ast: every event name a call logs is in
the catalog, and every event in the catalog is logged somewhere.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdog import catalog

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "watchdog"
LEVELS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "msg", "fatal"}
LOGGERS = {"log", "structlog.get_logger()"}
# Log calls whose event is not a literal at the call, and where their events come from.
INDIRECT = {
    # OptionalIO.failed(what, event, ...): its callers name the event (read below).
    ("watchdog/optional_io.py", "event"),
    # event = "verification_passed" if passed else "verification_failed" (read as assigned).
    ("watchdog/run/cycle.py", "event"),
}


def _is_logger_method(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in LEVELS
        and ast.unparse(node.value) in LOGGERS
    )


def _event_argument(call: ast.Call) -> ast.expr | None:
    """The argument of `call` that names a log event, if `call` logs one."""
    func = call.func
    if not call.args:
        return None
    if _is_logger_method(func) or (isinstance(func, ast.Name) and func.id == "emit"):
        return call.args[0]
    if isinstance(func, ast.IfExp) and _is_logger_method(func.body):
        return call.args[0]  # (log.info if ok else log.error)(event, ...)
    if isinstance(func, ast.Attribute) and func.attr == "failed" and len(call.args) >= 2:
        return call.args[1]  # OptionalIO.failed(what, event, ...)
    return None


def _literals(node: ast.expr) -> Iterator[str]:
    """The event names an expression can be: a literal, or either branch of a conditional."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.IfExp):
        yield from _literals(node.body)
        yield from _literals(node.orelse)


def logged_events() -> tuple[set[str], list[str]]:
    """Every event name the package logs, and the log calls whose event could not be read."""
    events: set[str] = set()
    unread: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "event" for t in node.targets
            ):
                events.update(_literals(node.value))
            if not isinstance(node, ast.Call):
                continue
            argument = _event_argument(node)
            if argument is None:
                continue
            names = list(_literals(argument))
            if names:
                events.update(names)
            elif (where, ast.unparse(argument)) not in INDIRECT:
                unread.append(f"{where}:{node.lineno}: {ast.unparse(node)[:80]}")
    return events, unread


def test_every_logged_event_is_in_the_catalog_and_every_catalog_event_is_logged() -> None:
    """Both directions: a new event must be added to the catalog, a removed one taken out."""
    events, unread = logged_events()
    assert not unread, "log calls whose event name is not a literal:\n" + "\n".join(unread)
    listed = {e.name for e in catalog.EVENTS}
    assert events - listed == set(), "logged but not in watchdog/catalog.py"
    assert listed - events == set(), "in watchdog/catalog.py but never logged"


def test_names_are_unique_and_snake_case() -> None:
    """One entry per name; names as log pipelines match them."""
    for names in ([m.name for m in catalog.METRICS], [e.name for e in catalog.EVENTS]):
        assert len(names) == len(set(names))
        assert all(n.isascii() and n.replace("_", "").isalnum() and n.islower() for n in names)


def test_the_architecture_doc_carries_the_rendered_catalog() -> None:
    """docs/architecture.md holds exactly what the catalog renders (regenerate with --write)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    assert catalog.render() in text, "run: python -m watchdog.catalog --write docs/architecture.md"
    assert catalog.replace_section(text) == text


def test_the_readme_links_to_the_contract_instead_of_copying_it() -> None:
    """README names no list of its own: it links to the generated one."""
    readme = (REPO / "README.md").read_text()
    assert "docs/architecture.md#contract-other-tools-rely-on" in readme
    listed_in_readme = [e.name for e in catalog.EVENTS if f"`{e.name}`," in readme]
    assert len(listed_in_readme) < 5, listed_in_readme


def test_a_document_without_the_markers_is_refused(tmp_path: Path) -> None:
    """--write never guesses where the section goes."""
    doc = tmp_path / "doc.md"
    doc.write_text("# no markers\n")
    with pytest.raises(ValueError, match="BEGIN marker"):
        catalog.main(["--write", str(doc)])
    doc.write_text(f"a\n{catalog.BEGIN}\nold\n{catalog.END}\nb\n")
    assert catalog.main(["--write", str(doc)]) == 0
    assert doc.read_text() == f"a\n{catalog.render()}\nb\n"
