"""Retroactive robots.txt filtering (chapter 02), its fetcher (notebook 02a) and the compliance ledger (chapter 01a)."""
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest
from datatrove.data import Document
from hypothesis import given, settings
from hypothesis import strategies as st

from openpretrain.compliance.ledger import Ledger, record
from openpretrain.compliance.robots import (POLICIES, RobotsConfig, RobotsFilter, RobotsOracle, group_applied_before_07,
                                            group_applies, host_key, is_allowed, rank_domains, read_snapshot, robots_file,
                                            write_snapshot)
from openpretrain.compliance.robots_fetch import SNAPSHOT_COLUMNS, fetch_robots
from openpretrain.core import ConfigError, load_preset
from openpretrain.corpus import AI_USER_AGENTS, MAX_ROBOTS_BYTES, REPORT_AGENTS, registrable_domain


def snapshot(files: dict) -> pd.DataFrame:
    "A snapshot frame from {host: body} or {host: (status, body)}."
    rows = [(h, *(v if isinstance(v, tuple) else (200, v))) for h, v in files.items()]
    return pd.DataFrame([{"host": h, "http_status": s, "body": b.encode() if isinstance(b, str) else b,
                          "fetched_at": "2025-01-15T00:00:00+00:00"} for h, s, b in rows])


# --- matching semantics (RFC 9309 §2.2, examples of §5) -----------------------------------------------------

def test_longest_match_wins():
    assert is_allowed("User-agent: *\nAllow: /p\nDisallow: /\n", "https://e.com/page", "GPTBot")
    assert not is_allowed("User-agent: *\nAllow: /p\nDisallow: /pa\n", "https://e.com/page", "GPTBot")


def test_allow_wins_a_tie():
    assert is_allowed("User-agent: *\nDisallow: /folder\nAllow: /folder\n", "https://e.com/folder/page", "GPTBot")


def test_wildcard_and_end_anchor():
    txt = "User-agent: *\nAllow: /$\nDisallow: /\nDisallow: /*.pdf$\n"
    assert is_allowed(txt, "https://e.com/", "CCBot")
    assert not is_allowed(txt, "https://e.com/page.htm", "CCBot")
    pdf = "User-agent: *\nDisallow: /*.pdf$\n"
    assert not is_allowed(pdf, "https://e.com/a/b.pdf", "CCBot")
    assert is_allowed(pdf, "https://e.com/a/b.pdf?x", "CCBot")
    assert not is_allowed("User-agent: *\nDisallow: /*/private\n", "https://e.com/a/b/private/x", "CCBot")


def test_named_group_replaces_the_generic_one():
    txt = "User-agent: *\nDisallow: /\n\nUser-agent: GPTBot\nAllow: /\n"
    assert is_allowed(txt, "https://e.com/x", "GPTBot") and not is_allowed(txt, "https://e.com/x", "ClaudeBot")


def test_duplicate_groups_merge():
    txt = "User-agent: GPTBot\nDisallow: /a\n\nUser-agent: CCBot\nDisallow: /c\n\nUser-agent: gptbot\nDisallow: /b\n"
    assert not is_allowed(txt, "https://e.com/a", "GPTBot") and not is_allowed(txt, "https://e.com/b", "GPTBot")
    assert is_allowed(txt, "https://e.com/c", "GPTBot")


def test_grouped_user_agent_lines_share_rules():
    txt = "User-agent: GPTBot\nUser-agent: ClaudeBot\nDisallow: /\n"
    assert not is_allowed(txt, "https://e.com/", "GPTBot") and not is_allowed(txt, "https://e.com/", "ClaudeBot")
    assert is_allowed(txt, "https://e.com/", "CCBot")


def test_robots_txt_itself_is_always_fetchable():
    assert is_allowed("User-agent: *\nDisallow: /\n", "https://e.com/robots.txt", "GPTBot")


PATTERN = st.tuples(st.text(alphabet="ab/*", max_size=4), st.booleans()).map(lambda t: "/" + t[0] + "$" * t[1])
RULES = st.lists(st.tuples(st.sampled_from(["Allow", "Disallow"]), PATTERN), max_size=6)


def reference_allowed(rules: list[tuple[str, str]], path: str) -> bool:
    "RFC 9309 §2.2.2 written out independently: the longest matching pattern decides, Allow wins ties, none → allow."
    best = None
    for kind, pattern in rules:
        body, anchored = (pattern[:-1], True) if pattern.endswith("$") else (pattern, False)
        regex = "".join(".*" if c == "*" else re.escape(c) for c in body) + ("$" if anchored else "")
        if re.match(regex, path):
            best = max(best or (-1, False), (len(pattern), kind == "Allow"))
    return best is None or best[1]


@settings(max_examples=300, deadline=None)
@given(rules=RULES, path=st.text(alphabet="ab/", max_size=6).map(lambda s: "/" + s))
def test_matching_equals_an_independent_rfc9309_reading(rules, path):
    txt = "User-agent: *\n" + "".join(f"{kind}: {pattern}\n" for kind, pattern in rules)
    assert is_allowed(txt, "https://e.com" + path, "GPTBot") == reference_allowed(rules, path)


# --- the Protego 0.6 → 0.7 user-agent change --------------------------------------------------------------------

@pytest.mark.parametrize("group,agent,before,now", [
    ("bot", "GPTBot", True, False),                   # 0.7: the token must start at a word boundary
    ("extended", "Google-Extended", True, False),     # '-' does not open a new word
    ("ccbot/2.0", "CCBot", False, False),             # a versioned group never covers the bare query
    ("ccbot", "CCBot/2.0", True, True),               # but the bare group covers the versioned query
    ("gpt", "GPTBot", True, True),                    # only the left boundary is checked
    ("gptbot", "Mozilla/5.0 (compatible; GPTBot/1.2)", True, True),
])
def test_user_agent_matching_protego_07_vs_06(group, agent, before, now):
    assert group_applies(group, agent) is now
    assert group_applied_before_07(group, agent) is before


