"""`dsv4 inspect`: what a checkpoint (or a bare config.json) implies, and whether it is whole."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import click

from ..checkpoint.catalog import Catalog
from ..checkpoint.config import DSPARK, DSPARK_V41, LAYOUTS, SUPPORTED_MODEL_TYPES, ModelConfig
from ..checkpoint.spec import drafter_nbytes, trunk_nbytes, unused_summary
from ..checkpoint.spec_v41 import is_vision, vision_nbytes
from ..checkpoint.tensors import is_drafter
from ..engine.numerics import RUN_DEFAULT
from ..errors import CheckpointError, UsageError
from ..gpu.plan import Matrix, moved_bytes, plan_placement
from ..gpu.trunk import HEAD, candidates, candidates_from_config
from ..run.memory import max_batch_for, needs_of
from ..run.planner import GB, family_planner, gb_up, minimum_budget, plan
from ..trunkpack.format import MANIFEST
from ..trunkpack.packdir import default_out_dir
from ..trunkpack.reader import TrunkFile
from .numerics_option import numerics_option

GIB = 1 << 30


def _gib(n: int) -> str:
    """Bytes in binary units, with decimal GB alongside for large sizes."""
    if n >= GIB // 10:
        return f"{n / GIB:.2f} GiB ({n / 1e9:.2f} GB)"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def config_summary(cfg: ModelConfig, drafter_bytes: int | None = None, vision_bytes: int | None = None) -> list[str]:
    """What config.json implies; `drafter_bytes` / `vision_bytes`: the mtp.* and vision bytes
    measured on the shards (else the release dtypes' estimate)."""
    kinds = Counter(cfg.layer_kinds)
    t = trunk_nbytes(cfg, include_mtp=True)
    ratios = ",".join(str(r) for r in cfg.compress_ratios[: cfg.n_layers])
    unused = unused_summary(
        cfg,
        drafter_nbytes(cfg) if drafter_bytes is None else drafter_bytes,
        vision_nbytes(cfg) if vision_bytes is None else vision_bytes,
    )
    drafter = cfg.layout in (DSPARK, DSPARK_V41)
    out = [
        f"model: {SUPPORTED_MODEL_TYPES[cfg.model_type]} (model_type {cfg.model_type})",
        f"layout: {LAYOUTS[cfg.layout]}" + (f"; {unused}" if unused else ""),
        f"layers: {cfg.n_layers} main + {cfg.n_mtp} {'DSpark stages' if drafter else 'MTP'}; kinds: "
        + ", ".join(f"{k}={v}" for k, v in sorted(kinds.items()))
        + f"; hash layers: {min(cfg.num_hash_layers, cfg.n_layers)}",
        f"compress ratios (main): {ratios}",
    ]
    if cfg.shared is not None:
        sh = cfg.shared
        out.append(
            f"shared attention: kv sources {list(sh.kv_sources)} (own a compressor), index sources"
            f" {list(sh.index_sources)} (own an indexer)"
            + (
                f", candidate source {sh.candidate_source} ({sh.candidate_topk_blocks} blocks of"
                f" {sh.candidate_block_size})"
                if sh.candidate_source >= 0
                else ""
            )
        )
    if cfg.engram is not None:
        e = cfg.engram
        out.append(
            f"engram: layers {list(e.layer_ids)}, tables of {', '.join(f'{r:,}' for r in e.rows)} rows x"
            f" {e.head_dim} (FP8 + E8M0 per 32 = {e.row_bytes} bytes a row), {_gib(e.table_bytes)} on disk,"
            f" never resident; {e.columns} rows per token per layer ({e.columns * e.row_bytes:,} bytes)"
        )
    if cfg.vision is not None:
        v, tower = cfg.vision, vision_nbytes(cfg) if vision_bytes is None else vision_bytes
        acts = family_planner(cfg).vision_activation_bytes(cfg)
        out.append(
            f"vision: {v.num_hidden_layers} blocks x {v.hidden_size}, patch {v.patch_size}, up to"
            f" {v.max_image_tokens} tokens an image; tower {_gib(tower)} (BF16) + {_gib(acts)} of activations"
            " for the largest image, planned in --budget when a run takes images (--image, a chat)"
        )
    return out + [
        (
            f"dims: hidden {cfg.hidden_size}, heads {cfg.num_attention_heads} x {cfg.head_dim} (rope {cfg.qk_rope_head_dim}),"
            f" q_lora {cfg.q_lora_rank}, o {cfg.o_groups}x{cfg.o_lora_rank}, window {cfg.sliding_window}, vocab {cfg.vocab_size}"
        ),
        (
            f"experts: {cfg.n_routed_experts} routed/layer, {cfg.num_experts_per_tok} per token, {cfg.n_shared_experts} shared,"
            f" {cfg.expert_dtype} {cfg.moe_intermediate_size}x{cfg.hidden_size}"
        ),
        f"expert bytes: {cfg.expert_bytes:,} bytes per expert",
        f"working set per pass: {cfg.working_set_experts} experts = {_gib(cfg.working_set_bytes)}",
        f"all routed experts: {_gib(cfg.total_expert_bytes)}",
        f"trunk: {_gib(t['trunk'])}; embed {_gib(t['embed'])}; head {_gib(t['head'])}; mtp.* without experts {_gib(t['mtp'])}"
        + (f"; vision {_gib(t['vision'])}" if cfg.vision is not None else ""),
    ]


@click.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--config-only", is_flag=True, help="PATH is a config.json: plan without weights.")
@click.option(
    "--budget",
    type=float,
    multiple=True,
    help="Also show how this --budget (GB) would be split (release dtypes; repeat for several).",
)
@click.option("--ctx", type=int, default=4096, show_default=True, help="Sequence length the plan covers.")
@click.option(
    "--trunk",
    type=click.Path(path_type=Path),
    help="Packed trunk to check in full (every checksum). [default: CHECKPOINT/dsv4-trunk if packed]",
)
@click.option(
    "--gpu", "use_gpu", is_flag=True, help="Also plan which trunk matrices `--gpu` puts in VRAM (no GPU needed)."
)
@click.option("--vram", type=float, default=None, help="GB of VRAM for weights in the --gpu plan. [default: 8, 16, 24]")
@numerics_option(RUN_DEFAULT, " The --budget plans are those of a run with this setting (the int8 head copy).")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def inspect(
    path: Path,
    config_only: bool,
    budget: tuple[float, ...],
    ctx: int,
    trunk: Path | None,
    use_gpu: bool,
    vram: float | None,
    numerics: str,
    debug: bool,
) -> None:
    """Summarise a checkpoint, validate every tensor against its config, and check its packed trunk."""
    if vram is not None and not use_gpu:
        raise UsageError("--vram applies to --gpu; add --gpu or drop --vram")
    if vram is not None and not vram >= 0:
        raise UsageError(f"--vram {vram}: give a number of GB, at least 0")
    if config_only or path.suffix == ".json":
        cfg_path = path if path.suffix == ".json" else path / "config.json"
        cfg = ModelConfig.from_json(cfg_path)
        for line in config_summary(cfg):
            click.echo(line)
        mats = _gpu_plans(candidates_from_config(cfg), vram, "release dtypes, from config.json") if use_gpu else None
        _plans(cfg_path, budget, ctx, numerics, mats, vram)  # a config.json: estimated, even beside the shards
        return
    cat = Catalog.open(path)
    mtp_bytes = sum(e.nbytes for n, e in cat.entries.items() if is_drafter(n))
    vision_bytes = sum(e.nbytes for n, e in cat.entries.items() if is_vision(n))
    for line in config_summary(cat.config, mtp_bytes, vision_bytes):
        click.echo(line)
    shards = len({e.path for e in cat.entries.values()})
    click.echo(f"checkpoint: {len(cat.entries)} tensors in {shards} shards, {_gib(cat.nbytes)} on disk")
    problems = cat.problems()
    if problems:
        for p in problems:
            click.echo(f"  problem: {p}", err=True)
        raise CheckpointError(
            f"{path}: {len(problems)} tensor problem(s) listed above; the shards do not match config.json"
        )
    click.echo("all tensors present with the expected dtype and shape")
    _check_trunk(cat, trunk)
    mats = _gpu_plans(candidates(cat), vram, "measured on the shards") if use_gpu else None
    _plans(path, budget, ctx, numerics, mats, vram)


def _check_trunk(cat: Catalog, trunk: Path | None) -> None:
    """Every run of the packed trunk re-hashed (blake2b) against its manifest."""
    where = trunk if trunk is not None else default_out_dir(cat.root)
    if trunk is None and not (where / MANIFEST).is_file():
        click.echo(f"packed trunk: none in {where}")
        return
    t0 = time.perf_counter()
    tf = TrunkFile.open(where, cat, verify=True)
    nbytes = sum(r.nbytes for r in tf.runs.values())
    click.echo(
        f"packed trunk {where}: {len(tf.runs)} runs, {_gib(nbytes)}, every checksum verified"
        f" in {time.perf_counter() - t0:.1f} s"
    )
    e = tf.head_q8
    click.echo(
        f"int8 head copy: {e['file']}, {_gib(e['file_bytes'])}, read by --numerics fast for the logits"
        if e is not None
        else f"int8 head copy: none (--numerics fast reads the BF16 head; `dsv4 upgrade-trunk {where}` adds it)"
    )


def _gpu_plans(mats: list[Matrix], vram: float | None, source: str) -> list[Matrix]:
    """What `--gpu` could place (every candidate trunk matrix, by kind) and its plan at `vram`
    GB (default: a few common sizes). No GPU is needed: the plan is arithmetic on sizes."""
    by_kind: Counter = Counter()
    for m in mats:
        by_kind[m.kind] += m.device_bytes
    head = sum(m.device_bytes for m in mats if m.key == (None, HEAD))
    kinds = ", ".join(f"{k.upper()} {by_kind[k] / 1e9:.2f} GB" for k in ("fp8", "bf16", "f32") if by_kind[k])
    click.echo(
        f"gpu: {len(mats)} trunk matrices could go to VRAM: {sum(by_kind.values()) / 1e9:.2f} GB there ({kinds};"
        f" the head {head / 1e9:.2f} GB), {sum(m.host_bytes for m in mats) / 1e9:.2f} GB in RAM ({source});"
        f" FP8 scales widen to float32 in VRAM; routed experts and Engram rows stay on the CPU"
    )
    for gb in (vram,) if vram is not None else (8.0, 16.0, 24.0):
        click.echo(f"gpu: --vram {gb:g}: {plan_placement(mats, int(gb * GB)).summary()}")
    return mats


def _plans(
    path: Path,
    budgets: tuple[float, ...],
    ctx: int,
    numerics: str,
    mats: list[Matrix] | None = None,
    vram: float | None = None,
) -> None:
    """The planner's split of each budget: measured on a checkpoint exactly as `dsv4 run
    --numerics NUMERICS` plans it (the same lines it prints), estimated from a bare config.json.
    With `mats` and `vram` (--gpu --vram), the matrices placed in VRAM leave the host plan, as in
    `dsv4 run --gpu` (the CUDA context's own host memory is measured at start-up there, not
    counted here); a head in VRAM has no int8 copy on the CPU."""
    if not budgets:
        return
    needs, source = needs_of(path, ctx=ctx, numerics=numerics)
    if mats is not None and vram is not None:
        per_layer, head = moved_bytes(mats, plan_placement(mats, int(vram * GB)))
        needs = replace(
            needs,
            layer_bytes=tuple(b - per_layer.get(i, 0) for i, b in enumerate(needs.layer_bytes)),
            head_bytes=needs.head_bytes - head,
        )
        if head:
            needs = replace(needs, head_q8_bytes=0, head_matrix_bytes=0)
        source += f"; with --gpu --vram {vram:g}"
    click.echo(f"smallest budget that runs: {gb_up(minimum_budget(needs))} ({source})")
    for b in budgets:
        if not b > 0:
            raise UsageError(f"--budget {b}: give a positive number of GB")
        for line in plan(needs, int(b * GB)).lines():
            click.echo(line)
        fit = max_batch_for(needs.state_bytes, int(b * GB))
        click.echo(
            f"  serving: {fit} request{'s' if fit > 1 else ''} decoded together (`dsv4 serve --max-batch` default),"
            f" each holding a {gb_up(needs.state_bytes)} state for --ctx {ctx}; more wait in the queue"
        )
