"""The report as readers meet it: chapter pages, the claims ledger, the index, and links that all resolve offline."""
import base64
import contextlib
import csv
import io
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import numpy as np
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from openpretrain.__main__ import main
from openpretrain.core import VERDICTS, ConfigError, project_root
from openpretrain.pages import render_report
from openpretrain.report import ReportSettings, write_index

COMMITTED = project_root() / "outputs" / "tiny"
SCREENSHOTS = project_root() / "build" / "test-artifacts" / "screenshots"
BLUE = (30, 60, 200)  # the fixture figure's colour, found again in the browser's screenshot


def png(size=(600, 300)) -> str:
    "A solid blue PNG, base64 — a figure a screenshot can find."
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", size, BLUE).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def table(path: Path, rows: list[tuple]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["quantity", "paper", "ours", "why they differ", "verdict", "rule"])
        w.writerows(rows)
    path.with_suffix(".md").write_text("| table |\n")


def chapters() -> dict[str, list]:
    figure = new_output("display_data", data={"image/png": png(), "text/plain": "<Figure size 600x300>"})
    return {
        "03_demo": [
            new_code_cell("#| default_exp demo"),
            new_markdown_cell("# 03 · A demo chapter\n\n> Reads nothing;\n> writes one table.\n\n"
                              "**Claim (§3).** Demo claims *hold* at every scale.\n\nThe rest of the chapter."),
            new_code_cell("preset = 'tiny'\nseed = 0", metadata={"tags": ["parameters"]}),
            new_code_cell("# Parameters\npreset = 'tiny'\n", metadata={"tags": ["injected-parameters"]}),
            new_code_cell("#| export\nfig = plot()", outputs=[figure]),
            new_markdown_cell("## Paper vs ours\n\nThe closing table."),
            new_code_cell('art.table(paper_vs_ours([...]), "paper-vs-ours")')],
        "12_probe": [
            new_markdown_cell("# 12 · A probe chapter\n\nProbes measure what the paper says."),
            new_markdown_cell("## Results"), new_code_cell("x = 1"),
            new_markdown_cell("### Timings"), new_code_cell('art.table(t, "paper-vs-ours-timings")'),
            new_markdown_cell("## Results"), new_code_cell('art.table(paper_vs_ours(rows), "paper-vs-ours")')],
    }


@pytest.fixture
def report(tmp_path) -> Path:
    "An output folder as the runner leaves it: two executed notebooks, three paper-vs-ours tables, a manifest."
    out = tmp_path / "tiny"
    for name, cells in chapters().items():
        (out / "notebooks").mkdir(parents=True, exist_ok=True)
        nbformat.write(new_notebook(cells=cells), out / "notebooks" / f"{name}.ipynb")
    table(out / "tables" / "03_demo-paper-vs-ours.csv", [
        ("vocabulary", "131,072", "8,192", "tiny preset", "by construction", "set"),
        ("loss | gap", "0.06", "0.07", "", "reproduces", "|Δ| ≤ 0.1")])
    table(out / "tables" / "12_probe-paper-vs-ours.csv", [("ROUGE-L", "0.18", "0.3", "small", "same direction, weaker", "r")])
    table(out / "tables" / "12_probe-paper-vs-ours-timings.csv", [("tok/s", "100", "3", "CPU", "not comparable", "n")])
    (out / "figures").mkdir()
    (out / "figures" / "03_demo-bars.png").write_bytes(base64.b64decode(png((20, 10))))
    (out / "figures" / "03_demo-bars.svg").write_text("<svg xmlns='http://www.w3.org/2000/svg'/>")
    write_index(ReportSettings(preset="tiny", outputs=str(tmp_path), chapters=list(chapters())),
                {"03_demo": 2.5, "12_probe": 7.25}, {"commit": "c0ffee" * 6 + "abcd", "tracked_changes": []})
    (tmp_path / "gpu-1").mkdir()                      # a sibling preset with a rendered report
    for f in ("manifest.json", "index.html"):
        (tmp_path / "gpu-1" / f).write_text("{}")
    (tmp_path / "scratch").mkdir()                    # not a preset: no manifest
    return out


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_the_ledger_holds_every_row_of_every_paper_vs_ours_table_with_a_link(report):
    render_report(report)
    rows = read_csv(report / "claims.csv")
    assert [(r["chapter"], r["quantity"], r["verdict"]) for r in rows] == [
        ("03_demo", "vocabulary", "by construction"), ("03_demo", "loss | gap", "reproduces"),
        ("12_probe", "ROUGE-L", "same direction, weaker"), ("12_probe", "tok/s", "not comparable")]
    assert list(rows[0]) == ["chapter", "quantity", "paper", "ours", "why they differ", "verdict", "rule", "link"]
    nb = nbformat.read(report / "notebooks" / "12_probe.ipynb", as_version=4)
    assert [r["link"] for r in rows] == [
        "pages/03_demo.html#Paper-vs-ours", "pages/03_demo.html#Paper-vs-ours",
        f"pages/12_probe.html#cell-id={nb.cells[5].id}",  # "Results" twice on the page: the heading's own cell
        "pages/12_probe.html#Timings"]
    md = (report / "claims.md").read_text()
    assert "4 claims — reproduces: 1 · same direction, weaker: 1 · does not reproduce at this scale: 0" in md
    assert "loss \\| gap" in md and md.count("\n| 03_demo |") == 2


