"""Answering on the terminal: one streamed answer, and the multi-turn chat built from them.

Owns: `answer` (prefill with a progress bar, then decode streamed to stdout, stoppable with
Ctrl-C between tokens), `Conversation` (the chat history and what its session has been
fed, so a turn prefills only its new tokens) and `chat_loop` (the REPL and its /commands).
Not here: option parsing and the final report (`cli/run.py`, `run/report.py`), the chat
layout (`chat.py`), the forward pass (`Runtime`).

Why a turn can continue a session: the session holds the text `fed_text` (every prompt as
rendered, every generated id as decoded, the EOS that closes a reply) plus `pending`, the
ids already part of that text but not yet fed (`Runtime.generate` does not feed its last
token). The next turn renders the whole history; when that text extends `fed_text`, only
`pending` and the new suffix are fed. Generated ids are never re-encoded: the session
keeps the model's own tokens. When the text does not extend it (think mode drops earlier
reasoning, /system or the mode changed) a fresh session reads the whole conversation.
Prompts are encoded by `Tokenizer.encode_prompt` (message text never becomes a control
token); the new suffix starts after the EOS that closed the last reply, a piece boundary.

Images (V4.1): `/image FILE` attaches an image to the next user turn, as an image part
before its text. Images go only in a sequence's first prefill (DeepSeek's reference), so a
turn that brings one re-reads the whole conversation in a fresh session, every earlier image
with it; later text-only turns continue that session.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Self, TextIO

import click
import numpy as np

from ..engine.images import expanded_length, image_prompt, inputs_for
from ..engine.session import PrefillStep, Session
from ..engine.spec_draws import PositionUniforms
from ..engine.stack_v41 import SpanRows
from ..errors import Dsv4Error, UsageError
from ..run.report import PrefillBar, Reads, stop_text
from ..run.runtime import Pick, Runtime
from ..text import chat
from ..text.chat import Message
from ..text.image import read_image_file
from ..text.messages import ImagePart, Pieces, images_of, with_images
from ..text.tokenizer import EOS, THINK_END, Tokenizer

Say = Callable[[str], None]

HELP = (
    "/think [EFFORT]  thinking on (at that effort: low|high|max, or 1-100 on V4.1)    /nothink  thinking off\n"
    "/system TEXT  set the system prompt (/system alone clears it)\n"
    "/image FILE  attach an image to your next message (V4.1; /image alone drops the attached ones)\n"
    "/reset  forget the conversation    /stats  figures so far    /quit  leave (also Ctrl-D)\n"
    'Several lines: end a line with \\ to go on, or put them between two lines of """.\n'
    "Ctrl-C stops the current answer; at the prompt it leaves."
)
BLOCK = '"""'  # a line of its own opens / closes a multi-line turn
NO_ARGUMENT = ("/nothink", "/reset", "/stats", "/help", "/quit", "/exit")


