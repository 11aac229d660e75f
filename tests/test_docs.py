"""The docs stay true to the code: links resolve, and every metric and config field is listed.

- Every relative link in ``docs/*.md`` and ``README.md`` (``[text](x.md#anchor)``) names a
  file that exists and, when it has one, a heading anchor that exists there (GitHub's slug
  rules). So does every ``docs/x.md#anchor`` citation in those files and in the code
  (``claimkit/**/*.py``, ``lua/*.lua``), which cites docs the same way.
- Every metric ``claimkit/consumer/metrics.py`` registers has a row in ``docs/metrics.md`` with its
  exported name and type, every label is listed, and no row names a metric that does not
  exist.
- Every field ``claimkit/config/parse.py`` accepts has a row in ``docs/configuration.md`` (the
  numeric ones with their default), and every ``claimkit serve`` flag is in its flags table.

The lists come from the code, not from this file, so a new metric, field or flag without a
docs row fails here. The checker is itself tested on a broken link.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import typer

from claimkit.cli.app import app
from claimkit.config import QueueConfig
from claimkit.config import parse as _config
from claimkit.consumer.metrics import Metrics
from claimkit.ops.reclaim_metrics import reclaim_registry
from claimkit.protocol.stats import QUEUE_GAUGES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NAMESPACE = "llm_d_async_"

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_MD_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_DOCS_CITATION = re.compile(r"(?<![\w/.-])(docs/[\w.-]+\.md)(#[\w-]+)?")


def _without_fences(text: str) -> str:
    """``text`` with fenced code blocks blanked: a ``#`` line in a shell example is no heading."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, every character but
    letters, digits, ``_``, ``-`` and spaces removed, spaces turned into ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a markdown text; a repeated slug gets ``-1``, ``-2``, ..."""
    seen: Counter[str] = Counter()
    out: set[str] = set()
    for match in _HEADING.finditer(_without_fences(markdown)):
        base = slug(match.group(2))
        out.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return out


def _target_problem(target: Path, anchor: str | None, where: str) -> str | None:
    if not target.is_file():
        shown = target.relative_to(ROOT) if target.is_relative_to(ROOT) else target
        return f"{where}: no such file {shown}"
    if anchor and anchor not in anchors(target.read_text(encoding="utf-8")):
        return f"{where}: no heading #{anchor} in {target.name}"
    return None


def broken_links(path: Path, text: str, *, markdown: bool = True) -> list[str]:
    """What is wrong with the relative links and ``docs/…`` citations of one file (whose text
    is ``text``): one line per missing file or anchor. ``markdown=False`` checks only the
    ``docs/x.md#anchor`` citations (for code)."""
    problems: list[str] = []
    body = _without_fences(text) if markdown else text
    if markdown:
        for match in _MD_LINK.finditer(_INLINE_CODE.sub("", body)):
            link = match.group(1)
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", link):
                continue  # http:, https:, mailto:
            file_part, _, anchor = link.partition("#")
            target = (path.parent / file_part).resolve() if file_part else path
            problem = _target_problem(target, anchor or None, f"{path.name}: ({link})")
            if problem:
                problems.append(problem)
    for match in _DOCS_CITATION.finditer(body):
        anchor = match.group(2)[1:] if match.group(2) else None
        problem = _target_problem(ROOT / match.group(1), anchor, f"{path.name}: {match.group(0)}")
        if problem:
            problems.append(problem)
    return problems