def test_the_index_opens_with_a_summary_then_the_ledger_then_the_parts(report):
    page = render_report(report).read_text()
    at = [page.index(s) for s in ("id='summary'", "4 claims:", "What reproduces at <code>tiny</code>: 1 claim",
                                  "id='claims'", "<table class='ledger'", "id='chapters'", "id='part-data'",
                                  "id='part-evaluation'", "id='run'")]
    assert at == sorted(at)
    counts = page[page.index("4 claims:"):page.index("What reproduces")]
    assert [v for v in VERDICTS if f">{v}</span> " in counts] == list(VERDICTS)  # every verdict, in order, zeros too
    assert "<a href='?verdict=same%20direction%2C%20weaker#claims'>" in counts  # each count: the ledger, filtered
    assert "<strong>Claim (§3).</strong> Demo claims <em>hold</em> at every scale." in page  # the chapter's own words
    assert "The rest of the chapter" not in page and "Reads nothing" not in page
    assert "Data · 03" in page and "Evaluation · 12" in page and "2.5 s" in page and "7.2 s" in page
    assert "<a href='../gpu-1/index.html'>gpu-1</a>, <b>tiny</b></p>" in page and "scratch" not in page
    for f in ("manifest.json", "timings.csv", "claims.csv", "claims.md"):
        assert f"href='{f}'" in page and (report / f).is_file()
    assert page.count("<script>") == 1 and "src=" not in page[page.index("<script>"):]  # one inline script, no CDN


def test_the_summary_puts_measured_claims_before_matched_numbers_and_names_the_presets(report):
    table(report / "tables" / "12_probe-paper-vs-ours-effects.csv", [
        ("effect size", "-0.3", "-0.5", "", "reproduces", "ours -0.5 vs paper -0.3, noise 0.05"),
        ("ordering", "yes", "yes", "", "reproduces", "A below B: yes")])
    small = report.parent / "small"                   # a sibling preset where the demo's number reproduces too
    table(small / "tables" / "03_demo-paper-vs-ours.csv", [("loss | gap", "0.06", "0.061", "", "reproduces", "r"),
                                                          ("vocabulary", "131,072", "131,072", "", "reproduces", "r")])
    (small / "manifest.json").write_text(json.dumps({"preset": "small", "runs": {}, "artifacts": []}))
    (small / "pages").mkdir()
    (small / "pages" / "03_demo.html").write_text("<p>small</p>")
    page = render_report(report).read_text()
    summary = page[page.index("id='summary'"):page.index("id='claims'")]
    labels = [summary.index(s) for s in ("measured beyond the noise", "a claim of the paper, checked on this run",
                                         "a published number, matched", "reproduces under another preset only",
                                         "by construction · 1")]
    assert labels == sorted(labels)
    assert summary.index(">effect size</a>") < summary.index(">ordering</a>") < summary.index(">loss | gap</a>")
    assert ">loss | gap</a> <span class='meta'>03 · tiny, small</span>" in summary  # it reproduces under both
    assert "<a href='../small/pages/03_demo.html'>vocabulary</a>" in summary and "here by construction" in summary


