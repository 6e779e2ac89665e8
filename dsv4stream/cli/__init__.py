"""The `dsv4` command: a click group whose default sub-command is `run`.

Owns: assembling the sub-commands (each lives in a module of this package), the default
command (`dsv4 CHECKPOINT ...` means `dsv4 run CHECKPOINT ...`), and the one place where
errors become `dsv4: <message>` with exit code 2 (a traceback only with --debug).
"""

from __future__ import annotations

import errno
import os
import sys
import traceback

import click

from ..errors import Dsv4Error

DEFAULT_COMMAND = "run"


class DefaultGroup(click.Group):
    """A group that treats an unknown first word (a checkpoint path) as `run`'s argument."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from .registry import check_not_a_typo

        first_is_command = not args or args[0] in self.commands or args[0] in ("--help", "-h", "--version")
        if not first_is_command and DEFAULT_COMMAND in self.commands:
            check_not_a_typo(args[0], sorted(self.commands), "dsv4")
            args = [DEFAULT_COMMAND, *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dsv4stream")
def cli() -> None:
    """Run DeepSeek-V4 from its official checkpoint with experts streamed from disk.

    `dsv4 CHECKPOINT [options]` is `dsv4 run CHECKPOINT [options]`.
    """


def _register() -> None:
    from . import registry

    for cmd in registry.commands():
        cli.add_command(cmd)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the group, turning Dsv4Error into one line and exit 2."""
    args = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in args or os.environ.get("DSV4_DEBUG") == "1"
    _register()
    try:
        cli.main(args=args, prog_name="dsv4", standalone_mode=False)
    except Dsv4Error as e:
        if debug:
            traceback.print_exc()
        click.echo(f"dsv4: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("dsv4: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        # click's usage errors become one line too: what is wrong, and where the help is
        cmd = e.ctx.command_path if getattr(e, "ctx", None) is not None else "dsv4"
        click.echo(f"dsv4: {e.format_message().rstrip('.')}; see `{cmd} --help`", err=True)
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("dsv4: interrupted", err=True)
        sys.exit(130)
    except OSError as e:
        if debug:
            traceback.print_exc()
        click.echo(f"dsv4: {os_error_line(e)}", err=True)
        sys.exit(2)


def os_error_line(e: OSError) -> str:
    """One line for an OSError that reached the top: the file when the system named it, and
    advice that fits the error (a full disk is not a permissions problem)."""
    what = e.strerror or str(e) or type(e).__name__
    where = f"{e.filename}: " if e.filename else ""
    if e.filename2:
        where = f"{e.filename} -> {e.filename2}: "
    advice = {
        errno.ENOSPC: "free space on that disk and run again (pack-trunk resumes where it stopped)",
        errno.EDQUOT: "free space within your quota and run again",
        errno.EACCES: "check the permissions",
        errno.EPERM: "check the permissions",
        errno.ENOENT: "check the path",
        errno.ENOTDIR: "check the path",
        errno.EIO: "the disk reported an error reading or writing; check it (dmesg) and the file",
    }.get(e.errno, "check the file and the disk")
    unnamed = "" if e.filename else " (the system did not say which file; --debug shows where)"
    return f"{where}{what}{unnamed}; {advice}"
