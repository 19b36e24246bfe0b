"""The manifests' YAML writer (engine.tools.manifest_yaml): what it writes
reads back, through PyYAML, as the value it was given."""
import pytest
from manifest_helpers import yaml

from engine.tools.manifest_yaml import Comment, documents, dump, scalar

TRICKY_STRINGS = ["yes", "No", "on", "null", "~", "y", "true", "0.0.0.0", "8080", "1e3", "0x1F",
                  "20m", "", " lead", "trail ", "a: b", "a #b", "#x", "-", "- x", "--config",
                  "-w", "/dev/shm", "app:make()", "[x]", "{x}", "*x", "&x", "!x", "%x", "@x",
                  "'q'", '"q"', "back\\slash", "tab\there", "é ü", "x\r\ny", "line\n",
                  "two\nlines\n", "no end\nnewline", "kept\n\n", "  indented\nsecond",
                  "\nleading newline", "# not a comment\n  indented", "2024-01-01", ".inf",
                  "-.5", "+1", "NaN"]


@pytest.mark.parametrize("text", TRICKY_STRINGS)
def test_a_string_reads_back_as_itself(text):
    assert yaml.safe_load(dump({"k": text, "l": [text]})) == {"k": text, "l": [text]}


@pytest.mark.parametrize("number", [0, -3, 1 << 40, 0.02, 1e-05, 2.5e-07, 1e20, -0.0, 3.0])
def test_a_number_reads_back_as_itself_with_its_type(number):
    back = yaml.safe_load(dump({"n": number}))["n"]
    assert back == number and type(back) is type(number)


def test_nesting_empty_containers_and_booleans_read_back():
    value = {"a": [{"b": [1, [2, 3]], "c": {}}, [], None, True, False],
             "prometheus.io/port": "9090", "d": {"e": {"f": []}}}
    assert yaml.safe_load(dump(value)) == value


def test_comments_are_comments_wherever_they_stand():
    value = {Comment("top\nof two lines"): None, "a": 1,
             "b": [{Comment("before the item"): None, "c": 2, Comment("inside"): None, "d": 3}]}
    text = documents([("the document's own", value), ("", {"e": 4})])
    assert [d for d in yaml.safe_load_all(text)] == [{"a": 1, "b": [{"c": 2, "d": 3}]}, {"e": 4}]
    comments = [line.strip() for line in text.splitlines() if line.lstrip().startswith("#")]
    assert comments == ["# the document's own", "# top", "# of two lines", "# before the item",
                        "# inside"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), b"bytes", object()])
def test_a_value_yaml_cannot_carry_is_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        scalar(bad)


def test_a_key_that_is_not_a_string_is_refused():
    with pytest.raises(TypeError):
        dump({1: "x"})