def test_the_ledger_prints_numbers_for_people_and_keeps_their_values_for_sorting(report):
    table(report / "tables" / "12_probe-paper-vs-ours.csv", [
        ("languages", "1811.0", "432.0", "", "not comparable", "r"), ("tokens", "15000000000000.0", "7.924e+06", "",
                                                                      "not comparable", "r"),
        ("share", "0.4", "0.7770000000000001", "", "not comparable", "r"), ("kv", "≈ 6 KB", "6,144 B", "", "reproduces", "r")])
    page = render_report(report).read_text()
    ledger = page[page.index("<table class='ledger'"):]
    for cell in ("<td data-sort='1811.0'>1,811</td>", "<td data-sort='15000000000000.0'>15T</td>",
                 "<td data-sort='7924000.0'>7,924,000</td>", "<td data-sort='0.7770000000000001'>0.777</td>",
                 "<td>≈ 6 KB</td>", "<td>6,144 B</td>", "<td data-sort='131072.0'>131,072</td>"):
        assert cell in ledger, cell
    assert "| 1,811 | 432 |" in (report / "claims.md").read_text()  # the Markdown ledger is for people too
    assert [r["paper"] for r in read_csv(report / "claims.csv")][2:4] == ["1811.0", "15000000000000.0"]  # the data stays


def test_a_chapter_page_is_self_contained_with_folded_code_and_a_run_header(report):
    render_report(report)
    page = (report / "pages" / "03_demo.html").read_text()
    assert "src=\"data:image/png;base64," in page and "<script" not in page and "<link" not in page
    assert page.count("<details") == 5 and page.count("<details class=\"input\" open") == 2  # the parameters
    assert "<summary>fig = plot()</summary>" in page and "<summary>parameters of this run</summary>" in page
    assert "<summary>#| default_exp demo</summary>" in page and "In&nbsp;[" not in page  # no prompts
    assert "href='../index.html'" in page and "c0ffeec0ffee</code> · 2.5 s" in page
    assert "<a href='../figures/03_demo-bars.png'>03_demo-bars.png</a> · <a href='../figures/03_demo-bars.svg'>svg" in page
    assert "<a href='../tables/03_demo-paper-vs-ours.csv'>03_demo-paper-vs-ours.csv</a> · <a href" in page


def test_a_chapter_page_lists_its_headings_beside_the_text_and_each_link_finds_its_heading(report):
    render_report(report)
    page = (report / "pages" / "12_probe.html").read_text()
    toc = page[page.index("<nav class='toc'"):page.index("</nav>")]
    entries = re.findall(r"<li class='toc-(\d)'><a href='#([^']+)'>([^<]+)</a></li>", toc)
    assert [(level, text) for level, _, text in entries] == [
        ("1", "12 · A probe chapter"), ("2", "Results"), ("3", "Timings"), ("2", "Results"), ("2", "Tables and figures")]
    nb = nbformat.read(report / "notebooks" / "12_probe.ipynb", as_version=4)
    assert [ref for _, ref, _ in entries][1:] == [  # "Results" twice: each entry goes to its own heading's cell
        f"cell-id={nb.cells[1].id}", "Timings", f"cell-id={nb.cells[5].id}", "artifacts"]
    assert set(ref for _, ref, _ in entries) <= Links(report / "pages" / "12_probe.html").ids
    assert page.index("<nav class='toc'") < page.index("<main>") and "<script" not in page  # no script needed


