"""taas's own notes: one helper writes them, INFO on stdout, WARN on stderr; the layer hint."""

from __future__ import annotations

from taas.io import failure
from taas.io.output import INFO, WARN, note


class Sink:
    def __init__(self):
        self.text: list[tuple[str, str]] = []

    def write(self, stream: str, text: str) -> None:
        self.text.append((stream, text))

    def progress(self, key, stream, text, final) -> None:
        pass


def test_info_notes_go_to_stdout_and_warnings_to_stderr_one_line_each():
    sink = Sink()
    note(sink, "taas: no CUDA device here: running 2 CPU ranks on gloo", INFO)
    note(sink, "taas: the 2 ranks never communicated\n", WARN)
    assert sink.text == [("stdout", "taas: no CUDA device here: running 2 CPU ranks on gloo\n"),
                         ("stderr", "taas: the 2 ranks never communicated\n")]


def test_a_note_without_a_sink_goes_to_the_terminal(capsys):
    note(None, "taas: hello", INFO)
    note(None, "taas: careful", WARN)
    out, err = capsys.readouterr()
    assert (out, err) == ("taas: hello\n", "taas: careful\n")


def test_the_layer_hint_names_the_files_and_storage_shared():
    hint = failure.layer_hint({"check_main_process_first.txt": ["rank1"]})
    assert hint is not None and "\n" not in hint
    assert hint.startswith("taas: rank1 wrote check_main_process_first.txt into a layer of its own")
    assert "could not see these files while the job ran" in hint
    assert "--storage shared" in hint


def test_the_layer_hint_shows_a_few_files_and_every_writer():
    written = {f"out/{i}.txt": ["rank2" if i % 2 else "rank1"] for i in range(5)}
    written["out/__pycache__/m.pyc"] = ["rank3"]
    hint = failure.layer_hint(written)
    assert "rank1 and rank2 wrote out/0.txt, out/1.txt, out/2.txt and 2 more into layers of their own" in hint
    assert "rank3" not in hint


def test_no_layer_hint_without_files():
    assert failure.layer_hint({}) is None
    assert failure.layer_hint({"__pycache__/x.pyc": ["rank1"]}) is None
