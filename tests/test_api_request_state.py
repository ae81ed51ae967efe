"""Request output state: incremental text, stop strings cut at their start, held-back text while streaming."""

from coordinator.request_state import RequestState


class CharDetokenizer:
    """Token id i is chr(i): one character per token, nothing held back."""

    def add(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_text_accumulates_and_streams_without_stop_strings():
    state = RequestState(CharDetokenizer(), [], num_prompt_tokens=3)
    state.append(ids("ab"), None)
    assert state.take_text() == "ab"
    state.append(ids("c"), "length")
    assert state.take_text() == "c"
    assert (state.text, state.finish_reason, state.num_output_tokens) == ("abc", "length", 3)


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