def test_a_page_shows_a_bar_split_over_many_outputs_as_its_last_frame_and_no_machine_path(report):
    bar = [new_output("stream", name="stderr", text=f"\rtrain: {i:3d}%") for i in range(101)]
    warning = new_output("stream", name="stderr", text="\n/work/main/.venv/lib/python3.11/site-packages/tqdm/auto.py"
                                                       ":21: TqdmWarning: a warning\n")
    result = new_output("execute_result", data={"text/plain": "PosixPath('/tmp/tmpab12/tiny/figures/x.png')"})
    page = output_page(report, *bar, warning, result)
    assert page.count("train: ") == 1 and "train: 100%" in page
    assert "…/tqdm/auto.py:21: TqdmWarning" in page and "…/figures/x.png" in page
    assert "/work/" not in page and "/tmp/" not in page


STDERR_LINES = 300  # "a few hundred": the most stderr one committed page may show


class Outputs(HTMLParser):
    "The text of a page's stream and text outputs: stderr apart from the rest."
    def __init__(self, text: str):
        super().__init__()
        self.open, self.stderr, self.other = [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "div":
            kind = dict(attrs).get("class") or ""
            self.open.append("stderr" if "output_stderr" in kind else "other" if "output_text" in kind else "")

    def handle_endtag(self, tag):
        if tag == "div" and self.open:
            self.open.pop()

    def handle_data(self, data):
        if kind := next((k for k in reversed(self.open) if k), None):
            getattr(self, kind).append(data)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_no_committed_page_shows_more_than_a_few_hundred_lines_of_stderr_or_a_machine_path(preset):
    pages = sorted((COMMITTED.parent / preset / "pages").glob("*.html"))
    if not pages:
        pytest.skip(f"outputs/{preset} has no rendered pages")
    for page in pages:
        out = Outputs(page.read_text(encoding="utf-8"))
        stderr, shown = "".join(out.stderr), "".join(out.stderr + out.other)
        assert stderr.count("\n") <= STDERR_LINES, (page.name, stderr.count("\n"))
        assert "IProgress" not in stderr and "\r" not in stderr, page.name
        assert not re.findall(r"(?<![\w.~/:-])/(?:tmp|work|home|root|usr|opt|Users)/", shown), page.name


def test_rendering_twice_writes_the_same_bytes_and_drops_stale_pages(report):
    (report / "pages").mkdir()
    (report / "pages" / "99_gone.html").write_text("old")
    render_report(report)
    files = sorted([*report.glob("*.html"), *report.glob("claims.*"), *(report / "pages").glob("*")])
    first = {p: p.read_bytes() for p in files}
    render_report(report)
    assert {p: p.read_bytes() for p in files} == first
    assert sorted(p.name for p in (report / "pages").iterdir()) == ["03_demo.html", "12_probe.html"]


def test_a_table_without_a_verdict_is_an_error_naming_the_file(report):
    old = report / "tables" / "05_old-paper-vs-ours.csv"
    old.write_text("quantity,paper,ours,why they differ\nx,1,2,y\n")
    with pytest.raises(ConfigError, match="05_old-paper-vs-ours.csv: a paper-vs-ours table needs the columns"):
        render_report(report)
    table(old, [("x", "1", "2", "y", "holds", "r")])
    with pytest.raises(ConfigError, match=r"05_old-paper-vs-ours.csv: rows without a verdict .*\['x'\]"):
        render_report(report)


def test_the_cli_renders_an_existing_folder_and_prints_the_index_last(report):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["report", "--pages", "--outputs", str(report.parent), "--preset", "tiny"]) == 0
    assert out.getvalue().splitlines()[-1] == f"report: {report / 'index.html'}"
    assert main(["report", "--pages", "--outputs", str(report.parent / "nothing-here")]) == 2


