"""`dsv4 pack-trunk` and `dsv4 upgrade-trunk`: argument handling and the summary line; the work is in
`dsv4stream.trunkpack.writer` and `dsv4stream.trunkpack.upgrade`."""

from __future__ import annotations

from pathlib import Path

import click

from ..trunkpack.format import FORMAT, TRUNK_FILE
from ..trunkpack.upgrade import upgrade_trunk
from ..trunkpack.writer import pack_trunk


@click.command("pack-trunk")
@click.argument("checkpoint_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("out_dir", required=False, type=click.Path(path_type=Path))
@click.option("--layers", type=int, default=None, help="Pack only main layers 0..N-1 (a partial pack).")
@click.option("--force", is_flag=True, help="Replace an OUT_DIR that holds another pack.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def pack_trunk_cmd(
    checkpoint_dir: Path, out_dir: Path | None, layers: int | None, force: bool, no_progress: bool
) -> None:
    """Pack every tensor that is not a routed expert into per-layer runs aligned to 4096 bytes.

    OUT_DIR defaults to CHECKPOINT_DIR/dsv4-trunk. An interrupted pack resumes where it
    stopped when run again; the output appears only once it is complete. A BF16 head also gets
    an int8 copy (head-q8.bin, half its size), which --numerics fast reads for the logits; on a
    finished pack without one, pack-trunk adds it in place.
    """
    r = pack_trunk(checkpoint_dir, out_dir, layers, force=force, progress=not no_progress)
    if r.up_to_date:
        click.echo(f"{r.path}: already packed from this checkpoint ({r.runs} runs); nothing to do")
        return
    if r.head_copy_added:
        click.echo(f"{r.path}: already packed from this checkpoint; added the int8 head copy")
        return
    mb = r.bytes_written / 1e6
    click.echo(
        f"{r.path}: {r.runs} runs, wrote {len(r.written)} ({mb:,.1f} MB) and kept {len(r.skipped)} verified,"
        f" in {r.seconds:.1f} s ({mb / max(r.seconds, 1e-9):,.0f} MB/s)"
    )


@click.command("upgrade-trunk")
@click.argument("pack_dir", type=click.Path(path_type=Path))
@click.option(
    "--checkpoint",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The checkpoint the pack was made from (default: the folder holding PACK_DIR).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def upgrade_trunk_cmd(pack_dir: Path, checkpoint: Path | None, no_progress: bool) -> None:
    """Upgrade a trunk pack of an older format in place.

    The old manifest is checked whole first (every tensor in its run, once, named, typed and
    shaped as in the checkpoint). Every run is read once and checked with its blake2b, and
    each tensor's bytes against the checkpoint's bytes of that name; only when all match are
    the new checksums (xxh3, checked on every read of every run) written into the manifest.
    The data file is never rewritten. Anything that fails leaves the pack unchanged.
    """
    from ..trunkpack.writer import tqdm_bar

    with tqdm_bar(_pack_bytes(pack_dir), "upgrade-trunk", not no_progress) as bar:
        r = upgrade_trunk(pack_dir, bar.update, checkpoint)
    if r.up_to_date:
        click.echo(f"{r.path}: already format {FORMAT}; nothing to do")
        return
    if r.old_format == FORMAT:
        click.echo(f"{r.path}: format {FORMAT}; added the int8 head copy that fast numerics reads")
        return
    click.echo(
        f"{r.path}: {r.runs} runs checked with blake2b ({r.bytes_checked / 1e6:,.1f} MB);"
        f" upgraded from {r.old_format} to {FORMAT}" + (", and added the int8 head copy" if r.head_copy else "")
    )


def _pack_bytes(pack_dir: Path) -> int:
    """The data file's size for the progress bar (0 when it cannot be told yet: the upgrade says why)."""
    try:
        return (pack_dir / TRUNK_FILE).stat().st_size
    except OSError:
        return 0