class Stopped(Exception):
    """Ctrl-C during a prefill, honoured after the layer running: the session is torn
    (`Session.torn`) and holds only the segments fed before it."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__(f"stopped after {done} of {total} prompt tokens")
        self.done, self.total = done, total


class Interrupt:
    """While active, Ctrl-C sets `flag` (checked between tokens and after each prefill layer)
    instead of raising inside a forward pass, which would leave the session's state half
    updated. A second Ctrl-C raises KeyboardInterrupt at once. During a prefill (`phase`
    "prefill") the first Ctrl-C is acknowledged on `err` at once, since the prefill only
    stops at its next boundary."""

    def __init__(self, err: TextIO | None = None) -> None:
        self.flag = False
        self.phase = "decode"
        self._err = err
        self._prev: object = None

    def __enter__(self) -> Self:
        self.flag = False
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)  # type: ignore[arg-type]
            self._prev = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.flag:
            raise KeyboardInterrupt
        self.flag = True
        if self.phase == "prefill":
            err = self._err if self._err is not None else sys.stderr
            err.write("\ndsv4: Ctrl-C: stopping the prefill after this layer (Ctrl-C again stops at once)\n")
            err.flush()


@dataclass(frozen=True)
class Reply:
    ids: list[int]  # every yielded id; all but the last have been fed to the session
    stopped: bool  # Ctrl-C came while it was generated
    reason: str = ""  # engine.STOP_REASONS
    in_think: bool = False  # it ended before </think>: reasoning only, no answer


def reads_of(rt: Runtime) -> Callable[[], Reads]:
    """The prefill bar's figures: the run's live counters (from the bar's ticker thread too:
    they wait for no read in flight)."""

    def reads() -> Reads:
        c = rt.counters()
        return Reads(c.expert_requests, c.expert_hits, c.expert_bytes_read + c.trunk_bytes_read)

    return reads


def answer(
    rt: Runtime,
    session: Session,
    ids: Sequence[int],
    *,
    gen: int,
    pick: Pick,
    tok: Tokenizer | None,
    thinking: bool = False,
    interrupt: Interrupt | None = None,
    out: TextIO | None = None,
    leave_bar: bool = True,
    spans: SpanRows | None = None,
    uniforms: PositionUniforms | None = None,
) -> Reply:
    """Prefill `ids` (progress bar on stderr), then stream up to `gen` tokens to `out`.

    With a tokenizer, stops at EOS (not printed) and prints text; `thinking` (the prompt
    opened <think>) shows the reasoning dim until </think>. Without one, prints each id as
    it comes (comma-separated, flushed; the caller ends the line) and stops at the config's
    EOS (printed). Raises Stopped when Ctrl-C came during the prefill. `spans`: the image
    spans of `ids` (V4.1, a fresh session); `uniforms`: the position-keyed draws a sampled
    `pick` uses (`engine.spec_draws`), so that --speculate never changes the ids."""
    out = out if out is not None else sys.stdout
    stop = (tok.special.eos,) if tok is not None else (rt.cfg.eos_token_id,)
    flag = interrupt if interrupt is not None else Interrupt()
    bar = PrefillBar(reads_of(rt), leave=leave_bar)

    def on_layer(step: PrefillStep) -> None:
        bar(int(step.tokens), step.total, step.where())
        if flag.flag and (step.layer < step.layers or step.done + step.segment_tokens < step.total):
            raise Stopped(step.done, step.total)  # within one layer of the Ctrl-C; a finished prefill is kept

    stream = tok.stream() if tok is not None else None
    got: list[int] = []
    flag.phase = "prefill"
    bar.start(len(ids))
    tokens = rt.generate(session, ids, gen, pick, stop, on_layer=on_layer, spans=spans, uniforms=uniforms)
    try:
        with no_echo(sys.stdin):
            for t in tokens:
                if not got:
                    bar.close()
                    flag.phase = "decode"
                got.append(t)
                if tok is None:
                    _echo(out, f"{',' if len(got) > 1 else ''}{t}")
                elif stream is not None and t != tok.special.eos:
                    if thinking and t == tok.special.think_end:
                        _echo(out, stream.flush() + THINK_END, dim=True)
                        _echo(out, "\n")
                        thinking = False
                    else:
                        _echo(out, stream.push(t), dim=thinking)
                if flag.flag:
                    break
    finally:
        tokens.close()  # a reply cut short records its stop reason now, not when collected
        bar.close()
        flag.phase = "decode"
    if stream is not None:
        _echo(out, stream.flush(), dim=thinking)
    if thinking:
        rt.mark_in_think()
    return Reply(got, stopped=flag.flag, reason=rt.stop_reason, in_think=thinking)


@contextmanager
def no_echo(stdin: TextIO) -> Iterator[None]:
    """Keys typed while the model answers are not echoed (they would break the progress bar
    and the streamed text); they stay in the terminal's buffer and start the next input line."""
    fd = _tty_fd(stdin)
    if fd is None:
        yield
        return
    import termios

    old = termios.tcgetattr(fd)
    new = list(old)
    new[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, new)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)


def _tty_fd(f: TextIO) -> int | None:
    try:
        return f.fileno() if f.isatty() else None
    except (AttributeError, ValueError, OSError):
        return None