class Links(HTMLParser):
    "Every id and every href/src of a page."
    def __init__(self, path: Path):
        super().__init__()
        self.ids, self.refs = set(), []
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.ids |= {a["id"]} if a.get("id") else set()
        self.refs += [a[k] for k in ("href", "src") if a.get(k) is not None]


def broken_links(out: Path) -> list[str]:
    "Every href/src of index.html and pages/*.html that is not inline data nor a file (and #id) inside `out`."
    out, problems, parsed = out.resolve(), [], {}
    pages = [out / "index.html", *sorted((out / "pages").glob("*.html"))]
    links = lambda p: parsed.setdefault(p, Links(p))
    for page in pages:
        for ref in links(page).refs:
            url, where = urlsplit(ref), f"{page.relative_to(out)}: {ref[:80]}"
            if url.scheme == "data":
                continue
            if url.scheme or url.netloc or url.path.startswith("/"):
                problems.append(f"{where}: not a relative link")
                continue
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            beside = target.relative_to(out.parent).parts if target.is_relative_to(out.parent) else ()
            sibling = (len(beside) > 1 and beside[0] != out.name                   # another preset's report
                       and (out.parent / beside[0] / "manifest.json").is_file())
            if not (target.is_relative_to(out) or sibling):
                problems.append(f"{where}: outside the output folder")
            elif not target.is_file():
                problems.append(f"{where}: no such file")
            elif url.fragment and target.suffix == ".html" and not sibling and url.fragment not in links(target).ids:
                problems.append(f"{where}: no id {url.fragment!r} in {target.name}")
    return problems


def test_every_link_of_the_rendered_fixture_resolves_inside_the_folder(report):
    render_report(report)
    assert broken_links(report) == []
    (report / "pages" / "03_demo.html").write_text(
        "<a href='https://example.org/x'>a</a><img src='/etc/x.png'><a href='../../x.html'>b</a>"
        "<a href='12_probe.html#nope'>c</a><a href='missing.html'>d</a><img src='data:image/png;base64,AA=='>")
    assert [p.split(": ")[-1] for p in broken_links(report) if p.startswith("pages/03_demo.html:")] == [
        "not a relative link", "not a relative link", "outside the output folder", "no id 'nope' in 12_probe.html",
        "no such file"]


@pytest.mark.skipif(not (COMMITTED / "pages").is_dir(), reason="outputs/tiny has no rendered pages yet")
def test_every_link_of_the_committed_report_resolves_inside_the_folder():
    assert broken_links(COMMITTED) == []


def screenshot(page: Path, name: str, tmp_path: Path, size: tuple[int, int] = (1280, 2000)) -> Path:
    "A headless-Chromium screenshot of `page` (`size`: the window), kept under build/test-artifacts/screenshots/."
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not on PATH: `make chromium` installs Debian's")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / f"{name}.png"
    shot.unlink(missing_ok=True)
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--user-data-dir={tmp_path / 'chromium'}", f"--screenshot={shot}", f"--window-size={size[0]},{size[1]}",
                    page.resolve().as_uri()], check=True, capture_output=True, timeout=120)
    return shot


def ink(shot: Path, box: tuple[int, int, int, int]) -> float:
    "The share of pixels in `box` (left, top, right, bottom) that are not white."
    from PIL import Image
    return float((np.asarray(Image.open(shot).convert("L").crop(box)) < 240).mean())


def blue_pixels(shot: Path) -> int:
    "How many pixels of the screenshot have the fixture figure's colour."
    from PIL import Image
    rgb = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    return int((np.abs(rgb - np.array(BLUE)) < 30).all(axis=-1).sum())


@pytest.mark.slow
def test_a_browser_shows_the_ledger_and_the_figures(report, tmp_path):
    render_report(report)
    index = screenshot(report / "index.html", "fixture-index", tmp_path)
    assert ink(index, (0, 80, 1280, 400)) > 0.03  # the ledger table under the title
    demo = screenshot(report / "pages" / "03_demo.html", "fixture-03_demo", tmp_path)
    assert blue_pixels(demo) > 0.8 * 600 * 300  # the figure, decoded from the page's inline base64
    probe = screenshot(report / "pages" / "12_probe.html", "fixture-12_probe", tmp_path)
    assert ink(probe, (0, 0, 1280, 300)) > 0.01