PROTEGO_06_WHEEL = Path(__file__).resolve().parents[1] / ".cache/wheels/protego-0.6.2-py3-none-any.whl"


@pytest.mark.slow
def test_comparison_rule_equals_real_protego_06():
    "Run the real protego 0.6.2 (a local wheel, imported from the zip) and check `group_applied_before_07` against it."
    import json
    import subprocess
    import sys
    if not PROTEGO_06_WHEEL.is_file():
        pytest.fail(f"{PROTEGO_06_WHEEL} is missing; fetch it once with\n"
                    f"  .venv/bin/pip download protego==0.6.2 --no-deps -d .cache/wheels")
    pairs = [(g, a) for g in ("bot", "extended", "ccbot/2.0", "ccbot", "gpt", "gptbot", "*", "pangu", "claude-web")
             for a in ("GPTBot", "CCBot", "CCBot/2.0", "Google-Extended", "PanguBot", "Mozilla/5.0 (compatible; GPTBot/1.2)")]
    code = ("import json, sys; from protego import Protego; pairs = json.loads(sys.argv[1]); print(json.dumps("
            "[not Protego.parse(f'User-agent: {g}\\nDisallow: /\\n').can_fetch('https://e.org/', a) for g, a in pairs]))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(pairs)], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(PROTEGO_06_WHEEL)}, cwd=PROTEGO_06_WHEEL.parent)
    assert "protego-0.6.2" in subprocess.run([sys.executable, "-c", "import protego; print(protego.__file__)"],
                                             capture_output=True, text=True, env={"PYTHONPATH": str(PROTEGO_06_WHEEL)}).stdout
    assert json.loads(out.stdout) == [group_applied_before_07(g, a) for g, a in pairs]


def test_a_bot_group_no_longer_removes_gptbot_documents():
    snap = snapshot({"e.com": "User-agent: bot\nDisallow: /\n"})
    d = RobotsOracle(snap, RobotsConfig(wildcard=False)).decide("https://e.com/x")
    assert d.kept and d.reason == "allowed"


def test_versioned_ccbot_group_is_caught_by_the_versioned_query():
    snap = snapshot({"e.com": "User-agent: CCBot/2.0\nDisallow: /\n"})
    d = RobotsOracle(snap, RobotsConfig(wildcard=False)).decide("https://e.com/x")
    assert not d.kept and d.agents == ("CCBot/2.0",)
    d_report_only = RobotsOracle(snap, RobotsConfig(agents=list(REPORT_AGENTS), wildcard=False)).decide("https://e.com/x")
    assert d_report_only.kept


def test_agent_lists():
    assert len(REPORT_AGENTS) == 11 and len(AI_USER_AGENTS) == 14
    assert {"CCBot/2.0", "CCBot/1.0", "FacebookBot"} <= set(AI_USER_AGENTS) and "*" not in AI_USER_AGENTS
    assert RobotsConfig().checked_agents[-1] == "*" and "*" not in RobotsConfig(wildcard=False).checked_agents


# --- missing files and bodies ---------------------------------------------------------------------------------

POLICY_TABLE = [  # (fetch, apertus keeps, rfc9309 keeps)
    ((404, b""), True, True), ((401, b""), True, True), ((301, b""), True, True),
    ((500, b""), True, False), ((503, b""), True, False), ((None, b""), True, False), ((0, b""), True, False),
    ((pd.NA, b""), True, False),
    ((200, b"<!doctype html><html><body>Disallow: /</body></html>"), True, True),
    ((200, bytes(range(256)) * 8), True, True),
]


@pytest.mark.parametrize("fetch,apertus,rfc", POLICY_TABLE)
def test_missing_file_policy_table(fetch, apertus, rfc):
    snap = snapshot({"e.com": fetch})
    for policy, expected in (("apertus", apertus), ("rfc9309", rfc)):
        for mode in ("url", "domain"):
            d = RobotsOracle(snap, RobotsConfig(policy=policy, mode=mode)).decide("https://e.com/a")
            assert d.kept is expected, (fetch[0], policy, mode, d)
            assert d.reason in ("unavailable", "unreachable") and d.rule.startswith("policy:")


def test_policy_presets():
    assert (POLICIES["apertus"].unavailable, POLICIES["apertus"].unreachable) == ("allow", "allow")
    assert (POLICIES["rfc9309"].unavailable, POLICIES["rfc9309"].unreachable) == ("allow", "disallow")
    with pytest.raises(ConfigError):
        RobotsConfig(policy="lenient")


def test_only_first_500_kib_parsed_and_partial_line_dropped():
    head = "User-agent: GPTBot\nDisallow: /a\n"
    pad = "# " + "x" * (MAX_ROBOTS_BYTES - len(head) - 14) + "\n"  # ends 11 bytes before the limit
    tail = "Disallow: /private\nDisallow: /b\n"  # 'Disallow: /' would sit inside the limit
    body = head + pad + tail
    assert len(body.encode()) > MAX_ROBOTS_BYTES
    f = robots_file(200, body.encode())
    assert f.status == "ok" and len(f.text.encode()) <= MAX_ROBOTS_BYTES and "private" not in f.text
    assert is_allowed(f.text, "https://e.com/c", "GPTBot") and not is_allowed(f.text, "https://e.com/a", "GPTBot")


def test_malformed_lines_are_read_leniently_like_googles_parser():
    body = b"User agent: GPTBot\nDisalow: /\nUser-agent GPTBot\nDisallow /private\n<meta name=\"robots\">\nUser-agent: *\nDisallow:\n"
    f = robots_file(200, body)
    assert f.status == "ok" and not is_allowed(f.text, "https://e.com/a", "GPTBot")  # 'Disalow' is a known typo
    assert is_allowed(f.text, "https://e.com/a", "ClaudeBot")


def test_empty_200_allows_everything():
    d = RobotsOracle(snapshot({"e.com": (200, b"")})).decide("https://e.com/a")
    assert d.kept and d.reason == "allowed"


def test_latin1_and_bom_bodies_parse():
    f = robots_file(200, "\ufeffUser-agent: *\n# caf\xe9\nDisallow: /x\n".encode("utf-8"))
    assert not is_allowed(f.text, "https://e.com/x", "GPTBot")
    g = robots_file(200, "# caf\xe9\nUser-agent: *\nDisallow: /x\n".encode("latin-1"))
    assert g.status == "ok" and not is_allowed(g.text, "https://e.com/x", "GPTBot")


# --- url vs domain mode ------------------------------------------------------------------------------------------

SNAP = snapshot({
    "part.com": "User-agent: GPTBot\nDisallow: /private\n",
    "root.com": "User-agent: GPTBot\nDisallow: /\nAllow: /public\n",
    "open.com": "User-agent: *\nAllow: /\n",
    "a.sub.co.uk": "User-agent: ClaudeBot\nDisallow: /\n",
})


@pytest.mark.parametrize("url,url_mode,domain_mode", [
    ("https://part.com/private/1", False, True),   # URL denied; root still fetchable
    ("https://part.com/blog/1", True, True),
    ("https://root.com/public/1", True, False),    # URL allowed; root denied → whole host out
    ("https://root.com/x", False, False),
    ("https://open.com/x", True, True),
    ("https://unknown.org/x", True, True),          # not in the snapshot: kept (no-robots)
])
def test_url_mode_vs_domain_mode(url, url_mode, domain_mode):
    assert RobotsOracle(SNAP, RobotsConfig(mode="url")).decide(url).kept is url_mode
    assert RobotsOracle(SNAP, RobotsConfig(mode="domain")).decide(url).kept is domain_mode


def test_domain_mode_records_agents_and_rule():
    d = RobotsOracle(SNAP, RobotsConfig(mode="domain")).decide("https://root.com/public/1")
    assert d.reason == "blocked-domain" and d.agents == ("GPTBot",) and d.rule == "root:root.com"


def test_registrable_scope_spreads_a_subdomain_block():
    host = RobotsOracle(SNAP, RobotsConfig(mode="domain"))
    reg = RobotsOracle(SNAP, RobotsConfig(mode="domain", domain_scope="registrable"))
    assert host.decide("https://www.sub.co.uk/x").kept and not reg.decide("https://www.sub.co.uk/x").kept
    assert registrable_domain("a.b.bbc.co.uk") == "bbc.co.uk" and registrable_domain("me.github.io") == "me.github.io"


def test_url_mode_removal_lists_every_blocking_agent():
    snap = snapshot({"e.com": "User-agent: GPTBot\nUser-agent: CCBot\nDisallow: /\n\nUser-agent: *\nDisallow: /tmp\n"})
    assert RobotsOracle(snap).decide("https://e.com/x").agents == ("GPTBot", "CCBot", "CCBot/2.0", "CCBot/1.0")
    # agents without a group of their own fall back to `*`, so /tmp is denied to all fifteen
    assert RobotsOracle(snap).decide("https://e.com/tmp/1").agents == RobotsConfig().checked_agents


# --- hosts: IDNA, IPv6, ports, missing or broken ------------------------------------------------------------------

def test_host_keys_normalise_like_netlocs():
    assert host_key("https://Bücher.de/a") == host_key("https://xn--bcher-kva.de/b") == "xn--bcher-kva.de"
    assert host_key("http://u:p@E.com:8080/") == "e.com:8080" and host_key("http://e.com/") != "e.com:8080"
    assert host_key("http://[::1]:81/x") == "[::1]:81" and host_key("file:///etc/passwd") is None


def test_idna_ipv6_and_port_hosts_are_matched():
    snap = snapshot({"bücher.de": "User-agent: *\nDisallow: /\n", "[::1]:8080": "User-agent: *\nDisallow: /\n",
                     "e.com:8443": "User-agent: *\nDisallow: /\n"})
    o = RobotsOracle(snap)
    assert not o.decide("https://xn--bcher-kva.de/x").kept and not o.decide("http://[::1]:8080/x").kept
    assert not o.decide("https://e.com:8443/x").kept and o.decide("https://e.com/x").reason == "no-robots"


@pytest.mark.parametrize("url,reason", [
    ("", "no-host"), ("not a url", "no-host"), ("mailto:a@b.c", "no-host"), ("http://[::1/x", "bad-url"),
    ("http://e.com:99999/", "bad-url"), ("http://e.com:port/", "bad-url"), ("http://xn--/x", "no-robots"),
    ("http://" + "a" * 70 + ".com/", "no-robots"), ("https://e.com/%ZZ/\x00", "no-robots"),
])
def test_malformed_urls_are_kept_with_a_reason(url, reason):
    for mode in ("url", "domain"):
        d = RobotsOracle(SNAP, RobotsConfig(mode=mode)).decide(url)
        assert d.kept and d.reason == reason


@settings(max_examples=150, deadline=None)
@given(url=st.one_of(st.text(max_size=40), st.builds(lambda h, p: f"https://{h}/{p}", st.text(max_size=20), st.text(max_size=10))),
       mode=st.sampled_from(["url", "domain"]))
def test_any_string_gets_a_decision_and_never_raises(url, mode):
    d = RobotsOracle(SNAP, RobotsConfig(mode=mode, domain_scope="registrable")).decide(url)
    assert d.reason in ("allowed", "disallowed-url", "blocked-domain", "unavailable", "unreachable", "no-robots",
                        "no-host", "bad-url")
    assert d.kept or d.agents or d.reason in ("unavailable", "unreachable")


def test_malformed_snapshot_hosts_do_not_crash():
    snap = snapshot({"[::1": "User-agent: *\nDisallow: /\n", "e.com:x": "x", "": "y", "ok.com": "User-agent: *\nDisallow: /\n"})
    o = RobotsOracle(snap)
    assert not o.decide("https://ok.com/").kept and RobotsOracle(snap, RobotsConfig(mode="domain")).decide("https://ok.com/a").reason == "blocked-domain"


# --- the datatrove step and conservation --------------------------------------------------------------------------

URLS = st.sampled_from(["https://part.com/private/1", "https://part.com/x", "https://root.com/public", "https://open.com/",
                        "https://unknown.org/", "", "http://[::1/x", "https://a.sub.co.uk/z", "https://www.sub.co.uk/"])


@settings(max_examples=40, deadline=None)
@given(urls=st.lists(URLS, max_size=30), mode=st.sampled_from(["url", "domain"]),
       scope=st.sampled_from(["host", "registrable"]), policy=st.sampled_from(list(POLICIES)))
def test_every_document_is_kept_or_removed_exactly_once(urls, mode, scope, policy):
    docs = [Document(f"text {i}", f"d{i}", metadata={"url": u}) for i, u in enumerate(urls)]
    step = RobotsFilter(SNAP, RobotsConfig(mode=mode, domain_scope=scope, policy=policy))
    kept = list(step.run(iter(docs)))
    assert [d.id for d in kept] == [d.id for d in docs if d.metadata["robots_decision"] == "kept"]
    removed = [d for d in docs if d.metadata["robots_decision"] == "removed"]
    assert len(kept) + len(removed) == len(docs)
    assert all(d.metadata["robots_snapshot"] == "2025-01-15" for d in docs)
    assert all(d.metadata["robots_agents"] or d.metadata["robots_reason"] in ("unavailable", "unreachable") for d in removed)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_pipeline_with_exclusion_writer_conserves_documents(tmp_path, fmt):
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter, ParquetWriter
    writer = {"jsonl": JsonlWriter, "parquet": ParquetWriter}[fmt]
    urls = ["https://part.com/private/1", "https://part.com/x", "https://root.com/x", "https://open.com/", "", "http://[::1/"]
    src = tmp_path / "in"
    with JsonlWriter(str(src)) as w:
        for i, u in enumerate(urls):
            w.write(Document(f"t{i}", f"d{i}", metadata={"url": u, "source": "fw", "language": "en", "token_count": i + 1}))
    LocalPipelineExecutor([JsonlReader(str(src)),
                           RobotsFilter(SNAP, exclusion_writer=writer(str(tmp_path / "removed"))),
                           writer(str(tmp_path / "kept"))],
                          tasks=1, logging_dir=str(tmp_path / "logs")).run()
    ledger = Ledger.from_folders(tmp_path / "kept", tmp_path / "removed", fmt=fmt)
    ledger.check_conservation([f"d{i}" for i in range(len(urls))])
    out = ledger.manifest("robots").set_index("id")
    assert out.loc["d0", "robots_decision"] == "removed" and list(out.loc["d0", "robots_agents"]) == ["GPTBot"]
    assert out.loc["d2", "robots_reason"] == "disallowed-url" and out.loc["d5", "robots_reason"] == "bad-url"
    vol = ledger.volume("robots").set_index("source").loc["all"]
    assert (vol.docs_before, vol.docs_after, vol.tokens_before, vol.tokens_after) == (6, 4, 21, 17)


# --- the ledger ----------------------------------------------------------------------------------------------------

def _ledger_docs():
    docs = [Document("a" * 10, f"d{i}", metadata={"url": f"https://h{i}.ch/", "source": "fw2" if i > 2 else "fw",
                                                  "language": "de" if i > 2 else "en", "token_count": 10 * (i + 1)})
            for i in range(5)]
    record(docs[0], "robots", "removed", "disallowed-url", agents=["GPTBot", "CCBot"])
    record(docs[3], "robots", "removed", "disallowed-url", agents=["GPTBot"])
    for d in (docs[1], docs[2], docs[4]):
        record(d, "robots", "kept", "allowed", agents=[])
    record(docs[1], "toxicity", "removed", "toxic", score=0.99)
    for d in (docs[2], docs[4]):
        record(d, "toxicity", "kept", "", score=0.1)
        record(d, "pii", "modified", "pii", email=2, ip=1)
    return docs


def test_ledger_volume_table_against_hand_counts():
    led = Ledger.from_documents(_ledger_docs())
    rob = led.volume("robots").set_index(["source", "language"])
    assert rob.loc[("fw", "en"), ["tokens_before", "tokens_after"]].tolist() == [60, 50]
    assert rob.loc[("fw2", "de"), ["tokens_before", "tokens_after"]].tolist() == [90, 50]
    tox = led.volume("toxicity").set_index(["source", "language"])
    assert tox.loc[("fw", "en"), ["docs_before", "docs_after"]].tolist() == [2, 1]
    whole = led.volume().set_index("source").loc["all"]
    assert (whole.docs_before, whole.docs_after, whole.tokens_after) == (5, 2, 80)


def test_ledger_breakdown_totals_and_manifest():
    led = Ledger.from_documents(_ledger_docs())
    by_agent = led.breakdown("robots", "agents").set_index(["source", "robots_agents"])
    assert by_agent.loc[("fw", "GPTBot"), "tokens_removed"] == 10 and by_agent.loc[("fw2", "GPTBot"), "docs_removed"] == 1
    assert by_agent.loc[("fw", "CCBot"), "tokens_removed_pct"] == pytest.approx(100 * 10 / 60)
    pii = led.totals("pii", ["email", "ip"], by=("source",)).set_index("source")
    assert pii.loc["fw2", "pii_email"] == 2 and pii.loc["fw", "pii_ip"] == 1
    assert led.manifest("toxicity")["id"].tolist() == ["d1", "d2", "d4"] and led.steps == ["robots", "toxicity", "pii"]


def test_ledger_rejects_duplicates_and_missing_documents():
    docs = _ledger_docs()
    with pytest.raises(ValueError, match="more than once"):
        Ledger.from_documents(docs + docs[:1])
    with pytest.raises(ValueError, match="conservation"):
        Ledger.from_documents(docs[1:]).check_conservation([d.id for d in docs])
    with pytest.raises(ValueError, match="token_count"):
        Ledger.from_documents([Document("x", "y")])
    with pytest.raises(ValueError, match="decision"):
        record(Document("x", "y"), "robots", "dropped")


@pytest.mark.parametrize("count", [-5, "12", 3.5, True])
def test_the_ledger_refuses_a_token_count_it_cannot_trust(count):
    with pytest.raises(ValueError, match=f"'d0' has token_count {re.escape(repr(count))}, which is no count"):
        Ledger.from_documents([Document("some text", "d0", metadata={"token_count": count})])
    import numpy as np
    assert Ledger.from_documents([Document("x", "d1", metadata={"token_count": np.int64(7)})]).frame.tokens[0] == 7


# --- ranking hosts ----------------------------------------------------------------------------------------------------

def test_rank_domains_by_volume_per_language_split():
    df = pd.DataFrame({"url": ["https://a.ch/1", "https://a.ch/2", "https://b.ch/", "https://c.de/", "https://d.fr/", "x"],
                       "text": ["x" * 10, "x" * 10, "x" * 15, "x" * 5, "x" * 50, "x" * 99],
                       "language": ["en", "en", "en", "deu", "fra", "en"], "token_count": [1, 1, 9, 7, 1, 1]})
    r = rank_domains(df, top_n=1)
    assert r.set_index("split")["host"].to_dict() == {"english": "a.ch", "non-english": "d.fr"}
    t = rank_domains(df, top_n=2, by="tokens")
    assert t[t.split == "english"]["host"].tolist() == ["b.ch", "a.ch"] and t[t.split == "non-english"]["host"].tolist() == ["c.de", "d.fr"]
    with pytest.raises(ValueError):
        rank_domains(df.drop(columns="token_count"), 1, by="tokens")


def test_preset_sections_load():
    for name in ("tiny", "apertus-8b"):
        cfg = load_preset(name).section("robots", RobotsConfig)
        assert cfg.policy == "apertus" and cfg.wildcard


# --- the fetcher, against servers on 127.0.0.1 that this test starts and stops ------------------------------------------

class _Behaviour(BaseHTTPRequestHandler):
    kind = "ok"
    log: list = []    # (port, path, start) of every request
    spans: list = []  # (port, start, end) of every handled request
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802
        start = time.monotonic()
        with self.lock:
            self.log.append((self.server.server_port, self.path, start))
        try:
            getattr(self, "kind_" + self.server.kind)()
        finally:
            with self.lock:
                self.spans.append((self.server.server_port, start, time.monotonic()))

    def send(self, code, body=b"", headers=()):
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def kind_ok(self):
        time.sleep(0.05)
        self.send(200, b"User-agent: GPTBot\nDisallow: /\n")

    def kind_missing(self):
        self.send(404, b"not found")

    def kind_error(self):
        self.send(500)

    def kind_flaky(self):
        n = sum(1 for p, *_ in self.log if p == self.server.server_port)
        self.send(503) if n == 1 else self.send(200, b"User-agent: *\nDisallow: /x\n")

    def kind_slow(self):
        time.sleep(2)
        self.send(200, b"User-agent: *\nDisallow: /\n")

    def kind_loop(self):
        self.send(302, headers=[("Location", "/robots.txt")])

    def _chain(self, n):
        step = int(self.path.split("/r")[-1]) if self.path.startswith("/r") and self.path[2:].isdigit() else 0
        if step < n:
            self.send(301, headers=[("Location", f"/r{step + 1}")])
        else:
            self.send(200, b"User-agent: *\nDisallow: /chained\n")

    def kind_chain5(self):
        self._chain(5)

    def kind_chain6(self):
        self._chain(6)

    def kind_ftp(self):
        self.send(302, headers=[("Location", "ftp://127.0.0.1/robots.txt")])

    def kind_huge(self):
        self.send(200, (b"User-agent: *\n" + b"Disallow: /zzz\n" * 150_000))  # 2.2 MB

    def kind_binary(self):
        self.send(200, bytes(range(256)) * 64)

    def log_message(self, *args):
        pass


KINDS = ["ok", "missing", "error", "flaky", "slow", "loop", "chain5", "chain6", "ftp", "huge", "binary"]


def _start(kind: str) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Behaviour)
    srv.daemon_threads, srv.kind = True, kind
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _stop(servers) -> None:
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.fixture(scope="module")
def servers():
    started = {kind: _start(kind) for kind in KINDS}
    yield {k: f"127.0.0.1:{s.server_port}" for k, s in started.items()}
    _stop(started.values())