def _table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The cells of every row of the tables under ``heading`` (up to the next heading of the
    same or a higher level), header and rule rows left out."""
    lines = _without_fences(markdown).splitlines()
    level = heading.split(" ")[0]
    section = lines[lines.index(heading) + 1 :]
    for i, line in enumerate(section):
        if re.match(rf"^#{{1,{len(level)}}} ", line):
            section = section[:i]
            break

    def cells(line: str) -> list[str]:
        return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]

    def is_rule(line: str) -> bool:
        return line.startswith("|") and set("".join(cells(line))) <= set("-: ")

    return [
        cells(line)
        for i, line in enumerate(section)
        if line.startswith("|")
        and not is_rule(line)
        and not (i + 1 < len(section) and is_rule(section[i + 1]))  # a header row
    ]


def _first_code(cell: str) -> str:
    match = re.match(r"`([^`]+)`", cell)
    return match.group(1) if match else ""


# -- the link checker --------------------------------------------------------------------------


def test_the_checker_finds_a_broken_anchor_and_a_missing_file() -> None:
    page = DOCS / "protocol.md"
    text = (
        "See [ack](protocol.md#ack), [the wrong one](protocol.md#no-such-heading),\n"
        "[gone](no-such-page.md), [here](#keys) and `docs/dispatch.md#nowhere`.\n"
        "```\n[in code](ignored.md#x)\n```\n"
    )
    assert broken_links(page, text) == [
        "protocol.md: (protocol.md#no-such-heading): no heading #no-such-heading in protocol.md",
        "protocol.md: (no-such-page.md): no such file docs/no-such-page.md",
        "protocol.md: docs/dispatch.md#nowhere: no heading #nowhere in dispatch.md",
    ]


def test_slugs_follow_githubs_rules() -> None:
    text = (
        "# The claim protocol, its guarantees\n"
        "## `claimkit serve` flags\n"
        "### Park for retry\n"
        "## Notes\n## Notes\n"
        "```\n# not a heading\n```\n"
    )
    assert anchors(text) == {
        "the-claim-protocol-its-guarantees",
        "claimkit-serve-flags",
        "park-for-retry",
        "notes",
        "notes-1",
    }


def test_every_link_in_the_docs_resolves() -> None:
    pages = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
    problems = [p for page in pages for p in broken_links(page, page.read_text(encoding="utf-8"))]
    assert problems == []


def test_every_docs_citation_in_the_code_resolves() -> None:
    sources = [*sorted((ROOT / "claimkit").rglob("*.py")), *sorted((ROOT / "lua").glob("*.lua"))]
    assert len(sources) > 60  # every package's modules, not only the top level
    problems = [
        p
        for source in sources
        for p in broken_links(source, source.read_text(encoding="utf-8"), markdown=False)
    ]
    assert problems == []


def test_every_doc_is_in_the_index() -> None:
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    listed = {m.group(1) for m in re.finditer(r"\]\(([\w.-]+\.md)\)", index)}
    assert {p.name for p in DOCS.glob("*.md")} - {"README.md"} <= listed


# -- metrics -----------------------------------------------------------------------------------


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    metrics = Metrics()
    queue = metrics.for_queue(QueueConfig("q", "http://gw:8000", labels={"pool_name": "p"}))
    queue.count_terminal("INFERENCE_ERROR", None)  # a child, so its labels show
    registered: dict[str, str] = {}
    labels: set[str] = set()
    for family in metrics.registry.collect():
        assert family.name.startswith(NAMESPACE), family.name
        name = family.name.removeprefix(NAMESPACE)
        registered[name + ("_total" if family.type == "counter" else "")] = family.type
        for sample in family.samples:
            labels.update(sample.labels)
    assert registered  # the registry was read, so the comparison below means something

    doc = (DOCS / "metrics.md").read_text(encoding="utf-8")
    documented = {_first_code(row[0]): row[1] for row in _table_rows(doc, "## The metrics")}
    assert documented == registered
    documented_labels = {_first_code(row[0]) for row in _table_rows(doc, "## Labels")}
    assert documented_labels == labels - {"le"}  # `le` is the histogram's bucket bound


def test_every_reclaim_once_metric_is_documented() -> None:
    queue_wide = {name for _attr, name, _doc in QUEUE_GAUGES}
    registered = {
        family.name.removeprefix(NAMESPACE): family.type
        for family in reclaim_registry({}, {}, 0.0).collect()
        if family.name.removeprefix(NAMESPACE) not in queue_wide
    }
    assert registered
    doc = (DOCS / "metrics.md").read_text(encoding="utf-8")
    rows = _table_rows(doc, "## Reclaim-once metrics")
    assert {_first_code(row[0]): row[1] for row in rows} == registered


# -- configuration -----------------------------------------------------------------------------


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def test_every_config_field_is_documented() -> None:
    """Each accepted field has a row in some table of the page (a section of its own, for
    the security fields say, is fine); the two field tables name only real fields; each
    numeric field's row gives its default."""
    doc = (DOCS / "configuration.md").read_text(encoding="utf-8")
    rows: dict[str, list[str]] = {}
    for heading in re.findall(r"^#{2,3} .+$", _without_fences(doc), re.MULTILINE):
        for row in _table_rows(doc, heading):
            rows.setdefault(_first_code(row[0]), row)
    assert _config._TOP_LEVEL <= set(rows)
    assert _config._QUEUE_FIELDS <= set(rows)
    for name, (_kind, default) in _config._NUMERIC.items():
        assert rows[name][1].split(";")[0] == _number_text(default), name

    top = {_first_code(row[0]) for row in _table_rows(doc, "## Top-level fields")}
    assert top <= _config._TOP_LEVEL
    queue = {_first_code(row[0]) for row in _table_rows(doc, "## Queue fields")}
    assert queue <= _config._QUEUE_FIELDS


def test_every_serve_flag_is_documented() -> None:
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    shared = {"--transport-config", "--transport-config-file", "--redis-url", "--help"}
    flags = {
        opt
        for param in serve.params
        if param.param_type_name == "option"
        for opt in param.opts
        if opt.startswith("--") and opt not in shared
    }
    assert flags  # the command was read

    doc = (DOCS / "configuration.md").read_text(encoding="utf-8")
    rows = _table_rows(doc, "## `claimkit serve` flags")
    documented = {_first_code(row[0]).split(" ")[0] for row in rows}
    assert flags <= documented
    for row in rows:  # a flag row names its config field, and that field exists
        field = _first_code(row[1])
        if field:
            assert field in _config._TOP_LEVEL, row


def test_no_page_has_two_headings_with_one_anchor() -> None:
    """Two headings of one page with the same text get ``x`` and ``x-1``: every link to
    ``#x`` then lands on the first, whichever one it meant."""
    problems = []
    for path in [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]:
        text = _without_fences(path.read_text(encoding="utf-8"))
        counts = Counter(slug(m.group(2)) for m in _HEADING.finditer(text))
        problems += [f"{path.name}: #{a} x{n}" for a, n in sorted(counts.items()) if n > 1]
    assert problems == []