def dump_dom(url: str, tmp_path: Path) -> str:
    "The DOM headless Chromium holds once `url` has loaded and its script has run."
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not on PATH: `make chromium` installs Debian's")
    done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'dom'}",
                           "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120)
    return done.stdout


class LedgerRows(HTMLParser):
    "The ledger's rows in the order the DOM holds them: verdict, chapter, hidden, and the sort value of each cell."
    def __init__(self, dom: str):
        super().__init__()
        self.rows = []
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-verdict" in a:
            self.rows.append(dict(verdict=a["data-verdict"], chapter=a["data-chapter"], hidden="hidden" in a, sort=[]))
        elif tag == "td" and self.rows:
            self.rows[-1]["sort"].append(a.get("data-sort"))


@pytest.mark.slow
@pytest.mark.skipif(not (COMMITTED / "pages").is_dir(), reason="outputs/tiny has no rendered pages yet")
def test_a_browser_shows_the_committed_report_with_contents_and_a_ledger_that_filters_and_sorts(tmp_path):
    index = screenshot(COMMITTED / "index.html", "tiny-index", tmp_path, size=(1400, 900))
    assert ink(index, (0, 0, 1400, 900)) > 0.05  # the first screen: counts and what reproduces
    for chapter in ("05_tokenizers", "11a_ablation", "18_test_time"):
        shot = screenshot(COMMITTED / "pages" / f"{chapter}.html", f"tiny-{chapter}", tmp_path, size=(1400, 900))
        assert ink(shot, (0, 60, 240, 600)) > 0.01 and ink(shot, (260, 60, 1400, 900)) > 0.02  # contents, then text
        dom = dump_dom((COMMITTED / "pages" / f"{chapter}.html").resolve().as_uri(), tmp_path)
        assert dom.count("<li class=\"toc-") >= 4, chapter
    claims, url = read_csv(COMMITTED / "claims.csv"), (COMMITTED / "index.html").resolve().as_uri()
    rows = LedgerRows(dump_dom(url + "?verdict=reproduces", tmp_path)).rows
    shown = [r for r in rows if not r["hidden"]]
    assert len(rows) == len(claims) and {r["verdict"] for r in shown} == {"reproduces"}
    assert len(shown) == sum(c["verdict"] == "reproduces" for c in claims) > 0
    rows = LedgerRows(dump_dom(url + "?chapter=05_tokenizers&q=gini", tmp_path)).rows
    gini = [c for c in claims if c["chapter"] == "05_tokenizers" and "gini" in json.dumps(c, ensure_ascii=False).lower()]
    assert {r["chapter"] for r in rows if not r["hidden"]} == {"05_tokenizers"} and len(
        [r for r in rows if not r["hidden"]]) == len(gini) > 0
    rows = LedgerRows(dump_dom(url + "?sort=-ours", tmp_path)).rows
    ours = [r["sort"][3] for r in rows]  # the fourth column: ours
    numbers = [float(v) for v in ours if v is not None]
    assert ours[:len(numbers)] == [v for v in ours if v is not None]  # numbers first, then words
    assert numbers == sorted(numbers, reverse=True) and len(numbers) > 10


# Outputs are data: what a chapter displays at run time reaches its page through an allow-list.