def _echo(out: TextIO, text: str, dim: bool = False) -> None:
    if text:
        click.echo(click.style(text, dim=True) if dim else text, file=out, nl=False)
        out.flush()


def parse_reply(text: str, mode: str) -> tuple[str, str]:
    """(reasoning, content) of a reply's text. Think mode: the prompt opened <think>, so the
    reasoning runs to the first </think> (all of it when the reply stopped before)."""
    if mode != "think":
        return "", text
    reasoning, sep, content = text.partition(THINK_END)
    return (reasoning, content) if sep else (text, "")


@dataclass(frozen=True)
class Turn:
    """One user turn, ready to feed."""

    messages: list[Message]  # the history including the new user message
    text: str  # the rendered conversation: what the session holds once `ids` are fed
    ids: list[int]  # what to feed now
    fresh: bool  # True: a new session reads the whole conversation


class Conversation:
    """A chat history and the session that has read it (see the module docstring)."""

    def __init__(
        self,
        tok: Tokenizer,
        mode: str = "chat",
        system: str | None = None,
        effort: str | int | None = None,
        encoder: str = chat.LATEST,
    ) -> None:
        self.tok = tok
        self.mode = mode
        self.system = system
        self.effort = effort  # reasoning effort of `encoder`'s chat format (None: its default)
        self.encoder = encoder
        self.messages: list[Message] = []
        self.session: Session | None = None
        self.fed_text = ""
        self.pending: list[int] = []
        self.attached: list[ImagePart] = []  # images for the next user turn (/image, --image)

    def render(self, messages: Sequence[Message]) -> Pieces:
        head = [Message("system", self.system)] if self.system else []
        return chat.pieces([*head, *messages], self.mode, effort=self.effort, encoder=self.encoder)

    def prepare(self, user: str) -> Turn:
        messages = [*self.messages, Message("user", with_images(user, self.attached))]
        pieces = self.render(messages)
        text = pieces.text
        # a new image goes in a first prefill: the whole conversation again, in a fresh session
        if self.session is not None and not self.attached and text.startswith(self.fed_text):
            rest = pieces.after(len(self.fed_text))
            if rest is not None:
                return Turn(messages, text, self.pending + self.tok.encode_prompt(rest), fresh=False)
        return Turn(messages, text, self.tok.encode_prompt(pieces.items), fresh=True)

    def commit(self, turn: Turn, session: Session, reply: Sequence[int]) -> None:
        """`session` has read `turn.ids` and every id of `reply` but the last."""
        eos = self.tok.special.eos
        body = list(reply[:-1]) if reply[-1] == eos else list(reply)
        text = self.tok.decode(body)
        reasoning, content = parse_reply(text, self.mode)
        self.messages = [*turn.messages, Message("assistant", content, reasoning=reasoning)]
        self.session = session
        # the reply is closed with EOS in the text whether the model wrote it or not
        self.fed_text = turn.text + text + EOS
        self.pending = [reply[-1]] if reply[-1] == eos else [reply[-1], eos]
        self.attached = []

    def drop_session(self) -> None:
        """Forget what was fed (the history stays): the next turn reads it all again."""
        self.session, self.fed_text, self.pending = None, "", []

    def reset(self) -> None:
        self.messages = []
        self.attached = []
        self.drop_session()


@dataclass(frozen=True)
class ChatSettings:
    gen: int | None  # most tokens per answer; None: until EOS or the context is full
    ctx: int
    pick: Pick
    uniforms: PositionUniforms | None = None  # the draws of a sampled pick (`engine.spec_draws`)


TURN_LIMIT = 1 << 30  # characters of one turn read from a pipe; chat_loop passes a bound from --ctx


def read_line(stdin: TextIO, tty: bool, prompt: str = "> ", limit: int = TURN_LIMIT) -> str | None:
    """One input line without its newline; None at EOF. A line of more than `limit` characters
    (stdin from /dev/zero, a binary file) is a UsageError after reading `limit + 1`."""
    if tty:
        try:
            return input(prompt)
        except EOFError:
            click.echo("")  # end the prompt's line
            return None
    line = stdin.readline(limit + 1)
    if len(line) > limit:
        raise UsageError(f"a chat turn of more than {limit:,} characters on stdin; is it the right input?")
    return None if line == "" else line.rstrip("\n")


