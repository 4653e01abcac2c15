"""The ranks' questions served in turn (taas.supervisor.prompts), as data: a sink that answers
from a script, a handle that records what it was given."""

from __future__ import annotations

from taas.errors import NoStdin
from taas.launch.process.stdin import Answer
from taas.supervisor import events
from taas.supervisor.prompts import Prompts


class Sink:
    def __init__(self, *replies):
        self.replies, self.asked = list(replies), []

    def write(self, stream, text):
        pass

    def ask(self, prompt, password=False):
        self.asked.append((prompt, password))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply


class Handle:
    def __init__(self):
        self.answers = []

    def answer(self, key, reply):
        self.answers.append((key, reply))
        return True


def ask(id, prompt, **kw):
    return events.read('{"kind": "ask", "id": %d, "prompt": "%s"%s}' % (
        id, prompt, "".join(f', "{k}": {str(v).lower()}' for k, v in kw.items())))


def test_questions_are_served_in_the_order_they_came_each_to_its_rank():
    sink, handle = Sink("Ada", "Bob"), Handle()
    prompts = Prompts(sink, handle)
    prompts.asked("rank1", ask(1, "[rank1] name? "))
    prompts.asked("rank0", ask(1, "[rank0] name? ", password=True))
    assert prompts.waiting and prompts.debugging
    prompts.serve(lambda key: False)
    assert sink.asked == [("[rank1] name? ", False), ("[rank0] name? ", True)]
    assert handle.answers == [("rank1", Answer(1, text="Ada")), ("rank0", Answer(1, text="Bob"))]
    assert not prompts.waiting and not prompts.debugging


def test_end_of_input_and_no_stdin_are_answered_and_a_gone_rank_is_not_asked():
    sink, handle = Sink(EOFError(), NoStdin("no box here"), OSError("captured")), Handle()
    prompts = Prompts(sink, handle)
    for key in ("rank0", "rank1", "rank2", "rank3"):
        prompts.asked(key, ask(3, "? "))
    prompts.serve(lambda key: key == "rank1")
    assert handle.answers == [("rank0", Answer(3, eof=True)), ("rank2", Answer(3, error="no box here")),
                              ("rank3", Answer(3, error="stdin cannot be read here: captured"))]


def test_a_sink_without_an_input_box_answers_with_one_line():
    class Mute:
        def write(self, stream, text):
            pass

    handle = Handle()
    prompts = Prompts(Mute(), handle)
    prompts.asked("rank0", ask(1, "? "))
    prompts.serve(lambda key: False)
    [(key, reply)] = handle.answers
    assert key == "rank0" and reply.error.startswith("this job has no input box")


def test_post_mortem_is_the_first_failing_ranks_later_ones_leave_at_once():
    sink, handle = Sink("p v", "q"), Handle()
    prompts = Prompts(sink, handle)
    prompts.asked("rank1", ask(1, "(Pdb) [rank1] ", debugger=True, post_mortem=True))
    prompts.asked("rank0", ask(1, "(Pdb) [rank0] ", debugger=True, post_mortem=True))
    prompts.asked("rank1", ask(2, "(Pdb) [rank1] ", debugger=True, post_mortem=True))
    prompts.serve(lambda key: False)
    assert [p for p, _ in sink.asked] == ["(Pdb) [rank1] ", "(Pdb) [rank1] "]
    assert handle.answers[1] == ("rank0", Answer(1, eof=True))


def test_a_rank_at_a_prompt_is_no_hang_until_its_beat_says_it_left():
    prompts = Prompts(Sink(), Handle())
    prompts.beat("rank1", "debugger")
    assert prompts.debugging
    prompts.beat("rank1", "waiting")
    assert not prompts.debugging
    prompts.beat("rank0", "input")  # a late beat, sent before its answer, then the rank ended
    prompts.left("rank0")
    assert not prompts.debugging


def test_a_question_with_a_bad_field_is_no_message():
    for line in ('{"kind": "ask", "id": 0, "prompt": "x"}', '{"kind": "ask", "prompt": "x"}',
                 '{"kind": "ask", "id": 1, "prompt": 5}', '{"kind": "ask", "id": 1, "debugger": "yes"}'):
        assert events.parse("rank0", line) is None