@pytest.fixture(scope="module")
def fetched(servers):
    _Behaviour.log.clear()
    t0 = time.monotonic()
    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    hosts = [*servers.values(), closed]
    snap = fetch_robots(hosts, scheme="http", concurrency=3, timeout=0.5, retries=1, backoff=0.05, delay=0.2,
                       allow_networks=["127.0.0.0/8"])
    assert list(snap.host) == [*servers.values(), closed.removeprefix("http://")]
    return snap.set_index("host"), time.monotonic() - t0


def test_fetcher_outcomes(servers, fetched):
    snap, _ = fetched
    row = {k: snap.loc[h] for k, h in servers.items()}
    assert row["ok"].http_status == 200 and row["ok"].body == b"User-agent: GPTBot\nDisallow: /\n"
    assert row["missing"].http_status == 404 and row["error"].http_status == 500
    assert row["flaky"].http_status == 200  # retried after the 503
    assert pd.isna(row["slow"].http_status) and "Timeout" in row["slow"].fetch_error
    assert row["loop"].http_status == 302 and "more than 5" in row["loop"].fetch_error and len(row["loop"].redirects) == 5
    assert row["chain5"].http_status == 200 and len(row["chain5"].redirects) == 5 and row["chain5"].final_url.endswith("/r5")
    assert row["chain6"].http_status == 301 and len(row["chain6"].redirects) == 5
    assert row["ftp"].http_status == 302 and "unusable" in row["ftp"].fetch_error
    assert len(row["huge"].body) == MAX_ROBOTS_BYTES  # 2.2 MB served, 500 KiB kept
    assert robots_file(row["binary"].http_status, row["binary"].body).why == "binary"
    refused = snap.loc[snap.index[-1]]
    assert pd.isna(refused.http_status) and "Connect" in refused.fetch_error
    assert list(snap.reset_index().columns) == list(SNAPSHOT_COLUMNS)