PROMPT_CHARS_PER_TOKEN = 64  # a turn longer than this times --ctx cannot fit the context


def read_turn(stdin: TextIO, tty: bool, limit: int = TURN_LIMIT) -> str | None:
    """One turn: a line; lines ending in a backslash joined with the next (newline kept);
    or the lines between two lines of three double quotes. None at EOF (a block cut
    short by EOF is still a turn). More than `limit` characters in all is a UsageError."""
    lines: list[str] = []
    used = 0

    def next_line(prompt: str) -> str | None:
        nonlocal used
        line = read_line(stdin, tty, prompt, max(limit - used, 0))
        used += len(line) + 1 if line is not None else 0
        return line

    first = next_line("> ")
    if first is None:
        return None
    if first.strip() == BLOCK:
        while (line := next_line("... ")) is not None and line.strip() != BLOCK:
            lines.append(line)
        return "\n".join(lines)
    lines.append(first)
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        line = next_line("... ")
        if line is None:
            break
        lines.append(line)
    return "\n".join(lines)


def chat_loop(
    rt: Runtime,
    conv: Conversation,
    settings: ChatSettings,
    say: Say,
    show_stats: Callable[[], None],
    stdin: TextIO | None = None,
    out: TextIO | None = None,
) -> None:
    """Read turns and /commands until /quit, EOF or Ctrl-C at the prompt."""
    stdin = stdin if stdin is not None else sys.stdin
    out = out if out is not None else sys.stdout
    tty = _isatty(stdin)
    if tty:
        try:
            import readline  # noqa: F401  line editing and history for input()
        except ImportError:
            pass
        say(f"chat ({_mode_name(conv.mode)}); /help for commands, Ctrl-D or /quit to leave")
    note = ""  # why the next turn may need a fresh session
    while True:
        try:
            line = read_turn(stdin, tty, PROMPT_CHARS_PER_TOKEN * settings.ctx)
        except KeyboardInterrupt:
            click.echo("", err=True)
            return
        if line is None:
            return
        line = line.strip()
        if not line:
            continue
        if not is_utf8(line):
            say("dsv4: that line is not valid UTF-8 text; it was not sent (the conversation goes on)")
            continue
        if line.startswith("/") and "\n" not in line:
            cmd, _, arg = line.partition(" ")
            if cmd in NO_ARGUMENT and arg.strip():
                say(f"dsv4: {cmd} takes no argument (got {arg.strip()!r}); /help lists the commands")
                continue
            if cmd in ("/quit", "/exit"):
                return
            if cmd == "/help":
                say(HELP)
            elif cmd in ("/think", "/nothink"):
                mode = "think" if cmd == "/think" else "chat"
                effort = arg.strip() or conv.effort
                if cmd == "/think" and effort != conv.effort:
                    try:
                        effort = chat.parse_effort(effort, conv.encoder)
                    except UsageError as e:
                        say(f"dsv4: {e}")
                        continue
                    conv.effort, note = effort, "the reasoning effort changed"
                if mode != conv.mode:
                    conv.mode, note = mode, "the mode changed"
                say(f"({_mode_name(conv.mode)}{f', effort {conv.effort}' if conv.effort and mode == 'think' else ''})")
            elif cmd == "/system":
                conv.system, note = (arg.strip() or None), "the system prompt changed"
                say("(system prompt set)" if conv.system else "(system prompt cleared)")
            elif cmd == "/image":
                say(attach(rt, conv, arg.strip()))
            elif cmd == "/reset":
                conv.reset()
                say("(conversation cleared)")
            elif cmd == "/stats":
                show_stats()
            else:
                say(f"dsv4: unknown command {cmd}; /help lists them")
            continue
        _turn(rt, conv, settings, line, say, out, note)
        note = ""


