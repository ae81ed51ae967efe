"""Request output state: incremental text, stop strings cut at their start, held-back text while streaming."""

from factories import CharDetokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from amoe.logprobs import Logprobs
from amoe.request_rules import StopMatcher
from coordinator.requests.request_state import RequestState


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_text_accumulates_and_streams_without_stop_strings():
    state = RequestState(CharDetokenizer(), [], num_prompt_tokens=3)
    state.append(ids("ab"), None)
    assert state.take_text() == "ab"
    state.append(ids("c"), "length")
    assert state.take_text() == "c"
    assert (state.text, state.finish_reason, state.num_output_tokens) == ("abc", "length", 3)


def test_the_token_that_ends_the_output_is_no_text():
    """As in vLLM: an eos or stop_token_ids token that stopped the output is counted but not detokenized (a
    `skip_special_tokens: false` output would otherwise end in "</s>"); when it did not stop it, it is text."""
    end = frozenset({ord("$")})
    state = RequestState(CharDetokenizer(), [], num_prompt_tokens=1, end_token_ids=end)
    state.append(ids("a$b"), None)
    state.append(ids("c$"), "stop")
    assert (state.text, state.num_output_tokens, state.finish_reason) == ("a$bc", 5, "stop")
    capped = RequestState(CharDetokenizer(), [], num_prompt_tokens=1, end_token_ids=end)
    capped.append(ids("c$"), "length")  # max_tokens ended it, not the token
    assert capped.text == "c$"


def test_stop_string_truncates_and_finishes_with_stop():
    state = RequestState(CharDetokenizer(), ["END"], num_prompt_tokens=1)
    state.append(ids("helloE"), None)
    state.append(ids("NDmore"), None)
    assert state.is_finished and state.finish_reason == "stop"
    assert state.text == "hello"
    assert state.num_output_tokens == 12


def test_streaming_holds_back_a_possible_stop_prefix():
    state = RequestState(CharDetokenizer(), ["END", "x"], num_prompt_tokens=1)
    state.append(ids("abcE"), None)
    assert state.take_text() == "abc"  # "E" could still become "END"
    state.append(ids("N"), None)
    assert state.take_text() == ""
    state.append(ids("Q"), None)  # "ENQ" is no stop: release what was held
    assert state.take_text() == "ENQ"
    state.append(ids("E"), "length")  # finished: nothing is held back any more
    assert state.take_text() == "E"


def test_earliest_stop_string_wins():
    state = RequestState(CharDetokenizer(), ["bc", "ab"], num_prompt_tokens=1)
    state.append(ids("xabc"), None)
    assert state.text == "x" and state.finish_reason == "stop"


def test_engine_finish_reason_kept_when_no_stop_string_matches():
    state = RequestState(CharDetokenizer(), ["zz"], num_prompt_tokens=1)
    state.append(ids("abz"), "stop")  # eos
    assert state.finish_reason == "stop" and state.take_text() == "abz"


def scored(text: str) -> Logprobs:
    return Logprobs(
        ids(text), [-1.0] * len(text), [1] * len(text), [[t] for t in ids(text)], [[-1.0]] * len(text)
    )


def test_a_chunk_is_fixed_when_taken_and_its_log_probabilities_wait_for_their_text():
    state = RequestState(CharDetokenizer(), ["END"], num_prompt_tokens=1)
    state.append(ids("ab"), None, scored("ab"))
    first = state.take_chunk()
    assert (first.text, first.finish_reason, first.logprobs.token_ids) == ("ab", None, ids("ab"))
    for token in "EN":  # may start "END": held back, nothing to send; their log-probabilities wait for them
        state.append(ids(token), None, scored(token))
        assert state.take_chunk() is None
    state.append(ids("x"), "length", scored("x"))
    last = state.take_chunk()
    assert (last.text, last.finish_reason, last.logprobs.token_ids) == ("ENx", "length", ids("ENx"))
    # What was taken earlier stays as it was taken, however the sequence went on.
    assert (first.text, first.finish_reason, first.logprobs.token_ids) == ("ab", None, ids("ab"))
    assert first.state is state and state.text == "abENx"


# ---- the stop check is one automaton step per new character; it must agree with the plain definition


def naive_stop(text: str, stops: list[str]) -> int | None:
    """Where the stop string that ends first starts (of several ending together, the longest)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if starts:
            return min(starts)
    return None


def naive_pending(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_stop_matcher_agrees_with_the_definition(text, stops, cuts):
    matcher = StopMatcher(stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    found, fed = None, ""
    for lo, hi in zip(bounds, bounds[1:]):
        found = matcher.feed(text[lo:hi])
        fed = text[:hi]
        if found is not None:
            break
        assert matcher.pending == naive_pending(fed, stops)
    assert found == naive_stop(text, stops)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    streamed=st.booleans(),
)
def test_streamed_and_whole_text_equal_the_text_up_to_the_first_stop(text, stops, cuts, streamed):
    """Whatever the pieces and however often text is taken, the client gets the text cut at the first stop
    string, each character once."""
    state = RequestState(CharDetokenizer(), stops, num_prompt_tokens=1)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    sent = ""
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        state.append(ids(text[lo:hi]), "length" if i == len(bounds) - 2 else None)
        if streamed:
            sent += state.take_text()
        if state.is_finished:
            break
    sent += state.take_text()
    cut = naive_stop(text, stops)
    want = text if cut is None else text[:cut]
    assert state.text == want and sent == want
    assert state.finish_reason == ("stop" if cut is not None else "length" if len(bounds) > 1 else None)