def test_fetched_snapshot_drives_the_filter(servers, fetched, tmp_path):
    path = write_snapshot(fetched[0].reset_index(), tmp_path)
    assert path.name == f"robots-{time.strftime('%Y-%m', time.gmtime())}.parquet"
    snap = read_snapshot(path)
    decide = {k: RobotsOracle(snap, RobotsConfig(policy="rfc9309")).decide(f"http://{h}/chained/1") for k, h in servers.items()}
    assert not decide["ok"].kept and decide["ok"].agents == ("GPTBot",)
    assert decide["missing"].kept and not decide["error"].kept and not decide["slow"].kept
    assert not decide["chain5"].kept and decide["chain6"].kept and decide["loop"].reason == "unavailable"
    assert RobotsOracle(snap).decide(f"http://{servers['huge']}/zzz").kept is False


def test_fetcher_is_bounded_and_polite(servers, fetched):
    _, seconds = fetched
    log = _Behaviour.log
    per_port = {}
    for port, _path, t in log:
        per_port.setdefault(port, []).append(t)
    for times in per_port.values():
        assert len(times) <= 7  # ≤ 1 + 5 redirects (+ 1 retry for the transient ones)
        assert all(b - a >= 0.19 for a, b in zip(times, times[1:]))  # ≥ delay between requests to one host
    assert seconds < 20


