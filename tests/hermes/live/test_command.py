"""The live command line, `hermes --live SOURCE` and `hermes --video FILE --realtime` (hermes.live.command,
docs/cli.md#live), on a tiny Qwen2.5-VL: a container stream on a subprocess's standard input, TCP streamed to the end,
a disconnect, a stall, a reconnect, questions typed on a pseudo-terminal while a file plays in real time, --watch
printing only on change, a model slowed on purpose, Ctrl-C, the refusals and the JSON lines' schema. Loopback only;
every server and subprocess is started and stopped by its test, every wait bounded."""
import io
import json
import os
import pty
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from hermes import cli
from hermes.live.command import LivePrinter, progress_line, run_live
from hermes.stream import HermesStream
from tests.hermes.live.records import live_main, of_type, records_of
from tests.hermes.live.servers import TcpServer, free_port, ts_chunks
from tests.hermes.video_files import write_video
from tests.utils import REPO, error_line

pytestmark = pytest.mark.usefixtures("single_thread")

FAMILY = "qwen2_5_vl"
SENT = 4  # frames per second the servers send; sampled at 2 (--fps 2)
# chunks of 4 samples (2 s of video), 24 tokens each past a 20-token budget: every chunk compresses; frames that
# all arrive at once (a server or a pipe that does not pace them) are never late within a minute
RUN = ["--fps", "2", "--chunk-frames", "4", "--budget", "20", "--max-new-tokens", "3", "--device", "cpu", "--threads",
       "1"]
UNPACED = [*RUN, "--max-lag", "60"]
QUESTION = "what is the person holding ?"
EARLY = "where is the ball ?"
WAIT = 120  # s any subprocess or read may take at most
# the keys of each JSON line (docs/cli.md#live): the session's events, then the summary with the source's counters
STAGES = ("lag", "decode_ms", "vision_ms", "prefill_ms", "compression_ms", "first_token_s", "last_token_s")
KEYS = {
    "chunk": {"index", "start", "end", "frames", "lag", "dropped", "decode_ms", "vision_ms", "prefill_ms",
              "compression_ms", "compressed", "cache_length", "cache_bytes", "wall"},
    "dropped": {"count", "times", "total", "wall"},
    "answer": {"question", "answer", "asked_at", "seen", "first_token_s", "last_token_s", "watch", "changed", "wall"},
    "ended": {"reason", "wall"},
    "summary": {"chunks", "frames", "dropped", "answers", "watch_asks", "video_seconds", "wall_seconds",
                "realtime_factor", *STAGES, "ended", "source"},
}
SOURCE_KEYS = {"decoded", "sampled", "corrupt_packets", "reconnects", "overflow"}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints[FAMILY]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Files played in real time: 6 s and 20 s at 4 fps."""
    folder = tmp_path_factory.mktemp("clips")
    return {"short": write_video(folder / "short.mp4", [i / 4 for i in range(24)]),
            "long": write_video(folder / "long.mp4", [i / 4 for i in range(80)])}


def hermes_process(argv: list[str], **popen) -> subprocess.Popen:
    """`python -m hermes ARGV` started from the checkout."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "hermes", *argv], env=env, cwd=REPO, **popen)