def attach(rt: Runtime, conv: Conversation, path: str) -> str:
    """/image FILE: read and check the image now (one `dsv4:` line if it will not do); it goes
    with the next user turn. /image alone drops what was attached."""
    if not path:
        n, conv.attached = len(conv.attached), []
        return f"({n} attached image{'s' if n != 1 else ''} dropped)" if n else "(no image attached; /image FILE)"
    try:
        part = ImagePart(path, read_image_file(path))
        plan = inputs_for(rt.cfg, [(part.name, part.data)])[0].plan
    except Dsv4Error as e:
        return f"dsv4: {e}"
    conv.attached.append(part)
    return f"(image {path} attached to your next message: {plan.span_len} tokens)"


def _turn(rt: Runtime, conv: Conversation, settings: ChatSettings, user: str, say: Say, out: TextIO, note: str) -> None:
    turn = conv.prepare(user)
    held = 0 if turn.fresh or conv.session is None else conv.session.pos
    ids, spans = turn.ids, None
    images = images_of(turn.messages) if turn.fresh else []
    if images:
        try:
            # the placeholders become their spans; the tower runs only once the length fits
            inputs = inputs_for(rt.cfg, [(p.name, p.data) for p in images])
            n = expanded_length(ids, rt.cfg, inputs)
            if n >= settings.ctx:
                say(context_refusal(conv, user, 0, n, settings.ctx))
                return
            ip = image_prompt(rt.engine, np.asarray(ids, dtype=np.int64), inputs)
        except Dsv4Error as e:
            say(f"dsv4: {e}")
            return
        ids, spans = [int(i) for i in ip.ids], ip.spans
    if held + len(ids) >= settings.ctx:
        say(context_refusal(conv, user, held, len(ids), settings.ctx))
        return
    if turn.fresh and conv.session is not None:
        why = note or ("think mode drops earlier turns' reasoning" if conv.mode == "think" else "the history changed")
        say(f"({why}: re-reading the whole conversation, {len(ids)} tokens)")
    session = conv.session if not turn.fresh and conv.session is not None else rt.session()
    # without --gen the answer runs to EOS or until the context is full (the runtime stops there)
    gen = settings.gen if settings.gen is not None else settings.ctx
    try:
        with Interrupt() as flag:
            reply = answer(
                rt, session, ids, gen=gen, pick=settings.pick, tok=conv.tok,
                thinking=conv.mode == "think", interrupt=flag, out=out, leave_bar=False, spans=spans,
                uniforms=settings.uniforms,
            )  # fmt: skip
    except Stopped as e:
        conv.drop_session()
        say(f"(stopped during the prefill after {e.done} of {e.total} tokens; the turn is dropped)")
        return
    except KeyboardInterrupt:
        # raised inside a forward pass: the session's state cannot be trusted any more
        conv.drop_session()
        click.echo("", file=out)
        say("(interrupted mid-pass; the turn is dropped and the next one re-reads the conversation)")
        return
    click.echo("", file=out)
    if reply.reason != "eos":
        say(f"({stop_text(reply.reason, reply.in_think)})")
    conv.commit(turn, session, reply.ids)


def context_refusal(conv: Conversation, user: str, held: int, new: int, ctx: int) -> str:
    """Why a turn cannot start, and the remedy that would actually help."""
    alone = len(conv.tok.encode_prompt(conv.render([Message("user", user)]).items))
    what = f"this turn needs {new} tokens" + (f" after the {held} the conversation holds" if held else "")
    if alone < ctx and (held or conv.messages):
        return f"dsv4: {what}, leaving no room to answer within --ctx {ctx}; /reset to start over, or restart with a larger --ctx"
    return f"dsv4: {what}, leaving no room to answer within --ctx {ctx}; restart with a larger --ctx (at least {alone + 1})"


def is_utf8(text: str) -> bool:
    """False for text holding undecodable bytes (kept as lone surrogates by `surrogateescape`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _mode_name(mode: str) -> str:
    return "thinking on" if mode == "think" else "thinking off"


def _isatty(f: TextIO) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False