def test_fetcher_rejects_non_http_schemes():
    with pytest.raises(ValueError):
        fetch_robots(["127.0.0.1:1"], scheme="ftp")
    row = fetch_robots(["file://127.0.0.1/etc"]).iloc[0]  # a bad host is a row, not an abort
    assert pd.isna(row.http_status) and "only http and https" in row.fetch_error


def test_fetcher_bounds_concurrency():
    started = [_start("ok") for _ in range(6)]
    try:
        snap = fetch_robots([f"127.0.0.1:{s.server_port}" for s in started], scheme="http", concurrency=2, delay=0)
        ports = {s.server_port for s in started}
        spans = [(a, b) for p, a, b in _Behaviour.spans if p in ports]
        overlap = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
        assert (snap.http_status == 200).all() and overlap <= 2
    finally:
        _stop(started)


# --- hardening (issue 9): each test failed on the code before the fix ------------------------------------------

def test_explicit_default_port_trailing_dot_and_case_do_not_bypass_robots():
    oracle = RobotsOracle(snapshot({"x.org": "User-agent: *\nDisallow: /a\n"}))
    for url in ("https://x.org/a", "https://x.org:443/a", "http://x.org:80/a", "HTTPS://X.ORG.:443/a"):
        assert not oracle.decide(url).kept, url
    assert oracle.decide("https://x.org:8443/a").reason == "no-robots"  # another port is another host
    row = snapshot({"y.org:443": "User-agent: *\nDisallow: /\n"}).assign(url="https://y.org:443/robots.txt")
    assert not RobotsOracle(row).decide("https://y.org/b").kept  # a snapshot row with the default port, too