def lines_of(stream) -> "queue.Queue[str]":
    """The lines of a subprocess's pipe, as they come, read by a daemon thread (None at its end)."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


# ---- sources streamed to the end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def piped(checkpoint):
    """`hermes --live - --json` fed 6 s of MPEG-TS on its standard input, then end of input: (status, stdout, stderr).
    --ask-at 1 s and a --question."""
    process = hermes_process(["--model", checkpoint, "--live", "-", *UNPACED, "--ask-at", f"1:{EARLY}", "--question",
                              QUESTION, "--json", "--quiet"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    out, err = process.communicate(b"".join(ts_chunks(6 * SENT, SENT)), timeout=WAIT)
    return process.returncode, out.decode(), err.decode()


def test_a_pipe_on_stdin_answers_and_ends_with_the_reason(piped):
    """12 samples: three chunks; the --ask-at question after the first (seen 1.5 s), the --question when the stream
    ends, then the end and the summary; stderr says why it ended."""
    status, out, err = piped
    assert status == 0, err
    records = records_of(out)
    assert [(r["type"], r.get("question")) for r in records] == [
        ("chunk", None), ("answer", EARLY), ("chunk", None), ("chunk", None), ("answer", QUESTION), ("ended", None),
        ("summary", None)]
    assert [r["seen"] for r in of_type(records, "answer")] == [1.5, 5.5] and records[-2]["reason"] == "end of stream"
    assert err.splitlines() == ["source ended: end of stream"]


def test_every_json_line_has_the_documented_keys(piped):
    """Every line of --json output parses and has "type" and exactly its kind's keys; the summary's source
    counters and the stages' percentiles too."""
    records = records_of(piped[1])
    for record in records:
        assert set(record) - {"type"} == KEYS[record["type"]], record["type"]
    summary = records[-1]
    assert set(summary["source"]) == SOURCE_KEYS and summary["source"]["sampled"] == 12
    assert all(set(summary[name]) == {"p50", "p99", "max"} for name in STAGES)
    assert summary["chunks"] == 3 and summary["frames"] == 12 and summary["answers"] == 2


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_line_is_rewritten_in_place_on_a_terminal(piped):
    """The piped run's records printed as text: on a terminal the progress line is rewritten in place (carriage
    return, erase to the end of the line) and ended by a newline before anything else prints (an answer on stdout,
    the end); elsewhere it is a line per chunk. Answers go to stdout, the summary to stderr."""
    records = records_of(piped[1])
    progress = [progress_line(r) for r in of_type(records, "chunk")]
    for err in (Terminal(), io.StringIO()):
        out = io.StringIO()
        printer = LivePrinter(out=out, err=err)
        for record in records:
            printer.record(record)
        ended = "source ended: end of stream\nsummary: 3 chunks, 12 frames: 6.0 s of video in "
        if err.isatty():
            rewritten = "".join(f"\r{line}\x1b[K" + "\n" * (index == 0) for index, line in enumerate(progress))
            assert err.getvalue().startswith(f"{rewritten}\n{ended}")
        else:
            assert err.getvalue().startswith("\n".join([*progress, ended]))
        assert out.getvalue().splitlines()[::2] == [f"[0:01.5] Q: {EARLY}", f"[0:05.5] Q: {QUESTION}"]


