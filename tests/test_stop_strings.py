from hypothesis import given
from hypothesis import strategies as st

from mlx_engine.tokenization.stop_strings import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, stop = m.feed(p)
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    return "".join(out) + m.flush(), None


def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """The stop a left-to-right reader completes first (longest on a tie), by brute force."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def test_no_stops_passthrough_holds_nothing():
    m = StopMatcher([])
    assert m.feed("hello") == ("hello", None)
    assert m.feed(" world") == (" world", None)
    assert m.flush() == ""
    m = StopMatcher([""])  # an empty stop means nothing
    assert m.feed("abc") == ("abc", None)


def test_split_one_char_at_a_time():
    m = StopMatcher(["</answer>"])
    emitted = []
    for ch in "The result is 42</answer> and more":
        text, stop = m.feed(ch)
        emitted.append(text)
        if stop:
            break
    assert "".join(emitted) == "The result is 42"
    assert stop == "</answer>"
    assert m.matched == "</answer>"
    assert m.feed("anything") == ("", None)
    assert m.flush() == ""


def test_holds_only_possible_prefix():
    m = StopMatcher(["STOP"])
    assert m.feed("abcS") == ("abc", None)
    assert m.feed("T") == ("", None)
    assert m.feed("x") == ("STx", None)  # "STx" can no longer become "STOP"
    assert m.feed("ST") == ("", None)
    assert m.flush() == "ST"


def test_partial_prefix_then_restart():
    # "aab" with stop "ab": the first "a" is safe once the second arrives
    m = StopMatcher(["ab"])
    assert m.feed("a") == ("", None)
    assert m.feed("a") == ("a", None)
    assert m.feed("b") == ("", "ab")


def test_stop_at_start():
    assert run(["Hello"], ["Hello world"]) == ("", "Hello")
    assert run(["Hello"], list("Hello world")) == ("", "Hello")


def test_earliest_stop_wins():
    assert run(["world", "hello"], ["say hello world"]) == ("say ", "hello")
    assert run(["world", "hello"], list("say hello world")) == ("say ", "hello")
    assert run(["world", "hello"], ["say wor", "ld hello"]) == ("say ", "world")


def test_overlapping_stops():
    # "b" is completed before "xbc" whether fed whole or in pieces
    assert run(["xbc", "b"], ["xbc"]) == ("x", "b")
    assert run(["xbc", "b"], list("xbc")) == ("x", "b")
    # same end: the longer one (earlier start) wins
    assert run(["bc", "abc"], ["zabc"]) == ("z", "abc")
    assert run(["bc", "abc"], list("zabc")) == ("z", "abc")
    # self-overlapping stop
    assert run(["aab"], list("aaaab!")) == ("aa", "aab")


def test_text_after_stop_dropped():
    assert run(["\n\n"], ["one\n", "\ntwo", "three"]) == ("one", "\n\n")


def test_unicode():
    assert run(["。終"], list("日本語です。終わり")) == ("日本語です", "。終")
    assert run(["👋🏽"], ["hi ", "👋", "🏽", " there"]) == ("hi ", "👋🏽")
    assert run(["é"], ["cafe\u0301"]) == ("cafe\u0301", None)  # decomposed é is not "é"


alphabet = st.sampled_from("abc🙂")


@given(
    stops=st.lists(st.text(alphabet, min_size=0, max_size=4), max_size=4),
    text=st.text(alphabet, max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_matches_reference_for_any_split(stops, text, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert run(stops, pieces) == reference(stops, text)


@given(
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=4),
    text=st.text(alphabet, max_size=30),
)
def test_holds_back_exactly_the_longest_possible_prefix(stops, text):
    m = StopMatcher(stops)
    emitted = ""
    for i, ch in enumerate(text):
        out, stop = m.feed(ch)
        emitted += out
        if stop:
            return
        seen = text[: i + 1]
        held = seen[len(emitted) :]
        assert emitted + held == seen
        longest = max(
            (
                n
                for n in range(1, len(seen) + 1)
                if any(s != seen[-n:] and s.startswith(seen[-n:]) for s in stops)
            ),
            default=0,
        )
        assert len(held) == longest