ATTACKS = ["<script>alert('script')</script>", "<img src=x onerror=alert('onerror')>",
           "<a href=' JaVa\tScript:alert(\"href\")'>js</a>", "<a href='data:text/html,alert(1)'>data</a>",
           "<iframe src='https://example.org/'><p>alert('iframe')</p></iframe>", "<object data=x></object>",
           "<embed src='x.swf'>", "<svg onload=alert('svg')><script>alert('svg')</script></svg>",
           "<style>body{background:url('https://example.org/alert(1)')}</style>",
           "<style>.dataframe td{width:expression(alert('css'))}</style>",
           "<div style='background:url(javascript:alert(1))' onmouseover=\"alert('div')\">hover</div>",
           "<p title='&quot; onclick=&quot;steal()'>quoted</p>", "<img src='https://example.org/pixel.png'>",
           "<base href='https://example.org/'><meta http-equiv=refresh content='0;url=javascript:alert(1)'>",
           "</div></div></main><b>outside</b>"]


class Elements(HTMLParser):
    "Every start tag of a page with its attributes."
    def __init__(self, text: str):
        super().__init__()
        self.tags = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def output_page(report: Path, *outputs) -> str:
    "The page of a chapter `05_outputs` whose one code cell has `outputs`."
    cells = [new_markdown_cell("# 05 · Outputs"), new_code_cell("show()", outputs=list(outputs))]
    nbformat.write(new_notebook(cells=cells), report / "notebooks" / "05_outputs.ipynb")
    render_report(report)
    return (report / "pages" / "05_outputs.html").read_text()


def test_an_html_output_reaches_its_page_without_scripts_handlers_or_foreign_urls(report):
    html_output = new_output("display_data", data={"text/plain": "<HTML>", "text/html": "".join(
        ATTACKS) + "<p>kept <b>bold</b> <a href='https://example.org/a?b=1&amp;c=2'>link</a> <a href='#x'>here</a></p>"})
    page = output_page(report, html_output)
    tags = Elements(page).tags
    assert "alert(" not in page and "example.org/pixel" not in page and "expression" not in page
    assert not {t for t, _ in tags} & {"script", "iframe", "object", "embed", "svg", "base"}
    assert [t for t, _ in tags].count("style") == [t for t, _ in tags].count("meta") == 1  # the page's own
    assert not [k for _, a in tags for k in a if k.startswith("on")]
    hrefs = {a["href"] for t, a in tags if t == "a" and "href" in a}
    assert {"https://example.org/a?b=1&c=2", "#x"} <= hrefs and all(urlsplit(h).scheme in ("", "http", "https") for h in hrefs)
    assert "<p>kept <b>bold</b> <a href=\"https://example.org/a?b=1&amp;c=2\">link</a>" in page
    assert page.count("<div") == page.count("</div>") and page.count("</main>") == 1  # nothing closed ours
    assert "<b>outside</b>" in page and "hover</div>" in page  # text and safe tags stay, their attributes go


def test_a_markdown_output_passes_the_same_allow_list(report):
    md = new_output("display_data", data={"text/plain": "md", "text/markdown": "**bold** <script>alert(1)</script>"
                                                                             "<img src=x onerror=alert(2)>"})
    page = output_page(report, md)
    assert "<strong>bold</strong>" in page and "alert(" not in page and "<script" not in page


def test_an_image_size_that_is_not_a_number_never_reaches_the_img_tag(report):
    figure = new_output("display_data", data={"image/png": png((4, 4)), "text/plain": "<Figure>"},
                        metadata={"image/png": {"width": "1 onerror=alert(1)", "height": 40},
                                  "filenames": {"image/png": "https://example.org/x.png"}})
    page = output_page(report, figure)
    (img,) = [a for t, a in Elements(page).tags if t == "img"]
    assert set(img) == {"src", "height", "alt"} and img["src"].startswith("data:image/png;base64,")
    assert img["height"] == "40" and "alert(" not in page


def test_a_pandas_table_passes_the_allow_list_as_pandas_wrote_it():
    import pandas as pd

    from openpretrain.pages import sanitize_html
    frame = pd.DataFrame([[1, "a < b & c", None], [2, "runs   of  spaces", 0.5]], index=pd.Index(["r", "s"], name="row"),
                         columns=pd.MultiIndex.from_tuples([("n", "i"), ("n", "text"), ("f", "x")]))
    for table in (frame._repr_html_(), frame.droplevel(0, axis=1).to_html(), frame.to_html(notebook=True)):
        assert "&nbsp;" in table  # pandas' runs of spaces: kept as the character they stand for
        assert sanitize_html(table) == table.replace("&nbsp;", "\N{NO-BREAK SPACE}")


