"""`dsv4 run` (also plain `dsv4 CHECKPOINT`): generate, or chat, within `--budget`.

Owns: the options, checking them before anything slow happens (every mistake is a
Dsv4Error of one line that says what to do), building the prompt (raw completion: BOS +
text; --chat/--think: a one-turn conversation through `chat.render`; or ids), the sampler
(`text.sampler.make_pick` over the ids the tokenizer can print, seeded), `--gpu` setup, and what is
printed where: plan, progress, messages and the report on stderr, the text on stdout.
The answer itself and the REPL are `dsv4stream.cli.repl`; the report's wording `report.py`.

Defaults that depend on the mode: with --chat/--think the temperature is 1.0 (DeepSeek's
recommendation for V4, with top-p 1.0) and an answer runs to EOS or until --ctx is full; a
raw --prompt or --prompt-ids is greedy with --gen 32 (fewer when --ctx is reached first), so
completions and benchmarks give the same ids at every budget.

Control ids are never sampled unless --allow-special: every added token of the tokenizer
(BOS, padding, the reserved placeholders, <｜User｜>, V4.1's <｜System｜> and image token...)
except those a reply is made of: EOS, <think>, </think> and ｜DSML｜ (`Tokenizer.control_ids`).

--chat/--think prompts are encoded by `chat.encode`: the prompt and system text are only
ever text (`<｜User｜>` typed in them stays characters). A raw --prompt is parsed as the
tokenizer does, so it may spell the chat format itself.

Images (`--image FILE`, repeatable; V4.1 with a vision tower): with --chat/--think they are
image parts of the user turn, before its text (an interactive chat: of the first turn);
a raw --prompt or --prompt-ids takes them at its image markers in order, or before the text
(after BOS) when it holds none. Each marker becomes its image's span (`engine.images`),
which goes in the first prefill.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Self

import click
import numpy as np

from .. import gpu
from ..checkpoint.config import ModelConfig
from ..engine.images import expanded_length, image_prompt, inputs_for, with_markers
from ..engine.numerics import RUN_DEFAULT
from ..engine.spec_draws import PositionUniforms
from ..engine.speculate import parse_setting
from ..errors import BudgetError, Dsv4Error, InternalError, TokenizerError, UsageError
from ..files import AtomicFile, atomic_write, read_regular
from ..run import planner
from ..run.report import report_lines
from ..run.runinfo import RunOptions, RunStats
from ..run.runtime import Pick, Runtime
from ..text import chat
from ..text.image import ImageInput, read_image_file
from ..text.messages import ImagePart, with_images
from ..text.sampler import SamplingParams, banned_ids, make_pick
from ..text.tokenizer import Tokenizer, default_pack_path
from ..text.vocab import family_name
from ..weights.loading_dspark import drafter_reason
from .budget import budget_bytes, budget_warning
from .logits import parse_tokens
from .numerics_option import numerics_option
from .outputs import check_output
from .repl import ChatSettings, Conversation, Interrupt, Stopped, answer, chat_loop, is_utf8
from .tokenizer import stdin_text, strip_final_newline

CHAT_TEMPERATURE = 1.0  # DeepSeek's recommended sampling for V4 (with top-p 1.0)
RAW_GEN = 32  # raw completions; chat answers run to EOS or a full --ctx


def checkpoint_dir(path: Path) -> Path:
    if not path.exists():
        raise UsageError(
            f"{path}: no such checkpoint directory; pass the folder holding config.json and the *.safetensors"
        )
    if not (path / "config.json").is_file():
        raise UsageError(
            f"{path}: not a checkpoint directory (no config.json); pass the folder holding config.json and *.safetensors"
        )
    return path


def check_tokenizer(tok: Tokenizer, cfg: ModelConfig) -> Tokenizer:
    """The tokenizer must be this model's: same family (V4 or V4.1), embedding rows and BOS/EOS ids."""
    where = tok.path or "tokenizer"
    family = cfg.family
    if tok.family != family:
        raise TokenizerError(
            f"{where}: a {family_name(tok.family)} tokenizer, this checkpoint is {family_name(family)}; pass this"
            " checkpoint's own tokenizer (`dsv4 pack-tokenizer CHECKPOINT`, then --tok)"
        )
    if tok.vocab_size != cfg.vocab_size or tok.n_tokens > cfg.vocab_size:
        raise TokenizerError(
            f"{where}: tokenizer of a model with {tok.vocab_size} embedding rows, this checkpoint has"
            f" {cfg.vocab_size}; pass this checkpoint's tokenizer (`dsv4 pack-tokenizer CHECKPOINT`, then --tok)"
        )
    if (tok.special.bos, tok.special.eos) != (cfg.bos_token_id, cfg.eos_token_id):
        raise TokenizerError(
            f"{where}: BOS/EOS are ids {tok.special.bos}/{tok.special.eos}, the checkpoint's config.json says"
            f" {cfg.bos_token_id}/{cfg.eos_token_id}; pass this checkpoint's tokenizer with --tok"
        )
    return tok