def test_backslash_url_is_judged_by_the_host_a_browser_would_visit():
    oracle = RobotsOracle(snapshot({"x.org": "User-agent: *\nDisallow: /\n", "evil.org": "User-agent: *\nAllow: /\n"}))
    d = oracle.decide("http://x.org\\@evil.org/")
    assert d.host == "x.org" and not d.kept


def test_an_undated_row_never_overrides_a_dated_fetch():
    snap = pd.concat([snapshot({"x.org": "User-agent: *\nDisallow: /\n"}),
                      snapshot({"x.org": "User-agent: *\nAllow: /\n"}).assign(fetched_at=None)], ignore_index=True)
    assert not RobotsOracle(snap).decide("https://x.org/p").kept


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_status_that_is_no_http_status_fails_closed_with_a_reason(policy):
    snap = snapshot({"x.org": "User-agent: *\nAllow: /\n"}).astype({"http_status": object})
    snap.loc[0, "http_status"] = "two hundred"
    d = RobotsOracle(snap, RobotsConfig(policy=policy)).decide("https://x.org/p")
    assert not d.kept and d.reason == "invalid" and "two hundred" in robots_file("two hundred", b"").why


def test_a_bom_in_the_string_does_not_disable_the_first_group():
    assert not is_allowed("\ufeffUser-agent: GPTBot\nDisallow: /\n", "https://a.org/x", "GPTBot")


def test_http_429_is_a_temporary_failure_like_5xx():
    assert robots_file(429, b"").status == robots_file(503, b"").status == "unreachable"
    snap = snapshot({"x.org": (429, b"")})
    assert RobotsOracle(snap).decide("https://x.org/p").kept  # apertus: usable
    assert not RobotsOracle(snap, RobotsConfig(policy="rfc9309")).decide("https://x.org/p").kept