def test_tcp_streamed_to_the_end_with_a_line_per_chunk(checkpoint, capsys):
    """--live tcp://... --verbose, text output: the answers on stdout; on stderr a line per chunk with every stage,
    the end and the summary."""
    with TcpServer([(ts_chunks(6 * SENT, SENT), "close")]) as server:
        status = cli.main(["--model", checkpoint, "--live", server.url, *UNPACED, "--question", QUESTION, "--verbose",
                           "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert out.splitlines()[0] == f"[0:05.5] Q: {QUESTION}" and out.splitlines()[1].startswith("           A: ")
    chunks = [line for line in err.splitlines() if line.startswith("chunk ")]
    assert [line.split("  ")[1] for line in chunks] == ["0:00.0-0:01.5", "0:02.0-0:03.5", "0:04.0-0:05.5"]
    assert all("decode " in line and "vision " in line and "prefill+guidance " in line and "compression " in line
               for line in chunks)
    ended = err.splitlines().index("source ended: end of stream")
    assert err.splitlines()[ended + 1].startswith("summary: 3 chunks, 12 frames: 6.0 s of video in ")


# ---- faults -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ending,reason", [("reset", "disconnected: Connection reset"), ("stall", "stalled for 1 s")])
def test_a_source_that_disconnects_or_stalls_ends_cleanly(checkpoint, capsys, ending, reason):
    """The server sends 4 s of 6 and resets the connection, or keeps it open sending nothing: the frames before it
    are encoded, the --question is still answered, exit 0 with the reason on stderr."""
    chunks = ts_chunks(6 * SENT, SENT)[:4 * SENT]
    with TcpServer([(chunks, ending)], pace=0.02) as server:
        status, records, err = live_main(capsys, ["--model", checkpoint, "--live", server.url, *UNPACED,
                                                  "--stall-timeout", "1", "--question", QUESTION])
    assert status == 0, err
    assert [r["type"] for r in records[-3:]] == ["answer", "ended", "summary"]
    assert records[-2]["reason"].startswith(reason) and records[-1]["ended"] == records[-2]["reason"]
    assert of_type(records, "chunk") and err[-1].startswith(f"source ended: {reason}")


def test_reconnect_keeps_the_cache_and_time_runs_on(checkpoint, capsys):
    """--reconnect 1: the server serves 3 s, closes, then serves 3 s more on a second connection (timestamps from 0
    again): one run over both, its video time going on across the reconnect (the second connection's first frame
    1 / fps after the first's last, 2.75 s: at 3.25 s; its last at 6 s)."""
    connections = [(ts_chunks(3 * SENT, SENT), "close"), (ts_chunks(3 * SENT, SENT), "close")]
    with TcpServer(connections) as server:
        status, records, err = live_main(capsys, ["--model", checkpoint, "--live", server.url, *UNPACED,
                                                  "--reconnect", "1"])
    assert status == 0, err
    assert server.accepted == 2 and records[-1]["source"]["reconnects"] == 1
    chunks = [(r["start"], r["end"]) for r in of_type(records, "chunk")]
    assert chunks == [(0.0, 1.5), (2.0, 3.5), (4.0, 5.5), (6.0, 6.0)] and records[-1]["frames"] == 13


# ---- questions ------------------------------------------------------------------------------------------------------
def test_questions_typed_on_a_terminal_are_answered_while_it_plays(checkpoint, clips):
    """stdin a pseudo-terminal (questions are read from it by default), a 6 s file played in real time in chunks of
    1 s: a question typed after the first chunk is answered before the file has played, chunks still coming after
    it."""
    master, slave = pty.openpty()
    process = hermes_process(["--model", checkpoint, "--video", clips["short"], "--realtime", *RUN, "--chunk-frames",
                              "2", "--json", "--quiet"], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    os.close(slave)
    try:
        lines, records = lines_of(process.stdout), []
        while not records or records[-1]["type"] != "summary":
            line = lines.get(timeout=WAIT)
            assert line is not None, process.stderr.read()
            records.append(json.loads(line))
            if records[-1]["type"] == "chunk" and records[-1]["index"] == 0:
                os.write(master, f"{QUESTION}\n".encode())
        assert process.wait(timeout=WAIT) == 0
    finally:
        process.kill()
        os.close(master)
    kinds = [r["type"] for r in records]
    answer = kinds.index("answer")
    assert records[answer]["question"] == QUESTION and not records[answer]["watch"]
    assert kinds[answer + 1:].count("chunk") >= 2 and records[answer]["seen"] < of_type(records, "chunk")[-1]["end"]


def test_questions_piped_with_questions_dash_and_one_the_stream_refuses(checkpoint, capsys, monkeypatch):
    """--questions - with stdin a pipe, the source paced over 1.2 s: the first question is answered before the last
    chunk; the second, longer than the cache's room, is refused in one warning line and the run goes on."""
    read_end, write_end = os.pipe()
    os.write(write_end, f"{QUESTION}\n\n{'why ' * 600}?\n".encode())
    os.close(write_end)
    with open(read_end, "rb") as pipe, TcpServer([(ts_chunks(6 * SENT, SENT), "close")], pace=0.05) as server:
        monkeypatch.setattr(sys, "stdin", pipe)
        status, records, err = live_main(capsys, ["--model", checkpoint, "--live", server.url, *UNPACED,
                                                  "--questions", "-"])
    assert status == 0, err
    kinds = [r["type"] for r in records]
    assert kinds.count("answer") == 1 and kinds.index("answer") < len(kinds) - 1 - kinds[::-1].index("chunk")
    assert [line.split(":")[:2] for line in err[:-1]] == [["warning", " question not answered"]]


def test_watch_prints_only_when_the_answer_changes(checkpoint, capsys, monkeypatch):
    """--watch re-asked after each of 8 chunks, the stream answering no, no, yes, yes, yes, no, no, no: three
    watch answers (chunks 0, 2 and 5), eight asks; the text output shows the same three."""
    script = iter(["no", "no", "yes", "yes", "yes", "no", "no", "no"])
    monkeypatch.setattr(HermesStream, "ask", lambda self, question, **kwargs: next(script))
    with TcpServer([(ts_chunks(8 * SENT, SENT), "close")]) as server:
        status, records, err = live_main(capsys, ["--model", checkpoint, "--live", server.url, *UNPACED,
                                                  "--chunk-frames", "2", "--watch", "is the door open ?"])
    assert status == 0, err
    after = [records[i - 1]["index"] for i, r in enumerate(records) if r["type"] == "answer"]
    assert after == [0, 2, 5] and [r["answer"] for r in of_type(records, "answer")] == ["no", "yes", "no"]
    assert len(of_type(records, "chunk")) == 8 and records[-1]["watch_asks"] == 8
    printer = LivePrinter(progress=False)
    for record in records:
        printer.record(record)
    out = capsys.readouterr().out
    assert out.count("Q (watch): is the door open ?") == 3 and "watch asks: 8" not in out


# ---- a slow model -------------------------------------------------------------------------------------------------
def test_a_slow_model_drops_frames_and_keeps_lag_bounded(loaded, clips):
    """A 6 s file in real time at 4 fps in chunks of 2 frames (0.5 s, the default max lag) through a vision tower
    that sleeps 0.8 s a chunk: frames are dropped, every chunk is in the cache within max_lag + its own processing
    of its last frame's arrival, the questions are still answered."""
    model = loaded[FAMILY]
    tower = model.model.model.visual
    handle = tower.blocks[0].register_forward_pre_hook(lambda module, args: time.sleep(0.8))  # timed as vision
    try:
        records = run_live(model, clips["short"], live=False, fps=4, chunk_frames=2, budget=20, max_new_tokens=2,
                           ask_at=[f"2:{EARLY}"], questions=[QUESTION])
    finally:
        handle.remove()
    chunks, summary = of_type(records, "chunk"), records[-1]
    assert summary["dropped"] == sum(r["count"] for r in of_type(records, "dropped")) >= 6
    assert summary["frames"] + summary["dropped"] == 24
    for chunk in chunks:
        spent = sum(chunk[name] or 0.0 for name in ("decode_ms", "vision_ms", "prefill_ms", "compression_ms")) / 1e3
        assert chunk["vision_ms"] >= 800 and chunk["lag"] <= 0.5 + spent + 0.05, chunk
    assert [r["question"] for r in of_type(records, "answer")] == [EARLY, QUESTION]


# ---- Ctrl-C and refusals -------------------------------------------------------------------------------------------
def test_ctrl_c_prints_the_summary_and_exits_130(checkpoint, clips):
    """SIGINT once the first chunk of a 20 s file played in real time is in: the summary (ended: interrupted) on
    stderr, then the error contract's line, exit status 130. The process starts with SIGINT's default action: a
    test run in the background (`nohup ... &`, as CI may be) ignores SIGINT, a child inherits that, and Python then
    never installs its KeyboardInterrupt handler (the command rightly keeps ignoring it, as nohup asks)."""
    process = hermes_process(["--model", checkpoint, "--video", clips["long"], "--realtime", *RUN],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines, seen = lines_of(process.stderr), []
        while not seen or "chunk 0" not in seen[-1]:
            seen.append(lines.get(timeout=WAIT))
            assert seen[-1] is not None, "".join(seen[:-1])
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=WAIT) == 130
    finally:
        process.kill()
    err = []
    while (line := lines.get(timeout=WAIT)) is not None:
        err.append(line.rstrip("\n"))
    summary = next(index for index, line in enumerate(err) if line.startswith("summary: "))
    assert err[summary + 5:] == ["  ended: interrupted", "error: interrupted"]


@pytest.mark.parametrize("argv,message", [
    (["--live", "ftp://host/feed"], "live: --live expects a URL (rtsp, rtmp, srt, udp, tcp, http, https), "
                                    "/dev/videoN or -, got 'ftp://host/feed'"),
    (["--live", "/dev/video99"], "live: --live /dev/video99: no such capture device (No such file or directory)"),
    (["--live", "-", "--max-lag", "1"], "max_lag: a chunk of 4 frames at 2 fps takes 1.5 s to arrive; --max-lag "
                                        "must be at least that, got 1"),
    (["--live", "-", "--open-timeout", "0"], "open_timeout: expected a positive finite number, got 0.0"),
    (["--live", "-", "--reconnect", "1"], "reconnect: only a network source (--live URL) is reopened, not '-'"),
    (["--live", "-", "--questions", "-"], "questions: --questions - reads stdin, which carries the --live - stream"),
    (["--live", "-", "--watch", " "], "watch: expected a non-empty string, got ' '"),
    (["--live", "-", "--realtime"], "realtime: --realtime plays a --video file at its own speed"),
    (["--video", "{clip}", "--watch", "q"], "watch: --watch is for a live run: --live SOURCE, or --video FILE "
                                             "--realtime"),
    (["--video", "{clip}", "--realtime", "--stall-timeout", "1"], "stall_timeout: --stall-timeout is for a --live "
                                                                  "source, not a --video file"),
], ids=["scheme", "device", "max-lag", "open-timeout", "reconnect-pipe", "questions-pipe", "watch", "realtime-live",
        "watch-file", "stall-file"])
def test_a_live_refusal_is_one_line_naming_the_option(argv, message, checkpoint, clips, capsys):
    argv = [arg.format(clip=clips["short"]) for arg in argv]
    assert error_line(cli.main, capsys, ["--model", checkpoint, *argv, *RUN], status=2).startswith(f"error: {message}")


def test_a_closed_port_fails_in_one_line_before_any_weights_load(checkpoint, capsys, monkeypatch):
    """Nobody listens: one line naming --live once the checkpoint is checked, before its weights load, exit
    status 1."""
    from hermes.live import command
    loads = []
    monkeypatch.setattr(command, "load_model", lambda *a, **k: loads.append(a))
    url = f"tcp://127.0.0.1:{free_port()}"
    line = error_line(cli.main, capsys, ["--model", checkpoint, "--live", url, "--open-timeout", "1", *RUN, "--quiet"])
    assert line == f"error: live: cannot open --live '{url}': Connection refused" and loads == []