def load_tokenizer(checkpoint: Path, tok: Path | None, cfg: ModelConfig) -> Tokenizer:
    """--tok FILE (a pack, or a tokenizer.json), else the checkpoint's packed tokenizer, else its tokenizer files."""
    if tok is not None:
        if not tok.exists():
            raise TokenizerError(
                f"--tok {tok}: no such file; pass the file `dsv4 pack-tokenizer CHECKPOINT` wrote"
                f" (default {default_pack_path(checkpoint)}) or a tokenizer.json"
            )
        if tok.is_file() and tok.suffix == ".json" and tok.name != "config.json":
            return check_tokenizer(Tokenizer.from_checkpoint(checkpoint, tok), cfg)
        return check_tokenizer(Tokenizer.load(tok), cfg)
    if default_pack_path(checkpoint).is_file():
        return check_tokenizer(Tokenizer.load(default_pack_path(checkpoint)), cfg)
    return check_tokenizer(Tokenizer.from_checkpoint(checkpoint), cfg)


def check_trunk(trunk: Path | None) -> None:
    """Name the mistake early; whether a directory holds a pack is TrunkFile's check."""
    if trunk is None:
        return
    if not trunk.exists():
        raise UsageError(f"--trunk {trunk}: no such directory; pass the directory `dsv4 pack-trunk CHECKPOINT` wrote")
    if not trunk.is_dir():
        raise UsageError(f"--trunk {trunk}: is a file; pass the directory `dsv4 pack-trunk CHECKPOINT` wrote")


# a token spells at most this many bytes of text (the releases' longest is under 64): a prompt
# file longer than this times --ctx cannot fit the context and is refused before it is read
PROMPT_BYTES_PER_TOKEN = 64