def test_a_nul_byte_does_not_make_a_robots_txt_binary():
    f = robots_file(200, b"User-agent: *\nDisallow: /private\n# built by \x00 tool\n")
    assert f.status == "ok" and not is_allowed(f.text, "https://a.org/private/1", "GPTBot")


@pytest.mark.parametrize("policy", list(POLICIES))
def test_control_bytes_in_a_comment_do_not_make_a_short_robots_txt_binary(policy):
    body = b"User-agent: GPTBot\nDisallow: /\n# exported by \x01\x02\x03 tool\n"  # 3 of 50 bytes are controls
    assert robots_file(200, body).status == "ok"
    d = RobotsOracle(snapshot({"a.org": body}), RobotsConfig(policy=policy)).decide("https://a.org/page")
    assert not d.kept and d.reason == "disallowed-url" and d.agents == ("GPTBot",)
    blob = robots_file(200, bytes(range(1, 9)) * 64)  # control bytes and no rule keyword: still binary
    assert (blob.status, blob.why) == ("unavailable", "binary")


def test_an_oversized_file_with_cr_line_endings_keeps_its_rules():
    body = b"User-agent: *\rDisallow: /private\r" + b"# padding line\r" * 40_000  # 600 KB, CR only
    f = robots_file(200, body)
    assert f.status == "ok" and len(f.text) <= MAX_ROBOTS_BYTES and f.text.endswith("\r")
    assert not is_allowed(f.text, "https://a.org/private/1", "GPTBot")


def test_the_parse_cache_is_bounded_by_the_size_of_the_texts():
    from openpretrain.compliance import robots
    cache = robots._ParseCache(max_chars=300_000)
    texts = [f"User-agent: *\nDisallow: /{i}\n" + "# x\n" * 25_000 for i in range(10)]  # ~100 KB each
    for t in texts:
        assert not cache.get(t).can_fetch(f"https://a.org/{texts.index(t)}", "X")
    assert cache.chars <= 300_000 and len(cache.items) == 2 and texts[-1] in cache.items
    assert robots.parse_robots.__module__ == robots.__name__ and robots._PARSED.max_chars == robots.PARSE_CACHE_CHARS


HTTP_CLIENTS = ("httpx", "aiohttp", "requests", "urllib3", "http.client", "urllib.request", "socket")

_POLICY_PROBE = """
import sys
import datatrove.pipeline.filters.base_filter, pandas as pd, protego, openpretrain.compliance.ledger, openpretrain.corpus
before = set(sys.modules)  # what the policy's own dependencies load
from openpretrain.compliance.robots import RobotsOracle
oracle = RobotsOracle(pd.DataFrame({"host": ["a.org"], "http_status": [200], "body": [b"User-agent: *\\nDisallow: /\\n"]}))
assert not oracle.decide("https://a.org/x").kept
print(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("httpx", "aiohttp", "requests", "urllib3")
             or m in ("http.client", "urllib.request", "openpretrain.compliance.robots_fetch")))
"""


def test_the_robots_policy_imports_no_http_client():
    "The policy decides from a stored snapshot: no HTTP client anywhere in its code, none loaded by importing and using it."
    import ast
    import subprocess
    import sys

    from openpretrain.compliance import robots
    imported = set()
    for node in ast.walk(ast.parse(Path(robots.__file__).read_text(encoding="utf-8"))):  # function bodies included
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module)
    assert not {m for m in imported for c in HTTP_CLIENTS if m == c or m.startswith(f"{c}.")}
    assert not hasattr(robots, "fetch_robots")  # the fetcher is openpretrain.compliance.robots_fetch (notebook 02a)
    lib = str(Path(robots.__file__).parents[2])  # this checkout's lib/, whatever the venv's editable install points at
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [lib, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _POLICY_PROBE], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout


class _Scripted(BaseHTTPRequestHandler):
    "Answers each request with the next of `script` (status, headers, body); logs request times."
    script: list = []
    times: list = []

    def do_GET(self):  # noqa: N802
        self.times.append(time.monotonic())
        status, headers, body = self.script[min(len(self.times), len(self.script)) - 1]
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    def start(*script):
        _Scripted.script, _Scripted.times = list(script), []
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return f"127.0.0.1:{srv.server_port}"
    started = []
    yield start
    _stop(started)


def test_one_bad_host_becomes_a_row_and_the_others_are_kept(scripted):
    ok = scripted((200, [], b"User-agent: *\nDisallow: /\n"))
    bad = ["[::1", "127.0.0.1:99999", None, b"bytes.org", "\ud800.org", "file:///etc/passwd"]
    snap = fetch_robots([*bad, ok], scheme="http", timeout=2, retries=0, delay=0, allow_networks=["127.0.0.0/8"])
    assert len(snap) == len(bad) + 1
    assert snap.iloc[-1].http_status == 200 and snap.iloc[-1].host == ok
    assert snap.fetch_error.iloc[:-1].str.startswith("invalid host").all() and snap.http_status.iloc[:-1].isna().all()


def test_a_redirect_to_a_non_public_address_is_refused_and_recorded(scripted):
    host = scripted((302, [("Location", "http://127.0.0.2:9/robots.txt")], b""))
    snap = fetch_robots([host], scheme="http", timeout=2, retries=0, delay=0, allow_networks=["127.0.0.1/32"])
    row = snap.iloc[0]
    assert row.http_status == 302 and "redirect refused" in row.fetch_error and "127.0.0.2" in row.fetch_error
    assert row.body == b"" and list(row.redirects) == [] and len(_Scripted.times) == 1


def test_public_only_refuses_a_loopback_host_before_any_request(scripted):
    host = scripted((200, [], b"User-agent: *\nAllow: /\n"))
    snap = fetch_robots([host], scheme="http", timeout=2, retries=0, delay=0, public_only=True)
    assert pd.isna(snap.iloc[0].http_status) and "non-public address 127.0.0.1" in snap.iloc[0].fetch_error
    assert _Scripted.times == []