# A damaged output folder is one line and exit status 2, and nothing is written.

def with_manifest(**change):
    "Damage the manifest: top-level keys of `change` replace the manifest's (None deletes), `seconds` the demo run's."
    def damage(out: Path):
        m = json.loads((out / "manifest.json").read_text())
        if "seconds" in change:
            m["runs"]["03_demo"]["seconds"] = change.pop("seconds")
        m.update(change)
        (out / "manifest.json").write_text(json.dumps({k: v for k, v in m.items() if v is not None}))
    return damage


def write(name: str, text: str):
    return lambda out: (out / name).write_text(text)


DAMAGE = {  # what is wrong → (how to do it to a folder, what the one line says)
    "pages is a file": (write("pages", "x"), "pages is a file, not the pages folder"),
    "index.html is a folder": (lambda out: (out / "index.html").mkdir(), "index.html is a folder where the report"),
    "a page is a folder": (lambda out: (out / "pages" / "03_demo.html").mkdir(parents=True), "03_demo.html is a folder"),
    "the manifest is not JSON": (write("manifest.json", '{"preset": "tiny",'), "manifest.json is not a manifest (Expect"),
    "the manifest is not an object": (write("manifest.json", "[]"), "manifest.json is not a manifest ([] is not an"),
    "a notebook is not JSON": (write("notebooks/05_x.ipynb", "{not json"), "05_x.ipynb is not a notebook"),
    "a notebook is not a notebook": (write("notebooks/05_x.ipynb", '{"cells": 3}'), "05_x.ipynb is not a notebook"),
    "a notebook has no chapter number": (lambda out: shutil.copy(out / "notebooks" / "03_demo.ipynb", out / "notebooks" / "scratch.ipynb"),
                                         "scratch.ipynb: not a chapter's name"),
    "seconds is not a number": (with_manifest(seconds="fast"), "runs.03_demo.seconds is 'fast', not a number"),
    "the manifest has no preset": (with_manifest(preset=None), "(preset is missing, not text)"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_output_folder_is_one_line_and_exit_status_2(report, damage, capsys):
    do, says = DAMAGE[damage]
    do(report)
    assert main(["report", "--pages", "--outputs", str(report.parent), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("openpretrain report: ") and err.count("\n") == 1 and says in err, err
    assert not (report / "index.html").is_file() and not (report / "claims.csv").exists()  # nothing written


# A failed write leaves the page it would have replaced whole.

@contextlib.contextmanager
def disk_full_at(size: int):
    "Files cannot grow past `size` bytes in this process (RLIMIT_FSIZE): a write past it fails as on a full disk."
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_full_disk_leaves_every_page_whole(report):
    render_report(report)
    before = {p: p.read_bytes() for p in sorted(report.rglob("*")) if p.is_file()}
    assert min(len(b) for p, b in before.items() if p.suffix == ".html") > 4096
    with pytest.raises(ConfigError, match=r"cannot write .*03_demo\.html: File too large"), disk_full_at(4096):
        render_report(report)
    assert {p: p.read_bytes() for p in sorted(report.rglob("*")) if p.is_file()} == before  # no temporary file left


def test_a_progress_bar_reaches_its_page_as_its_last_frame_only():
    from openpretrain.report import final_frames
    bar = "".join(f"\rtrain:  {i:3d}%|{'#' * (i // 10)}|" for i in range(0, 101, 5))
    assert final_frames(["start\n", bar + "\n", "done\n"]) == "start\ntrain:  100%|##########|\ndone\n"
    assert final_frames("no bar here\n") == "no bar here\n"