def prompt_text(prompt: str | None, prompt_file: Path | None, ctx: int) -> str | None:
    """--prompt as given; --prompt-file's text less one final newline (as `dsv4 tokenize -`).
    The file must be a regular one (or - for stdin), of at most PROMPT_BYTES_PER_TOKEN x ctx bytes."""
    if prompt_file is None:
        if prompt is not None and not is_utf8(prompt):
            raise UsageError("--prompt: the text is not valid UTF-8; give UTF-8 text")
        return prompt
    limit = PROMPT_BYTES_PER_TOKEN * ctx
    if str(prompt_file) == "-":
        return strip_final_newline(stdin_text(f"--prompt-file - (at most {limit:,} bytes for --ctx {ctx})", limit))
    if not prompt_file.exists():
        raise UsageError(f"--prompt-file {prompt_file}: no such file")
    data = read_regular(prompt_file, f"--prompt-file (for --ctx {ctx})", UsageError, limit)
    try:
        return strip_final_newline(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--prompt-file {prompt_file}: cannot read it as UTF-8 text (byte {e.start} is {data[e.start]:#04x})"
        ) from None


def id_prompt(prompt_ids: str, cfg: ModelConfig) -> list[int]:
    try:
        ids = [int(i) for i in parse_tokens(prompt_ids, None)]
    except UsageError as e:
        raise UsageError(f"--prompt-ids: {e}") from None
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UsageError(f"--prompt-ids: id {bad[0]} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    return ids


def text_prompt(
    tok: Tokenizer,
    text: str,
    mode: str | None,
    system: str | None,
    effort: str | int | None = None,
    encoder: str = chat.LATEST,
    images: Sequence[ImagePart] = (),
) -> list[int]:
    """Raw completion (mode None): BOS + text, control-token text parsed as such. Chat: the
    one-turn conversation as rendered, its text never read as control tokens, `images` as
    image parts before the text (their placeholders come from the parts only)."""
    if not text:
        raise UsageError("the prompt is empty; give some text")
    if mode is None:
        return [tok.special.bos, *tok.encode(text)]
    return chat.encode(tok, chat.one_turn(with_images(text, images), system), mode, effort=effort, encoder=encoder)


def sampling_params(
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
    greedy: bool,
    chatting: bool,
) -> SamplingParams:
    """Check the sampling options together; temperature 0 is greedy, exactly as --greedy."""
    if temperature is not None and not 0 <= temperature < float("inf"):
        raise UsageError(f"--temperature {temperature}: give 0 (greedy) or more, a finite number")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"--top-p {top_p}: give a probability in (0, 1]; 1 turns it off")
    if top_k is not None and top_k < 0:
        raise UsageError(f"--top-k {top_k}: give 0 (off) or a positive count")
    if seed is not None and seed < 0:
        raise UsageError(f"--seed {seed}: give 0 or a positive integer")
    if min_p is not None and not 0 <= min_p <= 1:
        raise UsageError(f"--min-p {min_p}: give a fraction in [0, 1]; 0 turns it off")
    if greedy and temperature is not None and temperature > 0:
        raise UsageError(f"--greedy and --temperature {temperature} conflict; drop one (--temperature 0 is greedy)")
    if temperature is None:
        temperature = 0.0 if greedy or not chatting else CHAT_TEMPERATURE
    if temperature == 0:
        given = [name for name, v in (("--top-p", top_p), ("--top-k", top_k), ("--min-p", min_p)) if v is not None]
        if given:
            why = "--greedy" if greedy else "temperature 0"
            if not greedy and not chatting:
                why = "greedy decoding (the default without --chat)"
            raise UsageError(f"{', '.join(given)}: no effect with {why}; give --temperature above 0 or drop them")
    return SamplingParams(temperature, top_k or 0, 1.0 if top_p is None else top_p, min_p or 0.0, seed)


@click.command("run")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option(
    "-p", "--prompt", help="Prompt text: a raw completion (BOS + text), or the user turn with --chat/--think."
)
@click.option(
    "-f",
    "--prompt-file",
    type=click.Path(path_type=Path),
    help="Read the prompt text from a file (- for stdin); one final newline is dropped.",
)
@click.option("--prompt-ids", help="Prompt as token ids: 1,2,3 (no tokenizer; prints ids).")
@click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="V4.1: an image for the prompt (repeat, in order): at its image markers, else before the text;"
    " with --chat/--think an image part of the (first) user turn.",
)
@click.option(
    "--chat", "chat_flag", is_flag=True, help="Chat format; without a prompt, an interactive chat reading stdin."
)
@click.option("--think", is_flag=True, help="As --chat, with thinking (the answer opens <think>).")
@click.option("--system", help="System prompt (--chat/--think).")
@click.option(
    "--reasoning-effort",
    default=None,
    help="Thinking effort, as the checkpoint's chat format spells it (V4.1: 1-100, or low/high/max ="
    " 50/75/100, default high; V4-0731: low [default], high, max; preview: high [default], max)."
    " Takes effect with --think (or /think in a chat).",
)
@click.option(
    "-n",
    "--gen",
    type=int,
    default=None,
    help=f"Most tokens to generate per answer; generation also stops when --ctx is full."
    f" [default: until EOS with --chat/--think, else {RAW_GEN}]",
)
@click.option(
    "-c",
    "--ctx",
    type=int,
    default=4096,
    show_default=True,
    help="Longest sequence (prompt + answers) the memory plan covers; generation stops there.",
)
@click.option(
    "--budget",
    type=float,
    default=None,
    help="GB (10^9 bytes) the whole process may hold. [default: 80% of available memory]",
)
@click.option(
    "--gpu",
    "use_gpu",
    is_flag=True,
    help="Dense trunk on a CUDA GPU through CuPy; without one, says so and runs on the CPU.",
)
@click.option("--vram", type=float, default=None, help="GB of VRAM --gpu may use. [default: free VRAM less a margin]")
@click.option("-t", "--threads", type=int, default=None, help="CPU kernel threads (results do not depend on it).")
@numerics_option(RUN_DEFAULT)
@click.option(
    "--prefill-segment",
    type=int,
    default=None,
    help="Prompt tokens that go through each layer together (each expert read once per segment)."
    " [default: the plan's, as large as --budget allows, up to 4096]",
)
@click.option(
    "--temperature",
    type=float,
    default=None,
    help=f"0 = greedy. [default: {CHAT_TEMPERATURE} with --chat/--think, else 0]",
)
@click.option(
    "--top-p",
    type=float,
    default=None,
    help="Nucleus sampling: keep the top tokens up to this probability. [default: 1, off]",
)
@click.option("--top-k", type=int, default=None, help="Keep the k most likely tokens. [default: 0, off]")
@click.option(
    "--min-p",
    type=float,
    default=None,
    help="Drop tokens below this fraction of the top token's probability. [default: 0, off]",
)
@click.option(
    "-s", "--seed", type=int, default=None, help="Seed of the sampler (same seed, same text). [default: random]"
)
@click.option("--greedy", is_flag=True, help="Always the most likely token (same as --temperature 0).")
@click.option(
    "--allow-special",
    is_flag=True,
    help="Let the sampler pick ids the tokenizer marks special (BOS, padding, placeholders). [default: never]",
)
@click.option(
    "--speculate",
    default="auto",
    show_default=True,
    help="Speculative decoding with the checkpoint's DSpark drafter (V4.1): auto (draft as many tokens"
    " as pay, from the costs measured as it runs; none where none pays), off, or N (always N drafts)."
    " Greedy ids are those of off; sampled ids are the same for a seed whatever the setting.",
)
@click.option(
    "--verify", is_flag=True, help="Re-read every expert and streamed layer with plain pread and compare bytes."
)
@click.option(
    "--stats", "show_stats", is_flag=True, help="Also print the detailed figures (cache, trunk, timing, sampling)."
)
@click.option("--stats-json", type=click.Path(path_type=Path), help="Write the run's figures as JSON.")
@click.option(
    "--route-log",
    type=click.Path(path_type=Path),
    help="Write one 'layer expert' line per expert request.",
)
@click.option(
    "--io",
    type=click.Choice(["direct", "buffered"]),
    default="direct",
    show_default=True,
    help="O_DIRECT reads or the page cache.",
)
@click.option("--io-threads", type=int, default=4, show_default=True, help="Expert reader threads (queue depth).")
@click.option(
    "--trunk",
    type=click.Path(path_type=Path),
    help="Packed trunk directory. [default: CHECKPOINT/dsv4-trunk if packed, else the shards]",
)
@click.option(
    "--tok",
    type=click.Path(path_type=Path),
    help="Packed tokenizer. [default: CHECKPOINT/dsv4-tokenizer.pack, else the checkpoint's tokenizer files]",
)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def run(
    checkpoint: Path,
    prompt: str | None,
    prompt_file: Path | None,
    prompt_ids: str | None,
    images: tuple[Path, ...],
    chat_flag: bool,
    think: bool,
    system: str | None,
    reasoning_effort: str | None,
    gen: int | None,
    ctx: int,
    budget: float | None,
    use_gpu: bool,
    vram: float | None,
    threads: int | None,
    numerics: str,
    prefill_segment: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
    greedy: bool,
    allow_special: bool,
    speculate: str,
    verify: bool,
    show_stats: bool,
    stats_json: Path | None,
    route_log: Path | None,
    io: str,
    io_threads: int,
    trunk: Path | None,
    tok: Path | None,
    debug: bool,
) -> None:
    """Generate from CHECKPOINT with routed experts streamed from disk within --budget.

    --prompt TEXT completes TEXT; --chat/--think --prompt TEXT answers it as a user turn;
    --chat/--think alone opens an interactive chat (/help inside lists its commands).
    """
    if chat_flag and think:
        raise UsageError("--chat and --think conflict; give one (--think is the chat format with thinking on)")
    mode = "think" if think else "chat" if chat_flag else None
    sources = [
        n
        for n, v in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--prompt-ids", prompt_ids))
        if v is not None
    ]
    if len(sources) > 1:
        raise UsageError(f"{' and '.join(sources)} conflict; give one prompt")
    if prompt_ids is not None and (mode or system is not None):
        raise UsageError("--prompt-ids is a raw id prompt; --chat, --think and --system need --prompt TEXT")
    if system is not None and mode is None:
        raise UsageError("--system needs --chat or --think (a raw --prompt has no system turn)")
    if reasoning_effort is not None and mode is None:
        raise UsageError("--reasoning-effort needs --think (or --chat, for /think in the chat)")
    if not sources and mode is None:
        raise UsageError("give --prompt TEXT, --prompt-file F or --prompt-ids 1,2,3, or --chat for an interactive chat")
    if vram is not None and not use_gpu:
        raise UsageError("--vram applies to --gpu; add --gpu or drop --vram")
    if gen is None and mode is None:
        gen = RAW_GEN
    checks = (("--gen", gen), ("--ctx", ctx), ("--threads", threads), ("--io-threads", io_threads))
    for name, value in (*checks, ("--prefill-segment", prefill_segment)):
        if value is not None and value < 1:
            raise UsageError(f"{name} {value}: give at least 1")
    params = sampling_params(temperature, top_p, top_k, min_p, seed, greedy, mode is not None)
    if not params.greedy and params.seed is None:
        params = replace(params, seed=int(np.random.SeedSequence().entropy % 2**31))  # reported, so reproducible
    checkpoint = checkpoint_dir(checkpoint)
    cfg = ModelConfig.from_json(checkpoint / "config.json")
    encoder = chat.encoder_for(cfg.layout, cfg.family)
    try:
        effort = chat.parse_effort(reasoning_effort, encoder)
    except UsageError:
        raise UsageError(
            f"--reasoning-effort {reasoning_effort}: this checkpoint's chat format ({encoder}) has"
            f" {chat.effort_help(encoder)}"
        ) from None
    spec = speculate_setting(speculate, cfg)
    check_trunk(trunk)
    check_output(stats_json, "--stats-json")
    check_output(route_log, "--route-log")
    budget_b = budget_bytes(budget)
    check_ctx(ctx, cfg, budget_b)
    parts = [ImagePart(str(p), read_image_file(p)) for p in images]
    inputs = inputs_for(cfg, [(p.name, p.data) for p in parts]) if parts else []  # bad images fail now

    text = prompt_text(prompt, prompt_file, ctx)
    if prompt_ids is not None:
        tokenizer, ids = None, id_prompt(prompt_ids, cfg)
    else:
        tokenizer = load_tokenizer(checkpoint, tok, cfg)
        ids = None if text is None else text_prompt(tokenizer, text, mode, system, effort, encoder, parts)
    n_prompt = len(ids) if ids is not None else 0
    if ids is not None and inputs:
        ids = with_markers(ids, cfg, len(inputs)) if mode is None else ids
        n_prompt = expanded_length(ids, cfg, inputs)
    if ids is not None and n_prompt >= ctx:
        raise UsageError(
            f"the prompt ({n_prompt} tokens) leaves no room to answer within --ctx {ctx}; raise --ctx above {n_prompt}"
        )

    say = lambda msg: click.echo(msg, err=True)
    warning = budget_warning(budget_b)
    if warning is not None:
        say(f"warning: {warning}")
    if ids is None and hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")  # a bad line is refused, not the end of the chat
    stats_out = StatsOut(stats_json, params)
    gctx = gpu.setup(use_gpu, vram, threads)
    for line in gctx.take_messages():
        say(line)
    # the route log is written as the run goes, into a temporary file that replaces --route-log
    # only when the run ends without an error
    route_file = AtomicFile(route_log, "w", encoding="ascii") if route_log is not None else None
    try:
        opts = RunOptions(
            budget=budget_b, io=io, verify=verify, threads=gctx.threads,
            io_threads=io_threads, trunk=trunk, route_log=route_file, ctx=ctx, prefill_segment=prefill_segment,
            gpu=gctx if gctx.enabled else None, numerics=numerics,
            images=bool(parts) or (ids is None and cfg.vision is not None), speculate=spec,
        )  # fmt: skip
        with stats_out, Runtime.open(checkpoint, opts, warn=lambda m: say(f"dsv4: {m}")) as rt:
            stats_out.rt = rt
            for line in gctx.take_messages():
                say(line)
            plan_lines = rt.plan.lines()
            for line in plan_lines:
                say(line)
            n_ids = tokenizer.n_tokens if tokenizer is not None else cfg.vocab_size
            # the draws are keyed by position (`engine.spec_draws`): a seed gives the same ids
            # whatever --speculate and the budget
            uniforms = None if params.greedy else PositionUniforms(params.seed)
            pick = make_pick(params, n_ids, uniforms or np.random.default_rng(), banned_ids(tokenizer, allow_special))

            def figures() -> RunStats:
                stats = rt.stats()
                for line in report_lines(stats):
                    say(line)
                detail = stats.lines() + ([gctx.stats_line()] if use_gpu else [])
                detail.append(f"sampling: {_describe(params)}; speculate {rt.speculator.default}")
                for line in detail if show_stats else []:
                    say(line)
                for w in stats.warnings if not show_stats else []:
                    if f"warning: {w}" not in plan_lines:
                        say(f"warning: {w}")
                return stats

            stopped = False
            if ids is None:
                if tokenizer is None or mode is None:
                    raise InternalError("a chat without a tokenizer or chat mode")
                conv = Conversation(tokenizer, mode, system, effort=effort, encoder=encoder)
                conv.attached = parts  # --image: parts of the first turn
                chat_loop(rt, conv, ChatSettings(gen, ctx, pick, uniforms), say, figures)
            else:
                limit = gen if gen is not None else ctx
                stopped = _one_shot(rt, ids, limit, pick, tokenizer, mode, say, inputs, uniforms)
            stats_out.stats = figures()
            if stopped:
                stats_out.status = "interrupted"
        if route_file is not None:
            route_file.commit()
    finally:
        if route_file is not None:
            route_file.discard()  # a no-op after commit
        gctx.close()
    if stopped:
        sys.exit(130)


def speculate_setting(value: str, cfg: ModelConfig) -> str | int:
    """--speculate as "auto", "off" or N, checked against the checkpoint: auto is off where it has
    no drafter this code runs; N there is a UsageError saying why."""
    why = drafter_reason(cfg)
    spec = parse_setting(value, cfg.dspark.block_size if why is None else None)
    if isinstance(spec, int) and why is not None:
        raise UsageError(f"--speculate {spec}: this checkpoint cannot draft: {why}; use --speculate off")
    return spec


def check_ctx(ctx: int, cfg: ModelConfig, budget: int) -> None:
    """--ctx within the model's positions and within the budget (the state grows with it)."""
    if ctx > cfg.max_position_embeddings:
        raise UsageError(
            f"--ctx {ctx} is beyond the model's max_position_embeddings {cfg.max_position_embeddings}; lower --ctx"
        )
    state = planner.state_bytes_for(cfg, ctx)
    if state >= budget:
        raise BudgetError(
            f"--ctx {ctx} needs {state / planner.GB:.2f} GB of sequence state (KV window, compressed rows,"
            f" compressor states), more than the whole --budget {budget / planner.GB:.2f} GB; lower --ctx or raise --budget"
        )


class StatsOut:
    """Writes --stats-json when the run ends, however it ends: the figures so far (when the
    runtime opened) and `exit` = {status: ok | error | interrupted, message}."""

    def __init__(self, path: Path | None, params: SamplingParams) -> None:
        self.path = path
        self.params = params
        self.rt: Runtime | None = None
        self.stats: RunStats | None = None
        self.status = "ok"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if self.path is None:
            return
        message = ""
        if isinstance(exc, KeyboardInterrupt):
            self.status, message = "interrupted", "Ctrl-C"
        elif exc is not None:
            self.status, message = "error", str(exc) if isinstance(exc, Dsv4Error) else f"{type(exc).__name__}: {exc}"
        doc: dict = {}
        stats = self.stats
        if stats is None and self.rt is not None:
            try:
                stats = self.rt.stats()
            except Exception:  # noqa: BLE001 (the figures are a courtesy; the original error matters)
                stats = None
        if stats is not None:
            doc.update(stats.as_dict())
        doc.update(sampling=asdict(self.params), exit={"status": self.status, "message": message})
        atomic_write(self.path, json.dumps(doc, indent=1) + "\n")


def _one_shot(
    rt: Runtime,
    ids: list[int],
    gen: int,
    pick: Pick,
    tok: Tokenizer | None,
    mode: str | None,
    say,
    images: Sequence[ImageInput] = (),
    uniforms: PositionUniforms | None = None,
) -> bool:
    """One answer to stdout (ids as they come without a tokenizer); True when Ctrl-C stopped it. Why it
    ended is in the report. `images`: one per image marker in `ids`, expanded to their spans here."""
    spans = None
    if images:
        ip = image_prompt(rt.engine, np.asarray(ids, dtype=np.int64), list(images))
        ids, spans = [int(i) for i in ip.ids], ip.spans
    try:
        with Interrupt() as flag:
            reply = answer(
                rt, rt.session(), ids, gen=gen, pick=pick, tok=tok, thinking=mode == "think", interrupt=flag,
                spans=spans, uniforms=uniforms,
            )  # fmt: skip
    except Stopped as e:
        say(f"dsv4: stopped during the prefill after {e.done} of {e.total} prompt tokens")
        return True
    finally:
        click.echo("")  # ends the line of ids or text, whatever stopped it
    if reply.stopped:
        say("dsv4: stopped")
    return reply.stopped


def _describe(p: SamplingParams) -> str:
    if p.greedy:
        return "greedy"
    return f"temperature {p.temperature:g}, top-p {p.top_p:g}, top-k {p.top_k}, min-p {p.min_p:g}, seed {p.seed}"
