"""The SFT licence policy: what it keeps, what it excludes and why; unknown is never included; a compound
dataset complies only if every constituent does; the shipped collections parse and sum as their cards say."""
import pytest

from openpretrain.core import ConfigError
from openpretrain.posttrain.licenses import Collection, Component, Decision, decide, decide_collection, load_collection


@pytest.mark.parametrize("licence", ["Apache-2.0", "MIT", "ODC-BY-1.0", "CC-BY-4.0", "CC0-1.0", "LicenseRef-public-domain"])
def test_permissive_licences_are_kept(licence):
    assert decide(Component(name="x", licence=licence)).keep


@pytest.mark.parametrize("licence, why", [("CC-BY-NC-4.0", "non-commercial"), ("CC-BY-NC-SA-4.0", "non-commercial"),
                                          ("CC-BY-SA-4.0", "share-alike"), ("GPL-2.0-or-later", "share-alike"),
                                          ("MPL-2.0", "share-alike"), (None, "unknown"), ("", "unknown"),
                                          ("BSD", "unknown"), ("Proprietary", "unknown")])
def test_everything_else_is_excluded_with_its_reason(licence, why):
    d = decide(Component(name="x", licence=licence))
    assert not d.keep and why in d.reason


def test_an_opt_out_excludes_whatever_the_licence():
    d = decide(Component(name="x", licence="MIT", opted_out=True))
    assert not d.keep and "opted out" in d.reason


def test_a_compound_dataset_complies_only_if_every_constituent_does():
    ok = [Component(name="a", licence="MIT"), Component(name="b", licence="Apache-2.0")]
    assert decide_collection(Collection(name="c", components=ok)).keep
    mixed = Collection(name="c", components=[*ok, Component(name="nc", licence="CC-BY-NC-4.0")])
    d = decide_collection(mixed)
    assert not d.keep and "nc" in d.reason and "1 of 3" in d.reason


def test_the_tulu_mixture_as_its_card_states_it():
    tulu = load_collection("tulu-3-sft-mixture")
    assert sum(c.rows for c in tulu.components) == 889_344 and tulu.card_rows == 939_344     # the card's 50,000 gap
    assert {c.name for c in tulu.components if c.apertus_excluded} == {"FLAN v2", "No Robots", "Tulu 3 Hardcoded"}
    excluded = {c.name for c in tulu.components if not decide(c).keep}
    assert excluded == {"FLAN v2", "No Robots"} and not decide_collection(tulu).keep


def test_a_collection_with_an_unknown_key_is_refused(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("name: x\ncomponents:\n  - {name: a, licence: MIT, licnse: typo}\n")
    with pytest.raises(ConfigError, match="licnse"):
        load_collection(bad)


def test_a_collections_own_non_commercial_licence_binds_its_permissive_components():
    d = decide_collection(Collection(name="c", licence="CC-BY-NC-4.0", components=[Component(name="a", licence="MIT")]))
    assert not d.keep and "own licence" in d.reason and "non-commercial" in d.reason


def test_a_collection_with_an_unknown_own_licence_is_excluded():
    for own in ("", "WTFPL"):
        d = decide_collection(Collection(name="c", licence=own, components=[Component(name="a", licence="MIT")]))
        assert not d.keep and "unknown" in d.reason


def test_a_collection_listing_no_components_is_excluded():
    for own in (None, "MIT"):
        d = decide_collection(Collection(name="c", licence=own))
        assert not d.keep and "no constituents" in d.reason


@pytest.mark.parametrize("rows, why", [((10, 5), "5 of the 20 rows"), ((10, None), "no rows stated for b")])
def test_rows_the_card_counts_in_no_listed_component_exclude_the_collection(rows, why):
    parts = [Component(name=n, licence="MIT", rows=r) for n, r in zip("ab", rows)]
    d = decide_collection(Collection(name="c", licence="MIT", card_rows=20, components=parts))
    assert not d.keep and why in d.reason
    assert decide_collection(Collection(name="c", licence="MIT", card_rows=15, components=parts[:1] + [
        Component(name="b", licence="MIT", rows=5)])).keep


def test_a_grouping_without_a_licence_of_its_own_is_decided_by_its_constituents():
    ours = Collection(name="udhr", components=[Component(name="a", licence="LicenseRef-public-domain")])
    assert decide_collection(ours) == Decision(True, "every constituent complies")      # chapter 16's per-source groups


@pytest.mark.parametrize("text, why", [(None, "no such licence file"), ("", "a mapping with a name"),
                                       ("# only a comment\n", "a mapping with a name"), ("- a\n- b\n", "got list"),
                                       ("components: []\n", "a mapping with a name"),
                                       ("name: x\ncomponents: [{licence: MIT}]\n", "name"),
                                       (b"name: \xe9t\xe9\n", "not UTF-8"), ("name: [\n", "invalid YAML")])
def test_a_missing_empty_or_malformed_licence_file_is_one_config_error_naming_it(tmp_path, text, why):
    path = tmp_path / "bad.yaml"
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=why) as e:
        load_collection(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_licence_name_that_names_no_file_is_one_config_error():
    with pytest.raises(ConfigError, match="no-such-collection.yaml: no such licence file"):
        load_collection("no-such-collection")
