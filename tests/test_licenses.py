"""The SFT licence policy: what it keeps, what it excludes and why; unknown is never included; a compound
dataset complies only if every constituent does; the shipped collections parse and sum as their cards say."""
import pytest

from openpretrain.core import ConfigError
from openpretrain.posttrain.licenses import Collection, Component, decide, decide_collection, load_collection


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
