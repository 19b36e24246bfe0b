"""Stop strings: the cut (at the earliest end of any stop, before its start), what is
held back while the text may still begin a stop, the work per character, and the
bounds a request's `stop` field is read against."""
import random

import pytest

from engine.http.openai import fields
from engine.http.openai.replies import OpenAIError
from engine.http.openai.text import Stops


def reference(text: str, stops) -> tuple:
    """The cut over the whole text at once: before the stop that ends earliest
    (the longest of those ending there), or all of it and no stop."""
    for end in range(1, len(text) + 1):
        ending = [len(s) for s in stops if text[:end].endswith(s)]
        if ending:
            return text[:end - max(ending)], True
    return text, False


def fed(stops, pieces) -> tuple:
    """(the answer's text, whether a stop came) from feeding pieces, then flushing."""
    cut, out = Stops(stops), []
    for piece in pieces:
        text, stopped = cut.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + cut.flush(), False


def longest_beginning(text: str, stops) -> int:
    """The length of the longest end of text that is a beginning of some stop."""
    return max((k for s in stops for k in range(1, min(len(s), len(text)) + 1)
                if text.endswith(s[:k])), default=0)


def chunks(rng: random.Random, text: str) -> list:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) \
        if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def random_case(rng: random.Random) -> tuple:
    alphabet = rng.choice(["ab", "abc", "ab é"])
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
             for _ in range(rng.randint(1, fields.MAX_STOPS))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    return stops, text


def test_any_chunking_cuts_the_text_where_the_whole_text_would_be_cut():
    rng = random.Random(37)
    for _ in range(3000):
        stops, text = random_case(rng)
        pieces = chunks(rng, text)
        assert fed(stops, pieces) == reference(text, stops), (stops, pieces)


def test_what_is_held_back_is_exactly_the_longest_end_that_begins_a_stop():
    rng = random.Random(38)
    for _ in range(1000):
        stops, text = random_case(rng)
        cut, given, seen = Stops(stops), "", ""
        for piece in chunks(rng, text):
            out, stopped = cut.feed(piece)
            given, seen = given + out, seen + piece
            if stopped:
                break
            assert seen == given + seen[len(given):]
            assert len(seen) - len(given) == longest_beginning(seen, stops), (stops, seen)


def test_a_stop_spanning_pieces_is_found_and_none_of_it_handed_out():
    cut = Stops(["wörld"])
    assert cut.feed("hello w") == ("hello ", False)
    assert cut.feed("ö") == ("", False)
    assert cut.feed("rld again") == ("", True)


def test_of_overlapping_stops_the_one_ending_first_cuts():
    assert fed(["abcd", "bc"], ["xab", "cd"]) == ("xa", True)  # "bc" ends before "abcd"


def test_of_stops_ending_at_one_character_the_longest_cuts():
    assert fed(["abcd", "cd"], ["xabc", "d"]) == ("x", True)


def test_a_stop_that_begins_another_ends_the_text_first():
    assert fed(["ab", "abc"], ["xa", "bc"]) == ("x", True)
    assert fed(["abc", "ab"], ["xabc"]) == ("x", True)


def test_a_near_miss_is_handed_out_once_it_cannot_begin_a_stop():
    cut = Stops(["aaab"])
    assert cut.feed("aaaa") == ("a", False)  # "aaa" may still begin "aaab"
    assert cut.feed("c") == ("aaac", False)


def test_text_that_ends_without_a_stop_is_flushed_whole():
    cut = Stops(["xyz"])
    assert cut.feed("ab xy") == ("ab ", False)
    assert cut.flush() == "xy"
    assert cut.flush() == ""


def test_after_a_stop_nothing_more_is_handed_out():
    cut = Stops(["b"])
    assert cut.feed("ab") == ("a", True)
    assert cut.feed("cd") == ("", True)
    assert cut.flush() == ""


def test_no_stops_hand_out_every_piece_as_it_comes():
    cut = Stops([])
    assert cut.feed("abc") == ("abc", False) and cut.flush() == ""


def work_per_character(stops, text: str, piece_chars: int = 1) -> float:
    cut = Stops(stops)
    for i in range(0, len(text), piece_chars):
        if cut.feed(text[i:i + piece_chars])[1]:
            break
    return cut.steps / len(text)


@pytest.mark.parametrize("stops, text", [
    (["aaab"], "a" * 20000 + "b"),
    (["a" * 255 + "b"], ("a" * 300 + "c") * 60),  # each "c" falls back the whole stop
    (["ab" * 128, "b" * 256, "a" * 256, "ba" * 128], "ab" * 10000),
    (["abc" * 85 + "x", "bca" * 85 + "y"], "abc" * 6000 + "x"),
])
def test_the_automaton_moves_at_most_twice_per_character(stops, text):
    for piece_chars in (1, 4, 97):
        assert work_per_character(stops, text, piece_chars) <= 2.0


def test_a_longer_stop_costs_no_more_per_character():
    short = work_per_character(["aaab"], "a" * 20000)
    long = work_per_character(["a" * (fields.MAX_STOP_CHARS - 1) + "b"], "a" * 20000)
    assert long <= short <= 2.0  # one move, and one fall back from a full "aaa"


def refusal(stop) -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        fields.stops({"stop": stop})
    assert (refused.value.status, refused.value.param) == (400, "stop")
    return refused.value


def test_the_most_stops_of_the_longest_length_are_taken():
    most = ["é" * fields.MAX_STOP_CHARS] * fields.MAX_STOPS
    assert fields.stops({"stop": most}) == most
    assert fields.stops({"stop": "\n"}) == ["\n"] and fields.stops({}) == []


def test_more_stops_than_openai_allows_are_refused_saying_how_many():
    error = refusal(["a" * fields.MAX_STOP_CHARS] * (fields.MAX_STOPS + 1))
    assert fields.MAX_STOPS == 4
    assert "at most 4" in str(error) and "got a list of 5" in str(error)
    assert len(str(error)) < 300  # what came, cut short


@pytest.mark.parametrize("stop", ["x" * (fields.MAX_STOP_CHARS + 1),
                                  ["\n", "x" * 10 ** 6]])
def test_an_over_long_stop_is_refused_saying_its_length(stop):
    error = refusal(stop)
    longest = max(len(s) for s in ([stop] if isinstance(stop, str) else stop))
    assert f"at most {fields.MAX_STOP_CHARS} characters" in str(error)
    assert f"one of {longest} characters" in str(error) and len(str(error)) < 300


@pytest.mark.parametrize("stop", ["", ["a", ""], 7, ["a", 7], {"a": 1}, [["a"]]])
def test_an_empty_or_non_string_stop_is_refused(stop):
    assert "expected a non-empty string" in str(refusal(stop))