def test_retry_after_is_honoured_before_the_retry(scripted):
    host = scripted((429, [("Retry-After", "1")], b""), (200, [], b"User-agent: *\nDisallow: /x\n"))
    snap = fetch_robots([host], scheme="http", timeout=2, retries=1, backoff=0.01, delay=0,
                        allow_networks=["127.0.0.0/8"])
    assert snap.iloc[0].http_status == 200 and len(_Scripted.times) == 2
    assert 0.95 <= _Scripted.times[1] - _Scripted.times[0] < 3


def test_a_retry_after_beyond_the_bound_ends_the_attempts_as_a_429(scripted):
    host = scripted((429, [("Retry-After", "3600")], b""))
    t0 = time.monotonic()
    snap = fetch_robots([host], scheme="http", timeout=2, retries=3, backoff=0.01, delay=0, max_retry_after=5,
                        allow_networks=["127.0.0.0/8"])
    assert time.monotonic() - t0 < 3 and len(_Scripted.times) == 1
    assert snap.iloc[0].http_status == 429 and "Retry-After 3600" in snap.iloc[0].fetch_error
    assert not RobotsOracle(snap, RobotsConfig(policy="rfc9309")).decide(f"http://{host}/p").kept


@pytest.mark.parametrize("stated, bound, gap", [("1", 30.0, (0.95, 3.0)), ("3600", 0.5, (0.45, 2.0))])
def test_crawl_delay_spaces_the_next_request_to_that_host_within_a_bound(scripted, stated, bound, gap):
    from openpretrain.compliance.robots_fetch import Politeness
    host = scripted((200, [], f"User-agent: *\nCrawl-delay: {stated}\nDisallow: /x\n".encode()))
    polite = Politeness(delay=0, max_crawl_delay=bound)
    for _ in range(2):
        snap = fetch_robots([host], scheme="http", timeout=2, retries=0, politeness=polite)
        assert snap.iloc[0].http_status == 200
    assert gap[0] <= _Scripted.times[1] - _Scripted.times[0] < gap[1]


# --- strict RFC 9309 matching (cases written from the RFC text and Google's documented parser behaviour) --------

def strict(txt: str, path: str, agent: str = "GPTBot") -> bool:
    from openpretrain.compliance.robots import strict_allowed
    return strict_allowed(txt, f"https://a.org{path}", agent)


def test_strict_user_agent_line_counts_by_its_first_product_token_only():
    assert not strict("User-agent: GPTBot FOO BAR\nDisallow: /\n", "/x")             # "GPTBot FOO BAR" is gptbot
    assert strict("User-agent: FOO GPTBot\nDisallow: /\n", "/x")                      # ... and "FOO GPTBot" is foo
    assert not strict("User-agent: ccbot/2.0\nDisallow: /\n", "/x", "CCBot")          # the version is not the token
    assert not strict("User-agent: gPtBoT\nDisallow: /\n", "/x")                      # case-insensitive (§2.2.1)


def test_strict_unknown_directives_do_not_close_a_group():
    txt = "User-agent: GPTBot\nCrawl-delay: 5\nSitemap: https://a.org/s.xml\nUser-agent: CCBot\nDisallow: /p\n"
    assert not strict(txt, "/p") and not strict(txt, "/p", "CCBot")


def test_strict_groups_for_one_agent_merge_and_named_groups_replace_the_star_group():
    txt = "User-agent: *\nDisallow: /s\n\nUser-agent: GPTBot\nDisallow: /a\n\nUser-agent: gptbot\nDisallow: /b\n"
    assert not strict(txt, "/a") and not strict(txt, "/b") and strict(txt, "/s")
    assert not strict(txt, "/s", "CCBot") and strict(txt, "/a", "CCBot")


def test_strict_percent_escapes_and_non_ascii_are_normalised_before_matching():
    assert not strict("User-agent: *\nDisallow: /ä\n", "/%C3%A4/x")
    assert not strict("User-agent: *\nDisallow: /%c3%a4\n", "/ä")
    assert not strict("User-agent: *\nDisallow: /a%2fb\n", "/a%2Fb")
    assert strict("User-agent: *\nDisallow: /ä\n", "/a")


def test_strict_longest_match_allow_on_ties_wildcards_and_anchor():
    txt = "User-agent: *\nDisallow: /p\nAllow: /p/ok\nDisallow: /t\nAllow: /t\nDisallow: /*.pdf$\nDisallow:\n"
    assert not strict(txt, "/p/x") and strict(txt, "/p/ok/1") and strict(txt, "/t/1")   # longest; Allow wins a tie
    assert not strict(txt, "/doc/a.pdf") and strict(txt, "/doc/a.pdf?x=1")              # `*` and `$`
    assert strict(txt, "/robots.txt") and strict("User-agent: *\nDisallow: /\n", "/robots.txt")
    assert strict("User-agent: other\nDisallow: /\n", "/x")                              # no group applies: allowed


def test_strict_colonless_two_word_lines_and_key_misspellings_count():
    assert not strict("User-agent GPTBot\nDisallow /x\n", "/x/1")
    assert not strict("User agent: GPTBot\nDisalow: /x\n", "/x/1")
    assert strict("User-agent: GPTBot\nDisallow /x /y\n", "/x/1")                      # three words: not a line


def test_strict_matching_is_a_config_switch_of_the_filter():
    snap = snapshot({"a.org": "User-agent: GPTBot FOO\nDisallow: /\n"})
    assert not RobotsOracle(snap, RobotsConfig(matching="strict", agents=["GPTBot"], wildcard=False)).decide("https://a.org/x").kept
    with pytest.raises(ConfigError):
        RobotsConfig(matching="google")
