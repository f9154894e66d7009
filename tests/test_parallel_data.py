"""The German↔Romansh Firefox parallel set (data/parallel/firefox-de-rm.parquet): schema, cleanliness, a known pair,
the loader's errors, and the Fluent parsing the builder (01b) makes it with."""
import hashlib
import re

import pandas as pd
import pytest

from openpretrain import corpus as C
from openpretrain.tools import build as B


@pytest.fixture(scope="module")
def ff() -> pd.DataFrame:
    return C.load_parallel("firefox-de-rm")


def test_schema_and_order(ff):
    assert list(ff.columns) == C.PARALLEL_SCHEMA.names == ["id", "file", "message", "attribute", "de", "rm"]
    assert len(ff) > 5000 and ff.id.is_unique and list(ff.id) == sorted(ff.id)
    assert (ff.id == ff.file + ":" + ff.message + ff.attribute.map(lambda a: f".{a}" if a else "")).all()
    assert ff.file.str.endswith(".ftl").all() and not ff.file.str.contains("localization/").any()


def test_no_empty_identical_or_repeated_pairs(ff):
    assert (ff.de.str.strip() != "").all() and (ff.rm.str.strip() != "").all()
    assert (ff.de != ff.rm).all()
    assert not ff.duplicated(["de", "rm"]).any()


def test_plain_text_with_matching_placeables(ff):
    for de, rm in zip(ff.de, ff.rm):
        assert B.plain_pattern(de) == de and B.plain_pattern(rm) == rm  # no select expression, no other placeable
        assert sorted(re.findall(r"\{ [^}]* \}", de)) == sorted(re.findall(r"\{ [^}]* \}", rm))
    assert not ff.message.str.lower().str.endswith("accesskey").any()
    assert not ff.attribute.str.contains("(?i)key|style|width|height").any()


def test_known_pairs(ff):
    rows = ff.set_index("id")
    label = rows.loc["browser/browser/allTabsMenu.ftl:all-tabs-menu-search-tabs.label"]
    assert (label.de, label.rm, label.attribute) == ("Tab suchen", "Tschertgar en ils tabs", "label")
    card = rows.loc["browser/browser/profiles.ftl:profile-card.aria-label"]
    assert (card.de, card.rm) == ("{ $profileName } öffnen", "Avrir { $profileName }")
    cert = rows.loc["toolkit/neterror/nsserrors.ftl:sec-error-duplicate-cert"]
    assert (cert.de, cert.rm) == ("Zertifikat existiert bereits in Ihrer Datenbank.",
                                  "Il certificat exista gia en tia banca da datas.")


def test_untranslated_english_strings_are_left_out(ff):
    # devtools strings the Romansh team has not translated are English in the pack: none of them is a pair
    assert "browser/devtools/client/toolbox-options.ftl:options-collapse-attrs-label" not in set(ff.id)


def test_provenance_records_the_set(ff):
    text = (C.data_dir() / "PROVENANCE.md").read_text()
    rel = C.CORPUS_FILES["firefox-de-rm"]
    digest = hashlib.sha256((C.data_dir() / rel).read_bytes()).hexdigest()
    assert re.search(rf"`{re.escape(rel)}` \| {len(ff):,} \|.*`{digest}`", text)
    assert f"{len(ff):,} German↔Romansh" in text and "the German side is not" in text
    for package in (*B.PARALLEL_PACKS.values(), B.ENGLISH_PACK[1]):
        assert B.pinned_sources()[package].sha256 in text


def test_loader_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown parallel set 'udhr'"):
        C.load_parallel("udhr")
    with pytest.raises(FileNotFoundError, match="make data"):
        C.load_parallel(root=tmp_path)


def test_fluent_parsing():
    text = ("# a comment\n-brand-short-name = Firefox\nsave =\n    .label = Speichern\n    .accesskey = S\n"
            "save-accesskey = p\nintro = Zeile eins\n    Zeile zwei\ncount = { $n ->\n   *[other] { $n } Tabs\n    }\n"
            "when = Am { DATETIME($d) }\nopen = {$name} öffnen\n")
    entries = B.fluent_entries(text)
    assert entries == {"save": "", "save.label": "Speichern", "intro": "Zeile eins\nZeile zwei",
                       "count": "{ $n ->\n*[other] { $n } Tabs\n}", "when": "Am { DATETIME($d) }",
                       "open": "{$name} öffnen"}
    plain = {k: B.plain_pattern(v) for k, v in entries.items()}
    assert plain == {"save": None, "save.label": "Speichern", "intro": "Zeile eins\nZeile zwei", "count": None,
                     "when": None, "open": "{ $name } öffnen"}


def test_parallel_rows_filters():
    de = {"a.ftl:x": "Schliessen", "a.ftl:y": "Web-Konsole", "a.ftl:z": "OK", "a.ftl:w": "Schliessen",
          "a.ftl:v": "{ $n } Tabs", "a.ftl:u": "Nur Deutsch"}
    rm = {"a.ftl:x": "Serrar", "a.ftl:y": "Web Console", "a.ftl:z": "OK", "a.ftl:w": "Serrar", "a.ftl:v": "Tabs"}
    rows = B.parallel_rows(de, rm, {"a.ftl:y": "Web Console"})
    assert [(r["id"], r["de"], r["rm"]) for r in rows] == [("a.ftl:w", "Schliessen", "Serrar")]
