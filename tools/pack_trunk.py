#!/usr/bin/env python3
"""Pack a checkpoint's trunk (everything but the routed experts) into aligned per-layer runs.

Usage: tools/pack_trunk.py CHECKPOINT_DIR [OUT_DIR] [--layers N] [--force] [--no-progress]
Same as `dsv4 pack-trunk`. OUT_DIR defaults to CHECKPOINT_DIR/dsv4-trunk. Exits 2 with
`dsv4: <message>` on a problem (broken checkpoint, too little disk space, OUT_DIR in use).
"""

import sys
from pathlib import Path

# Run from a source tree without installing: the package sits next to tools/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import click

    from dsv4stream.cli.pack import pack_trunk_cmd
    from dsv4stream.errors import Dsv4Error

    try:
        pack_trunk_cmd.main(args=argv, prog_name="pack_trunk.py", standalone_mode=False)
    except Dsv4Error as e:
        print(f"dsv4: {e}", file=sys.stderr)
        return 2
    except click.ClickException as e:
        e.show()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
